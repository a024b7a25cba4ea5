"""`register_model`: add the training run's checkpoint to the MLflow model registry and make it the champion.

The pipeline calls it only inside `dsl.If(evaluate passed)`. The version points at the model the
training run already logged with MLflow's `transformers` flavour (the run's tag `async_grpo.model_uri`;
nothing is copied again), so `mlflow.transformers.load_model("models:/<name>/<version>")` loads it and
`mlflow models serve` serves it. It carries the held-out reward as a tag, which is what the next run's
gate compares against, and takes the champion alias.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Input, Metrics, Model

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def register_model(
    model: Input[Model],
    metrics: Input[Metrics],
    mlflow_run_id: str,
    tracking_uri: str,
    registered_model_name: str,
    champion_alias: str = "champion",
    registration_timeout_s: float = 300.0,
) -> NamedTuple("RegisterOutputs", [("model_version", str), ("model_uri", str)]):
    """Register the run's logged model (tag `async_grpo.model_uri`, a transformers-flavour model; runs of
    earlier versions: their `model` artifact folder) as a new version of `registered_model_name`.

    The version gets tags `eval_reward` (from the `evaluate` Metrics artifact), `kfp.run_name` and
    `base_model`; the alias `champion_alias` moves to it; the training run gets the tag
    `registered_model_version`.

    Args:
        model: the `train_grpo` Model artifact (for lineage and its metadata).
        metrics: the `evaluate` Metrics artifact; must hold `eval_reward`.
        mlflow_run_id: the training run whose `model` artifact is registered.
        tracking_uri: MLflow tracking URI (the registry lives there too).
        registered_model_name: the registry entry; created when missing.
        champion_alias: alias set on the new version.
        registration_timeout_s: how long to wait for the version to become READY (seconds).

    Returns:
        model_version (e.g. "3") and model_uri (`models:/<name>/<version>`).

    Raises:
        ValueError: empty registered_model_name, or the metrics artifact has no eval_reward.
        FileNotFoundError: the run logged no model (save_model was off, or its upload failed).
        TimeoutError: the version did not become READY within registration_timeout_s.
        RuntimeError: the registry reported FAILED_REGISTRATION.
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    import logging
    import time
    from collections import namedtuple

    import mlflow
    from mlflow.exceptions import MlflowException

    log = logging.getLogger("register_model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not registered_model_name:
        raise ValueError("registered_model_name is empty. Fix: name the registry entry, e.g. async-grpo-tiny.")
    if "eval_reward" not in metrics.metadata:
        raise ValueError(
            f"metrics artifact has no eval_reward (keys: {sorted(metrics.metadata)}); "
            "it must come from the evaluate component."
        )
    reward = float(metrics.metadata["eval_reward"])

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
    tags = {
        "eval_reward": repr(reward),
        "kfp.run_name": str(model.metadata.get("run_name", "")),
        "base_model": str(model.metadata.get("base_model", "")),
    }
    version = client.create_model_version(
        registered_model_name,
        source=source,
        run_id=mlflow_run_id,
        tags=tags,
        description=f"held-out reward {reward:.4f}",
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
    client.set_registered_model_alias(registered_model_name, champion_alias, version.version)
    client.set_tag(mlflow_run_id, "registered_model_version", f"{registered_model_name}/{version.version}")
    uri = f"models:/{registered_model_name}/{version.version}"
    log.info("registered %s (eval_reward %.4f) as %s; alias %r", source, reward, uri, champion_alias)
    outputs = namedtuple("RegisterOutputs", ["model_version", "model_uri"])
    return outputs(str(version.version), uri)
