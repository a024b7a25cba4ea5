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
    import logging
    from collections import namedtuple

    from async_grpo.launch.register_step import run_register_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = run_register_step(
        model_metadata=model.metadata, metrics_metadata=metrics.metadata, mlflow_run_id=mlflow_run_id,
        tracking_uri=tracking_uri, registered_model_name=registered_model_name,
        dataset_metadata=dataset.metadata if dataset is not None else None, resolved_config=resolved_config,
        kfp_run_id=kfp_run_id, champion_alias=champion_alias, registration_timeout_s=registration_timeout_s,
        mlflow_parent_run_id=mlflow_parent_run_id,
    )  # fmt: skip
    outputs = namedtuple("RegisterOutputs", out._fields)
    return outputs(*out)
