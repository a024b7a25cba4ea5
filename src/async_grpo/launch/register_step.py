"""The pipeline's register step: the training run's logged model as a new registry version, and the champion alias
moved to it; the body of `components/register_model` (whose docstrings tell the design), as a package function.

The order is the step's security contract: in a cluster pod the platform policy's decision on the MLflow server and
the registered model (`k8s_policy.check_step`) comes before the step loads its MLflow credentials
(`step_secrets.load_step_secrets`) or touches the registry.
"""

from __future__ import annotations

import getpass
import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import mlflow
from mlflow.exceptions import MlflowException

from async_grpo import step_secrets
from async_grpo.launch import k8s_policy
from async_grpo.lifecycle import registry
from async_grpo.lifecycle.lineage import lineage_tags
from async_grpo.lifecycle.registry_start import PARENT_VERSION_TAG

logger = logging.getLogger(__name__)


class RegisterStepOutputs(NamedTuple):
    """The register step's outputs (the component's `RegisterOutputs`).

    Attributes:
        model_version: the new version, e.g. "3".
        model_uri: `models:/<name>/<version>`.
        promoted: the champion alias moved to it.
    """

    model_version: str
    model_uri: str
    promoted: bool


def run_register_step(
    *,
    model_metadata: Mapping[str, Any],
    metrics_metadata: Mapping[str, Any],
    mlflow_run_id: str,
    tracking_uri: str,
    registered_model_name: str,
    dataset_metadata: Mapping[str, Any] | None = None,
    resolved_config: str = "",
    kfp_run_id: str = "",
    champion_alias: str = "champion",
    registration_timeout_s: float = 300.0,
    mlflow_parent_run_id: str = "",
) -> RegisterStepOutputs:
    """Register the run's logged model and move the champion alias to it, compare-and-set against the champion
    `evaluate` scored against.

    Args:
        model_metadata: the `train_grpo` Model artifact's metadata (`run_name`, `base_model`).
        metrics_metadata: the `evaluate` Metrics artifact's metadata; must hold `eval_reward` (and `decision`,
            `champion_version` when the evaluation read the registry).
        dataset_metadata: the `prepare_dataset` artifact's metadata (its digests go into the lineage); None: not
            recorded.
        mlflow_run_id, tracking_uri, registered_model_name, resolved_config, kfp_run_id, champion_alias,
            registration_timeout_s, mlflow_parent_run_id: the component's parameters of the same names
            (`components/register_model`, whose docstring gives their meaning).

    Returns:
        The new version, its URI and whether the alias moved (`RegisterStepOutputs`).

    Raises:
        ValueError: empty registered_model_name, or the metrics have no eval_reward.
        PolicyViolation (a ValueError): in a cluster pod, the registered model or the tracking URI is outside the
            platform policy; decided before the credentials are loaded, so nothing is written to the registry.
        FileNotFoundError: the run logged no model.
        TimeoutError: the version did not become READY within registration_timeout_s (seconds).
        RuntimeError: the registry reported FAILED_REGISTRATION.
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    if not registered_model_name:
        raise ValueError("registered_model_name is empty. Fix: name the registry entry, e.g. async-grpo-tiny.")
    # In a cluster pod, the decision before the credentials are loaded and before the registry is touched: the
    # MLflow server, and the registered model (all runs share one MLflow user: only the policy's registered_models
    # keep a run from adding a version to, and taking the champion alias of, another team's model).
    k8s_policy.check_step(
        "register_model",
        tracking_uri=tracking_uri,
        registered_models=[(registered_model_name, "register a version of")],
    )
    step_secrets.load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands
    if "eval_reward" not in metrics_metadata:
        raise ValueError(
            f"metrics artifact has no eval_reward (keys: {sorted(metrics_metadata)}); "
            "it must come from the evaluate component."
        )
    reward = float(metrics_metadata["eval_reward"])
    decision = str(metrics_metadata.get("decision", ""))
    # compare-and-set against the champion `evaluate` scored against ("" there: none); no key (an evaluation made
    # without the registry): move the alias whatever holds it
    expected = (
        {"expected_champion": str(metrics_metadata["champion_version"]) or None}
        if "champion_version" in metrics_metadata
        else {}
    )

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(mlflow_run_id)
    source = run.data.tags.get("async_grpo.model_uri")  # tracking.MODEL_URI_TAG
    if not source and client.list_artifacts(mlflow_run_id, "model"):
        source = f"{run.info.artifact_uri}/model"
    if not source:
        raise FileNotFoundError(
            f"MLflow run {mlflow_run_id} logged no model to register. "
            "Fix: train with save_model=true, and check the trainer log for a failed upload."
        )
    try:
        client.create_registered_model(
            registered_model_name, description="async GRPO checkpoints; the alias marks the best held-out reward"
        )
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    numbers = {k: float(v) for k, v in metrics_metadata.items() if isinstance(v, (int, float))}
    tags = {
        "eval_reward": repr(reward),
        "kfp.run_name": str(model_metadata.get("run_name", "")),
        "base_model": str(model_metadata.get("base_model", "")),
        **lineage_tags(
            resolved_config=resolved_config,
            parent_version=run.data.tags.get(PARENT_VERSION_TAG, ""),
            dataset=dict(dataset_metadata) if dataset_metadata is not None else None,
            kfp_run_id=kfp_run_id,
            mlflow_run_id=mlflow_run_id,
            evaluation=numbers,
            decision=decision,
        ),
    }
    version = client.create_model_version(
        registered_model_name,
        source=source,
        run_id=mlflow_run_id,
        tags=tags,
        description=f"held-out reward {reward:.4f}; {decision}",
    )
    deadline = time.monotonic() + registration_timeout_s
    while version.status != "READY":
        if version.status == "FAILED_REGISTRATION":
            raise RuntimeError(
                f"registering {registered_model_name} v{version.version} failed: {version.status_message}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{registered_model_name} v{version.version} not READY after "
                f"{registration_timeout_s:.0f} s (status {version.status})."
            )
        time.sleep(1.0)
        version = client.get_model_version(registered_model_name, version.version)
    try:
        registry.promote(
            client, registered_model_name, str(version.version), reason=decision or "passed evaluation",
            actor=f"pipeline:{kfp_run_id or getpass.getuser()}", alias=champion_alias, **expected,
        )  # fmt: skip
        promoted = True
    except registry.ChampionChanged as err:
        promoted = False
        client.set_model_version_tag(registered_model_name, str(version.version), "promotion", f"skipped: {err}")
        logger.warning("registered %s v%s without promoting it: %s", registered_model_name, version.version, err)
    client.set_tag(mlflow_run_id, "registered_model_version", f"{registered_model_name}/{version.version}")
    if mlflow_parent_run_id:  # the pipeline's layout: a nested run for this step, the outcome on the parent
        from async_grpo.lifecycle import pipeline_tracking

        done = {"registered_model_version": f"{registered_model_name}/{version.version}", "promoted": str(promoted)}
        step_run = pipeline_tracking.open_step_run(client, mlflow_parent_run_id, "register", tags=done)
        client.set_terminated(step_run, "FINISHED")
        for key, value in done.items():
            client.set_tag(mlflow_parent_run_id, key, value)
    uri = f"models:/{registered_model_name}/{version.version}"
    logger.info(
        "registered %s (eval_reward %.4f) as %s; alias %r %s",
        source, reward, uri, champion_alias, "moved to it" if promoted else "left where it was",
    )  # fmt: skip
    return RegisterStepOutputs(str(version.version), uri, promoted)
