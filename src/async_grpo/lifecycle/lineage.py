"""What made a model: the facts every registered version carries as tags, so its MLflow page answers that question.

A version records the version it was warm-started from, the digests of the data it was trained and judged on, a
digest of its resolved config, the code (package version, git commit, image digest when known), the KFP run and the
MLflow run that produced it, and the head-to-head evaluation that let it in. Each value is a string (MLflow tags
are strings; at most 5,000 characters each, far above what these hold).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import yaml

import async_grpo

GIT_COMMIT_ENV = "ASYNC_GRPO_GIT_COMMIT"  # set by the images' build (`--build-arg GIT_COMMIT=...`)
IMAGE_DIGEST_ENV = "ASYNC_GRPO_IMAGE_DIGEST"  # set by whoever deploys an image by digest
GIT_TIMEOUT_S = 5.0


def config_digest(resolved_config: str) -> str:
    """sha256 (hex) of a resolved GRPOConfig YAML, over its canonical JSON form (keys sorted), so the same config
    gives the same digest whatever the YAML's key order or layout.

    Raises:
        yaml.YAMLError: the text is not YAML.
    """
    canonical = json.dumps(yaml.safe_load(resolved_config) or {}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def git_commit() -> str:
    """The commit of the code that runs: `ASYNC_GRPO_GIT_COMMIT` (baked into the images), else `git rev-parse HEAD`
    in the checkout holding this package (an editable install), else "" (unknown)."""
    if os.environ.get(GIT_COMMIT_ENV):
        return os.environ[GIT_COMMIT_ENV]
    root = Path(async_grpo.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return ""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def lineage_tags(
    *,
    resolved_config: str,
    parent_version: str = "",
    dataset: Mapping[str, object] | None = None,
    kfp_run_id: str = "",
    mlflow_run_id: str = "",
    evaluation: Mapping[str, float] | None = None,
    decision: str = "",
) -> dict[str, str]:
    """The lineage tags of one registered version.

    Args:
        resolved_config: the run's resolved GRPOConfig YAML (`train_grpo`'s output).
        parent_version: the version the run was warm-started from (`<name>/<version>`), "" for a base model.
        dataset: the `prepare_dataset` artifact's metadata; its `resolved_uri`, `train_digest` and `eval_digest`
            are recorded when present (`dataset.source`, `dataset.train_digest`, `dataset.eval_digest`).
        kfp_run_id: the KFP run id.
        mlflow_run_id: the training run.
        evaluation: the `evaluate` step's numbers (`eval.<key>`; NaN left out).
        decision: the registration gate's reason.

    Returns:
        tag name -> value; empty values are left out, so "unknown" reads as absent.
    """
    data = dataset or {}
    tags = {
        "parent_version": parent_version,
        "config_sha256": config_digest(resolved_config),
        "async_grpo.version": async_grpo.__version__,
        "git_commit": git_commit(),
        "image_digest": os.environ.get(IMAGE_DIGEST_ENV, ""),
        "kfp.run_id": kfp_run_id,
        "mlflow_run_id": mlflow_run_id,
        "dataset.source": str(data.get("resolved_uri") or data.get("source") or ""),
        "dataset.train_digest": str(data.get("train_digest") or ""),
        "dataset.eval_digest": str(data.get("eval_digest") or ""),
        "eval.decision": decision,
    }
    for key, value in (evaluation or {}).items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            tags[f"eval.{key}"] = repr(float(value))
    return {k: v for k, v in tags.items() if v}
