"""`train_grpo`: resolve one GRPOConfig and run it to completion through a launch backend.

The component is only glue: config precedence, staging the dataset where the job can read it, and
turning the backend's `LaunchResult` into KFP outputs. The work happens behind `LaunchBackend`
(`local`: subprocesses in this pod or on this machine; `kubernetes`: a PyTorchJob plus vLLM and reward
Deployments), so the same component drives a laptop run and a multi-node cluster run.
"""

from typing import List, NamedTuple, Optional

from kfp import dsl
from kfp.dsl import Dataset, Input, Model, Output

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def train_grpo(
    dataset: Input[Dataset],
    model: Output[Model],
    config_yaml: str = "",
    model_name_or_path: Optional[str] = None,
    reward_funcs: Optional[List[str]] = None,
    reward_weights: Optional[List[float]] = None,
    tools: Optional[List[str]] = None,
    num_generations: Optional[int] = None,
    max_completion_length: Optional[int] = None,
    max_prompt_length: Optional[int] = None,
    temperature: Optional[float] = None,
    learning_rate: Optional[float] = None,
    per_device_train_batch_size: Optional[int] = None,
    gradient_accumulation_steps: Optional[int] = None,
    max_steps: Optional[int] = None,
    seed: Optional[int] = None,
    loss_type: Optional[str] = None,
    beta: Optional[float] = None,
    epsilon: Optional[float] = None,
    epsilon_high: Optional[float] = None,
    scale_rewards: Optional[str] = None,
    vllm_importance_sampling_mode: Optional[str] = None,
    vllm_importance_sampling_cap: Optional[float] = None,
    max_staleness: Optional[int] = None,
    vllm_sync_interval: Optional[int] = None,
    warmup_sft_steps: Optional[int] = None,
    eval_num_prompts: Optional[int] = None,
    num_generations_eval: Optional[int] = None,
    mlflow_experiment_name: Optional[str] = None,
    extra_overrides: Optional[List[str]] = None,
    launch_backend: str = "local",
    launch_timeout_s: float = 86400.0,
    backend_options: Optional[dict] = None,
    work_dir: str = "",
    run_name: str = "",
    pipeline_job_name: str = "",
    pipeline_job_id: str = "",
    mlflow_tracking_uri: str = "",
    warm_start: str = "none",
    registered_model_name: str = "",
    champion_alias: str = "champion",
    trainer_api: str = "",
) -> NamedTuple(
    "TrainOutputs",
    [
        ("mlflow_run_id", str),
        ("tracking_uri", str),
        ("resolved_config", str),
        ("run_name", str),
        ("mlflow_parent_run_id", str),
    ],
):
    """Build the run's GRPOConfig, launch it through `launch_backend`, wait, and output the trained model.

    Config precedence (later wins): `config_yaml`; each named knob that is not None (the names are
    GRPOConfig fields); the dataset from the `dataset` artifact, `run_name`, `output_dir` and the
    MLflow URI set by this component; then `extra_overrides` (`key=value`, values parsed as YAML), which may not
    change the run name, its folder or its datasets (a ConfigError says so).
    A builtin training set is kept as `builtin:<task>` (the job regenerates it with the same seed,
    and the warm start needs the task); held-out prompts always come from the artifact.

    Args:
        dataset: the `prepare_dataset` artifact (DatasetDict with `train` and `eval`).
        model: output Model artifact: a copy of the final HF checkpoint, made without following a link
            (`async_grpo.shared_volume.copy_tree`); metadata holds the MLflow run id, tracking URI, run name and the
            backend's headline metrics.
        config_yaml: a GRPOConfig YAML document (may be empty).
        launch_backend: "local" (every role as a subprocess here) or "kubernetes" (PyTorchJob trainer,
            vLLM and reward Deployments; `async_grpo.launch.kubernetes` is imported only then).
        launch_timeout_s: seconds the backend may run before it must give up and clean up.
        backend_options: `ClusterSettings` fields for the kubernetes backend (nothing else of the backend is
            reachable from here); the platform policy mounted in this pod decides what is allowed.
        work_dir: shared folder (on a cluster, the workspace volume's mount path, mounted at the same
            path in the trainer pods). When set, the run's output_dir is `<work_dir>/<run name>` and
            the dataset is staged under `<work_dir>/<run name>/staging/`.
        run_name: the submitter's name for the run; empty uses `pipeline_job_name`. The MLflow run, the folder
            and the cluster objects are named `async_grpo.launch.naming.pipeline_run_name(run_name,
            pipeline_job_name, pipeline_job_id)`: lower-cased, [a-z0-9-], plus 8 characters of the KFP run id,
            so two runs given the same name never share anything.
        pipeline_job_name: the KFP job name (the pipeline passes its placeholder).
        pipeline_job_id: the KFP run id (the pipeline passes its placeholder); empty: no suffix.
        mlflow_tracking_uri: overrides the config's URI; when both are empty, the MLFLOW_TRACKING_URI
            environment variable (the cluster secret) is used, else sqlite under output_dir.
        warm_start: "none" trains `model_name_or_path`; "champion" trains the version of `registered_model_name`
            that holds `champion_alias` (downloaded into `<output_dir>/warm-start/`, `async_grpo.lifecycle.registry_start`; the
            supervised warm start is skipped), or, with no champion yet, `model_name_or_path`, saying so in the
            log and the run's tag `async_grpo.lifecycle.registry_start`. A `models:/` URI in `model_name_or_path` is resolved the
            same way whatever this says.
        registered_model_name: the registry entry whose champion `warm_start: champion` starts from; in a cluster
            pod it must be listed in the policy's `registered_models` (reading is allowed only for listed names).
        champion_alias: the alias that marks the champion.
        trainer_api: the kubernetes backend's `trainer_api` (`pytorchjob` or `trainjob`), merged into `backend_options`;
            "" leaves `backend_options` to decide.

    Returns:
        mlflow_run_id, tracking_uri, resolved_config (YAML of every field), run_name and mlflow_parent_run_id: the
        pipeline run's MLflow parent run (`async_grpo.lifecycle.pipeline_tracking`: the resolved config as flat params; the
        training run is its nested run `train`), "" when KFP's own MLflow integration opened this task's run
        (`MLFLOW_RUN_ID` set: the trainer logs into that run, nested as KFP nests it).

    Raises:
        ConfigError (a ValueError): the merged config is invalid, save_model is false (evaluation
            and registration need the checkpoint), or report_to is none, or the inputs fail preflight
            (`async_grpo.preflight`: PreflightError), or warm_start is champion without registered_model_name;
            raised before anything starts.
        ValueError: unknown launch_backend or warm_start.
        RegistryError (a ValueError): a `models:/` model that does not exist or holds no HF checkpoint.
        PolicyViolation (a ValueError): the platform policy refuses the run (the local backend inside a
            cluster pod; in a cluster pod, a work_dir off the workspace volume, a tracking URI outside
            `mlflow_tracking_uris`, or a registered model the run would read, `registered_model_name` with
            warm_start=champion or the name in a `models:/` model, outside `registered_models`; or, on kubernetes,
            an image, account, secret, volume, mount path, MLflow server, NCCL variable, vLLM flag or submitter code
            beside credentials); checked before the step loads its MLflow credentials or calls MLflow
            (`k8s_policy.check_step`), and before preflight reads any of the submitter's files.
        TimeoutError: the backend ran past `launch_timeout_s` (it cleans up first).
        RuntimeError: the run failed, or finished without a checkpoint.
        UnsafeVolumePath (a ValueError): on the workspace volume, the run's folder exists before the run (with a KFP
            run id: a tenant made it), or a symbolic link, special file or hard link lies in the run's folder, the
            staging copy or the final model (`async_grpo.shared_volume`; nothing is read through it).
    """
    from async_grpo.step_secrets import load_step_secrets, load_tracking_uri

    load_tracking_uri()  # the platform's MLflow server (no credential): the policy's decision below needs it
    import logging
    import os
    from collections import namedtuple
    from pathlib import Path

    from async_grpo.config import ConfigError, dump_config
    from async_grpo.launch.k8s_policy import check_step, check_work_dir, in_cluster_pod, registry_model_name
    from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH
    from async_grpo.launch.naming import pipeline_run_name
    from async_grpo.launch.pipeline_step import (
        backend_for,
        check_backend,
        check_pipeline_config,
        resolve_run_config,
    )
    from async_grpo.shared_volume import copy_tree, make_run_dir, remove_tree

    log = logging.getLogger("train_grpo")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    knobs = {
        "model_name_or_path": model_name_or_path, "reward_funcs": reward_funcs, "reward_weights": reward_weights,
        "tools": tools,
        "num_generations": num_generations, "max_completion_length": max_completion_length,
        "max_prompt_length": max_prompt_length, "temperature": temperature, "learning_rate": learning_rate,
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps, "max_steps": max_steps, "seed": seed,
        "loss_type": loss_type, "beta": beta, "epsilon": epsilon, "epsilon_high": epsilon_high,
        "scale_rewards": scale_rewards, "vllm_importance_sampling_mode": vllm_importance_sampling_mode,
        "vllm_importance_sampling_cap": vllm_importance_sampling_cap, "max_staleness": max_staleness,
        "vllm_sync_interval": vllm_sync_interval, "warmup_sft_steps": warmup_sft_steps,
        "eval_num_prompts": eval_num_prompts, "num_generations_eval": num_generations_eval,
        "mlflow_experiment_name": mlflow_experiment_name,
    }  # fmt: skip
    if warm_start not in ("none", "champion"):
        raise ValueError(f"warm_start={warm_start!r} is not one of 'none', 'champion'.")
    if warm_start == "champion" and not registered_model_name:
        raise ConfigError("warm_start is champion, but registered_model_name is empty. Fix: name the entry.")
    check_backend(launch_backend)  # local inside a cluster pod: refused before anything touches the volume
    check_work_dir(work_dir)
    name = pipeline_run_name(run_name, pipeline_job_name, pipeline_job_id)

    # the workspace volume is tenant-writable: nothing on it is followed through a link (`async_grpo.shared_volume`),
    # and the run's folder, whose name holds the KFP run id, is made new (a folder planted under it is refused)
    volume_root = DEFAULT_DATA_MOUNT_PATH if in_cluster_pod() else work_dir
    staged = Path(dataset.path)
    if work_dir:
        run_dir = make_run_dir(Path(work_dir) / name, root=volume_root, exist_ok=not pipeline_job_id)
        staged = run_dir / "staging" / "dataset"
        remove_tree(staged.parent, root=volume_root)  # left by an earlier call of the same name (no KFP run id)
        copy_tree(dataset.path, staged, root=dataset.path, dst_root=volume_root)
    source = str(dataset.metadata.get("source", ""))
    pinned = {"run_name": name, "dataset": source if source.startswith("builtin:") else str(staged),
              "eval_dataset": str(staged)}  # fmt: skip
    if work_dir:
        pinned["output_dir"] = str(Path(work_dir) / name)
    config = resolve_run_config(
        config_yaml, knobs, list(extra_overrides or []), tracking_uri=mlflow_tracking_uri,
        default_tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", ""), pinned=pinned,
    )  # fmt: skip
    check_pipeline_config(config)

    # The decision on the run, before any credential is loaded and before any network call (the champion read and
    # the warm-start download below send the MLflow credentials to the run's tracking URI): in a cluster pod the
    # step's own inputs (the tracking URI, the registered models it reads), and with the kubernetes backend the whole
    # run (`KubernetesBackend.check`, the policy's `check_run`). Outside a pod with the local backend: nothing.
    reads = [(registered_model_name, "read the champion of")] if warm_start == "champion" else []
    held_name = registry_model_name(config.model_name_or_path)
    if held_name is not None:
        reads.append((held_name, "read a version of"))
    check_step(
        "train_grpo",
        launch_backend=launch_backend,
        tracking_uri=config.tracking_uri if in_cluster_pod() else None,  # else the backend's check judges it
        registered_models=reads,
    )
    # the kubernetes backend reads the mounted platform policy (no call to the cluster yet)
    backend = backend_for(launch_backend, backend_options, trainer_api)
    decided = config  # the config the policy judged; a warm start below replaces the model, and it is judged again
    if launch_backend == "kubernetes":
        backend.check(config)
    load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands

    start_note = ""
    if warm_start == "champion":
        import mlflow

        from async_grpo.lifecycle import registry
        from async_grpo.tracking import open_store

        open_store(config.tracking_uri)
        held = registry.champion(mlflow.MlflowClient(config.tracking_uri), registered_model_name, champion_alias)
        if held is None:
            start_note = f"base {config.model_name_or_path} (warm_start=champion: {registered_model_name} has no "
            start_note += f"{champion_alias} yet)"
            log.info("warm start: %s", start_note)
        else:
            config = config.model_copy(update={"model_name_or_path": f"models:/{registered_model_name}/{held.version}"})
    from async_grpo.lifecycle.registry_start import WARM_START_TAG, resolve_registry_start

    # a models:/ model is downloaded before anything starts: on the volume, privately first, then into a new folder
    config, warm = resolve_registry_start(config, volume_root=volume_root or None)

    import mlflow

    from async_grpo.config import flat_params
    from async_grpo.lifecycle.pipeline_tracking import PipelineRun
    from async_grpo.tracking import experiment_name, open_store

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

    log.info(
        "launching run %r with the %s backend (timeout %.0f s): model=%s dataset=%s max_steps=%d output_dir=%s",
        name,
        launch_backend,
        launch_timeout_s,
        config.model_name_or_path,
        config.data.dataset,
        config.optim.max_steps,
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
    log.info(
        "run %r finished: MLflow run %s at %s; metrics %s",
        name,
        result.mlflow_run_id,
        result.tracking_uri,
        result.metrics,
    )

    no_checkpoint = RuntimeError(
        f"run {name!r} finished but left no HF checkpoint at {result.model_dir!r}. "
        "Fix: check the trainer logs; save_model must stay true."
    )
    if not result.model_dir:
        raise no_checkpoint
    try:  # the final model lies on the tenant-writable volume: copied without following a link (UnsafeVolumePath)
        copy_tree(result.model_dir, model.path, root=volume_root or config.output_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise no_checkpoint from None
    if not (Path(model.path) / "config.json").is_file():  # checked on the step's own copy
        raise no_checkpoint
    model.metadata.update({
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
    names = ["mlflow_run_id", "tracking_uri", "resolved_config", "run_name", "mlflow_parent_run_id"]
    outputs = namedtuple("TrainOutputs", names)
    return outputs(result.mlflow_run_id, result.tracking_uri, dump_config(config), name, parent_run_id)
