"""`register_model`: add the training run's checkpoint to the MLflow model registry and make it the champion.

The pipeline calls it only inside `dsl.If(evaluate passed)`. The version points at the model the
training run already logged with MLflow's `transformers` flavour (the run's tag `async_grpo.model_uri`;
nothing is copied again), so `mlflow.transformers.load_model("models:/<name>/<version>")` loads it and
`mlflow models serve` serves it. It carries its lineage as tags (`async_grpo.lifecycle.lineage`: parent version, data and
config digests, code, KFP run, the head-to-head evaluation), and takes the champion alias only if the alias still
points where `evaluate` found it (a concurrent run may have moved it since).
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def register_model(
    model: Input[Model],
    metrics: Input[Metrics],
    mlflow_run_id: str,
    tracking_uri: str,
    registered_model_name: str,
    dataset: Optional[Input[Dataset]] = None,
    resolved_config: str = "",
    kfp_run_id: str = "",
    champion_alias: str = "champion",
    registration_timeout_s: float = 300.0,
    mlflow_parent_run_id: str = "",
) -> NamedTuple("RegisterOutputs", [("model_version", str), ("model_uri", str), ("promoted", bool)]):
    """Register the run's logged model (tag `async_grpo.model_uri`, a transformers-flavour model; runs of
    earlier versions: their `model` artifact folder) as a new version of `registered_model_name`, and move the
    champion alias to it.

    The version gets the tags of `async_grpo.lifecycle.lineage.lineage_tags` plus `eval_reward`, `kfp.run_name` and
    `base_model`. The alias moves with `async_grpo.lifecycle.registry.promote`, compare-and-set against the champion
    `evaluate` scored against (`metrics.metadata["champion_version"]`): when another run moved it meanwhile, the
    version is registered but not promoted (tag `promotion` says why; `promoted` is False), since it was never
    compared with the new champion. The previous champion keeps the alias `previous-champion`; the training run
    gets the tag `registered_model_version`.

    Args:
        model: the `train_grpo` Model artifact (for lineage and its metadata).
        metrics: the `evaluate` Metrics artifact; must hold `eval_reward`.
        mlflow_run_id: the training run whose `model` artifact is registered.
        tracking_uri: MLflow tracking URI (the registry lives there too).
        registered_model_name: the registry entry; created when missing.
        dataset: the `prepare_dataset` artifact (its digests go into the lineage); None: not recorded.
        resolved_config: the run's resolved GRPOConfig YAML (its digest goes into the lineage).
        kfp_run_id: the KFP run id (the pipeline passes its placeholder).
        champion_alias: alias set on the new version.
        registration_timeout_s: how long to wait for the version to become READY (seconds).
        mlflow_parent_run_id: the pipeline run's MLflow parent run ("" for none): the step opens its nested run
            `register` (tags `registered_model_version`, `promoted`) and tags the parent the same.

    Returns:
        model_version (e.g. "3"), model_uri (`models:/<name>/<version>`) and promoted (the alias moved to it).

    Raises:
        ValueError: empty registered_model_name, or the metrics artifact has no eval_reward.
        PolicyViolation (a ValueError): in a cluster pod, `registered_model_name` is not in the platform policy's
            `registered_models`, or `tracking_uri` not in its `mlflow_tracking_uris` (`k8s_policy.check_step`);
            decided before the step loads its MLflow credentials, so nothing is written to the registry.
        FileNotFoundError: the run logged no model (save_model was off, or its upload failed).
        TimeoutError: the version did not become READY within registration_timeout_s.
        RuntimeError: the registry reported FAILED_REGISTRATION.
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    import getpass
    import logging
    import time
    from collections import namedtuple

    import mlflow
    from mlflow.exceptions import MlflowException

    from async_grpo.launch.k8s_policy import check_step
    from async_grpo.lifecycle import registry
    from async_grpo.lifecycle.lineage import lineage_tags
    from async_grpo.lifecycle.registry_start import PARENT_VERSION_TAG
    from async_grpo.step_secrets import load_step_secrets

    log = logging.getLogger("register_model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not registered_model_name:
        raise ValueError("registered_model_name is empty. Fix: name the registry entry, e.g. async-grpo-tiny.")
    # In a cluster pod, the decision before the credentials are loaded and before the registry is touched: the
    # MLflow server, and the registered model (all runs share one MLflow user: only the policy's registered_models
    # keep a run from adding a version to, and taking the champion alias of, another team's model).
    check_step(
        "register_model",
        tracking_uri=tracking_uri,
        registered_models=[(registered_model_name, "register a version of")],
    )
    load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands
    if "eval_reward" not in metrics.metadata:
        raise ValueError(
            f"metrics artifact has no eval_reward (keys: {sorted(metrics.metadata)}); "
            "it must come from the evaluate component."
        )
    reward = float(metrics.metadata["eval_reward"])
    decision = str(metrics.metadata.get("decision", ""))
    # compare-and-set against the champion `evaluate` scored against ("" there: none); no key (an evaluation made
    # without the registry): move the alias whatever holds it
    expected = (
        {"expected_champion": str(metrics.metadata["champion_version"]) or None}
        if "champion_version" in metrics.metadata
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
    numbers = {k: float(v) for k, v in metrics.metadata.items() if isinstance(v, (int, float))}
    tags = {
        "eval_reward": repr(reward),
        "kfp.run_name": str(model.metadata.get("run_name", "")),
        "base_model": str(model.metadata.get("base_model", "")),
        **lineage_tags(
            resolved_config=resolved_config,
            parent_version=run.data.tags.get(PARENT_VERSION_TAG, ""),
            dataset=dict(dataset.metadata) if dataset is not None else None,
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
        log.warning("registered %s v%s without promoting it: %s", registered_model_name, version.version, err)
    client.set_tag(mlflow_run_id, "registered_model_version", f"{registered_model_name}/{version.version}")
    if mlflow_parent_run_id:  # the pipeline's layout: a nested run for this step, the outcome on the parent
        from async_grpo.lifecycle import pipeline_tracking

        done = {"registered_model_version": f"{registered_model_name}/{version.version}", "promoted": str(promoted)}
        step_run = pipeline_tracking.open_step_run(client, mlflow_parent_run_id, "register", tags=done)
        client.set_terminated(step_run, "FINISHED")
        for key, value in done.items():
            client.set_tag(mlflow_parent_run_id, key, value)
    uri = f"models:/{registered_model_name}/{version.version}"
    log.info(
        "registered %s (eval_reward %.4f) as %s; alias %r %s",
        source, reward, uri, champion_alias, "moved to it" if promoted else "left where it was",
    )  # fmt: skip
    outputs = namedtuple("RegisterOutputs", ["model_version", "model_uri", "promoted"])
    return outputs(str(version.version), uri, promoted)
