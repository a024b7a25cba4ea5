"""The pipeline's train step: from the dataset artifact and the step's parameters to a launched run and its model.

`components/train_grpo` is a KFP component whose body gathers its typed knobs and calls `run_train_step`; the
order of what happens here is the step's security contract, so it lives in one function:

1. the inputs that need no config (`warm_start`, the backend's name, the local backend inside a cluster pod,
   `work_dir` on the workspace volume);
2. the run's folder made new on the tenant-writable volume and the dataset staged into it, nothing followed through
   a link (`async_grpo.shared_volume`);
3. the run's config resolved (`pipeline_step.resolve_run_config`) and checked for a pipeline (`check_pipeline_config`);
4. the platform policy's decision on the step's own inputs (`k8s_policy.check_step`) and, with the kubernetes
   backend, on the whole run (`KubernetesBackend.check`), before any credential is loaded or MLflow is called;
5. the Secrets mounted as files loaded (`step_secrets.load_step_secrets`), then the champion read and a registry
   model downloaded (`lifecycle.registry_start`), judged again when it replaced the model;
6. preflight (on the cluster target it only parses the submitter's files), the launch, the wait;
7. the final model copied from the volume without following a link, and the run tagged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from async_grpo import step_secrets
from async_grpo.config import ConfigError, dump_config
from async_grpo.launch import k8s_policy
from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH
from async_grpo.launch.naming import pipeline_run_name
from async_grpo.launch.pipeline_step import backend_for, check_backend, check_pipeline_config, resolve_run_config
from async_grpo.shared_volume import copy_tree, make_run_dir, remove_tree

logger = logging.getLogger(__name__)

WARM_STARTS = ("none", "champion")


class TrainStepOutputs(NamedTuple):
    """The train step's outputs (the component's `TrainOutputs`).

    Attributes:
        mlflow_run_id: the training run's MLflow run id.
        tracking_uri: the MLflow tracking URI the run logged to.
        resolved_config: YAML of every GRPOConfig field the run was launched with.
        run_name: the run's full name (`naming.pipeline_run_name`).
        mlflow_parent_run_id: the pipeline run's MLflow parent run (`lifecycle.pipeline_tracking`); "" when KFP's own
            MLflow integration opened the task's run (`MLFLOW_RUN_ID` set).
    """

    mlflow_run_id: str
    tracking_uri: str
    resolved_config: str
    run_name: str
    mlflow_parent_run_id: str


def run_train_step(
    *,
    dataset_path: str,
    dataset_source: str,
    model_path: str,
    model_metadata: MutableMapping[str, Any],
    knobs: Mapping[str, Any],
    config_yaml: str = "",
    extra_overrides: Sequence[str] = (),
    launch_backend: str = "local",
    launch_timeout_s: float = 86400.0,
    backend_options: Mapping[str, Any] | None = None,
    work_dir: str = "",
    run_name: str = "",
    pipeline_job_name: str = "",
    pipeline_job_id: str = "",
    mlflow_tracking_uri: str = "",
    warm_start: str = "none",
    registered_model_name: str = "",
    champion_alias: str = "champion",
    trainer_api: str = "",
) -> TrainStepOutputs:
    """Resolve, judge and launch the run, wait for it, and copy its final model to `model_path`.

    Args:
        dataset_path: the `prepare_dataset` artifact's folder (DatasetDict with `train` and `eval`).
        dataset_source: the artifact's `source` metadata: a `builtin:<task>` training set is kept by name (the job
            regenerates it with the same seed, and the warm start needs the task); held-out prompts always come
            from the staged artifact.
        model_path: the output Model artifact's folder; receives a copy of the final HF checkpoint.
        model_metadata: the output Model artifact's metadata, updated in place (MLflow run id, tracking URI, run
            name, model folder, base model, parent version, backend, and the backend's headline metrics).
        knobs: the component's typed parameters that are GRPOConfig fields (flat names; None: not set).
        config_yaml, extra_overrides, launch_backend, launch_timeout_s, backend_options, work_dir, run_name,
            pipeline_job_name, pipeline_job_id, mlflow_tracking_uri, warm_start, registered_model_name,
            champion_alias, trainer_api: the component's parameters of the same names (`components/train_grpo`,
            whose docstring gives their meaning and the config precedence).

    Returns:
        The step's outputs (`TrainStepOutputs`).

    Raises:
        ConfigError (a ValueError): the merged config is invalid, save_model is false or report_to is none, the
            inputs fail preflight, or warm_start is champion without registered_model_name; before anything starts.
        ValueError: unknown launch_backend or warm_start.
        RegistryError (a ValueError): a `models:/` model that does not exist or holds no HF checkpoint.
        PolicyViolation (a ValueError): the platform policy refuses the step or the run; before the step loads its
            MLflow credentials or calls MLflow, and before preflight reads any of the submitter's files.
        UnsafeVolumePath (a ValueError): a link, special file or planted folder on the workspace volume.
        TimeoutError: the backend ran past `launch_timeout_s` (it cleans up first).
        RuntimeError: the run failed, or finished without a checkpoint.
    """
    if warm_start not in WARM_STARTS:
        raise ValueError(f"warm_start={warm_start!r} is not one of 'none', 'champion'.")
    if warm_start == "champion" and not registered_model_name:
        raise ConfigError("warm_start is champion, but registered_model_name is empty. Fix: name the entry.")
    check_backend(launch_backend)  # local inside a cluster pod: refused before anything touches the volume
    k8s_policy.check_work_dir(work_dir)
    name = pipeline_run_name(run_name, pipeline_job_name, pipeline_job_id)

    # the workspace volume is tenant-writable: nothing on it is followed through a link (`async_grpo.shared_volume`),
    # and the run's folder, whose name holds the KFP run id, is made new (a folder planted under it is refused)
    volume_root = DEFAULT_DATA_MOUNT_PATH if k8s_policy.in_cluster_pod() else work_dir
    staged = Path(dataset_path)
    if work_dir:
        run_dir = make_run_dir(Path(work_dir) / name, root=volume_root, exist_ok=not pipeline_job_id)
        staged = run_dir / "staging" / "dataset"
        remove_tree(staged.parent, root=volume_root)  # left by an earlier call of the same name (no KFP run id)
        copy_tree(dataset_path, staged, root=dataset_path, dst_root=volume_root)
    pinned = {"run_name": name, "dataset": dataset_source if dataset_source.startswith("builtin:") else str(staged),
              "eval_dataset": str(staged)}  # fmt: skip
    if work_dir:
        pinned["output_dir"] = str(Path(work_dir) / name)
    config = resolve_run_config(
        config_yaml, knobs, list(extra_overrides), tracking_uri=mlflow_tracking_uri,
        default_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", ""), pinned=pinned,
    )  # fmt: skip
    check_pipeline_config(config)

    # The decision on the run, before any credential is loaded and before any network call (the champion read and
    # the warm-start download below send the MLflow credentials to the run's tracking URI): in a cluster pod the
    # step's own inputs (the tracking URI, the registered models it reads), and with the kubernetes backend the whole
    # run (`KubernetesBackend.check`, the policy's `check_run`). Outside a pod with the local backend: nothing.
    reads = [(registered_model_name, "read the champion of")] if warm_start == "champion" else []
    held_name = k8s_policy.registry_model_name(config.model_name_or_path)
    if held_name is not None:
        reads.append((held_name, "read a version of"))
    k8s_policy.check_step(
        "train_grpo",
        launch_backend=launch_backend,
        tracking_uri=config.tracking_uri if k8s_policy.in_cluster_pod() else None,  # else the backend's check judges it
        registered_models=reads,
    )
    # the kubernetes backend reads the mounted platform policy (no call to the cluster yet)
    backend = backend_for(launch_backend, backend_options, trainer_api)
    decided = config  # the config the policy judged; a warm start below replaces the model, and it is judged again
    if launch_backend == "kubernetes":
        backend.check(config)
    step_secrets.load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands

    import mlflow

    from async_grpo.lifecycle.registry_start import WARM_START_TAG, resolve_registry_start
    from async_grpo.tracking import open_store

    start_note = ""
    if warm_start == "champion":
        from async_grpo.lifecycle import registry

        open_store(config.tracking_uri)
        held = registry.champion(mlflow.MlflowClient(config.tracking_uri), registered_model_name, champion_alias)
        if held is None:
            start_note = f"base {config.model_name_or_path} (warm_start=champion: {registered_model_name} has no "
            start_note += f"{champion_alias} yet)"
            logger.info("warm start: %s", start_note)
        else:
            config = config.model_copy(update={"model_name_or_path": f"models:/{registered_model_name}/{held.version}"})

    # a models:/ model is downloaded before anything starts: on the volume, privately first, then into a new folder
    config, warm = resolve_registry_start(config, volume_root=volume_root or None)

    from async_grpo.config import flat_params
    from async_grpo.lifecycle.pipeline_tracking import PipelineRun
    from async_grpo.tracking import experiment_name

    pipeline_run = None  # None: KFP's MLflow integration opened (and nests) this task's run, MLFLOW_RUN_ID
    if not os.environ.get("MLFLOW_RUN_ID"):
        pipeline_run = PipelineRun(
            config.tracking_uri, experiment_name(config), name, pipeline_job_id, flat_params(config),
            tags={"kfp.pipeline_job_name": pipeline_job_name, "kfp.launch_backend": launch_backend},
        )  # fmt: skip

    if launch_backend == "kubernetes":  # the backend made above, before the credentials were loaded
        from async_grpo.preflight import check_config

        if pipeline_run is not None:  # it opens the MLflow runs once the policy allows the run
            backend.tracking = pipeline_run
        # the policy first: nothing reads a submitter's file before the run is allowed, and preflight on the cluster
        # target only parses such files (ast), never imports them, since this pod holds credentials
        if config is not decided:  # a warm start replaced the model: judged again, as the pods will run it
            backend.check(config)
        check_config(config, target="cluster")  # the local backend runs preflight itself (run_local)

    logger.info(
        "launching run %r with the %s backend (timeout %.0f s): model=%s dataset=%s max_steps=%d output_dir=%s",
        name,
        launch_backend,
        launch_timeout_s,
        config.model_name_or_path,
        config.data.dataset,
        config.batch.max_steps,
        config.output_dir,
    )
    local_run = pipeline_run is not None and launch_backend == "local"
    try:
        if local_run:  # the Tracker logs into the nested train run (run_local runs in this process)
            open_store(config.tracking_uri)
            os.environ["MLFLOW_RUN_ID"] = pipeline_run.create_run()
        result = backend.launch(config, timeout_s=launch_timeout_s)
    except BaseException:
        if local_run and pipeline_run.parent_run_id:  # the kubernetes backend ends its runs itself
            pipeline_run.end_run(config.tracking_uri, pipeline_run.train_run_id, "FAILED")
        raise
    finally:
        if local_run:
            os.environ.pop("MLFLOW_RUN_ID", None)
    parent_run_id = pipeline_run.parent_run_id if pipeline_run is not None else ""
    logger.info(
        "run %r finished: MLflow run %s at %s; metrics %s", name, result.mlflow_run_id, result.tracking_uri,
        result.metrics,
    )  # fmt: skip

    no_checkpoint = RuntimeError(
        f"run {name!r} finished but left no HF checkpoint at {result.model_dir!r}. "
        "Fix: check the trainer logs; save_model must stay true."
    )
    if not result.model_dir:
        raise no_checkpoint
    try:  # the final model lies on the tenant-writable volume: copied without following a link (UnsafeVolumePath)
        copy_tree(result.model_dir, model_path, root=volume_root or config.output_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise no_checkpoint from None
    if not (Path(model_path) / "config.json").is_file():  # checked on the step's own copy
        raise no_checkpoint
    model_metadata.update({
        "mlflow_run_id": result.mlflow_run_id, "tracking_uri": result.tracking_uri, "run_name": name,
        "model_dir": str(result.model_dir), "base_model": warm.requested, "parent_version": warm.parent_version,
        "launch_backend": launch_backend,
        **{k: float(v) for k, v in result.metrics.items()},
    })  # fmt: skip

    client = mlflow.MlflowClient(tracking_uri=result.tracking_uri)
    client.set_tag(result.mlflow_run_id, "kfp.run_name", name)
    client.set_tag(result.mlflow_run_id, "kfp.launch_backend", launch_backend)
    if start_note:  # the run tagged itself "base ..."; say why it did not start from a champion
        client.set_tag(result.mlflow_run_id, WARM_START_TAG, start_note)
    if parent_run_id:
        client.set_tag(parent_run_id, "mlflow_run_id.train", result.mlflow_run_id)
    return TrainStepOutputs(result.mlflow_run_id, result.tracking_uri, dump_config(config), name, parent_run_id)
