"""Run names: unique per pipeline run, and the Kubernetes object prefix derived from a name.

Two pipeline runs given the same `run_name` must never share a folder, an MLflow run or a cluster
object, or one run's cleanup deletes the other's. So the pipeline's name for a run is the submitter's
name plus a suffix from the KFP run id (`pipeline_run_name`), and every step derives it the same way.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Protocol

DNS_LABEL = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"  # run names leave room for suffixes within 63 chars
RUN_ID_SUFFIX_CHARS = 8
MAX_RUN_NAME = 63


class _Named(Protocol):
    """What a run name is made of: a GRPOConfig's `tracking` section."""

    run_name: str | None
    mlflow_experiment_name: str


def slug(text: str) -> str:
    """Lower-case ASCII letters, digits and single dashes."""
    chars = "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in chars.split("-") if part)


def pipeline_run_name(run_name: str, pipeline_job_name: str = "", pipeline_job_id: str = "") -> str:
    """The name of one pipeline run's folder, MLflow run and cluster objects: the slug of `run_name` (else of
    `pipeline_job_name`, else "async-grpo"), at most 63 characters, then `-<8 characters of the KFP run id>`
    when `pipeline_job_id` is known, so two runs submitted with the same name never collide.

    Args:
        run_name: the submitter's name for the run (may be empty).
        pipeline_job_name: the KFP job name (`dsl.PIPELINE_JOB_NAME_PLACEHOLDER`).
        pipeline_job_id: the KFP run id (`dsl.PIPELINE_JOB_ID_PLACEHOLDER`); empty: no suffix.
    """
    suffix = slug(pipeline_job_id).replace("-", "")[:RUN_ID_SUFFIX_CHARS]
    room = MAX_RUN_NAME - (len(suffix) + 1 if suffix else 0)
    base = slug(run_name or pipeline_job_name or "async-grpo")[:room].strip("-") or "async-grpo"
    return f"{base}-{suffix}" if suffix else base


def make_run_name(config: _Named, unique: bool = True) -> str:
    """A DNS-1123 run name, `agrpo-<slug of run_name or experiment>[-<6 random hex>]`, at most 40 characters.

    Args:
        unique: append a random suffix (launches); False gives a stable name (rendered manifests).
    """
    text = slug(config.run_name or config.mlflow_experiment_name)[:26].strip("-") or "run"
    return f"agrpo-{text}-{secrets.token_hex(3)}" if unique else f"agrpo-{text}"


def k8s_run_name(run_name: str) -> str:
    """The object-name prefix of a named run: the name itself when it is already a DNS-1123 label of at
    most 40 characters starting with a letter, else a slug plus 8 hex of its hash. Deterministic, so
    `cleanup(run_name)` finds what `launch` created for a config with that `run_name`."""
    text = slug(run_name)
    if re.match(DNS_LABEL, text) and text == run_name:
        return text
    prefix = text if text[:1].isalpha() else f"r-{text}"
    return f"{prefix[:31].rstrip('-')}-{hashlib.sha256(run_name.encode()).hexdigest()[:8]}"


def resolve_run_name(config: _Named, unique: bool = True) -> str:
    """The object-name prefix of a launch of `config`: `k8s_run_name(config.run_name)` for a named run,
    else `make_run_name(config, unique)`."""
    return k8s_run_name(config.run_name) if config.run_name else make_run_name(config, unique=unique)
