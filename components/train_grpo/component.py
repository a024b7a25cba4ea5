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
    from async_grpo.step_secrets import load_tracking_uri

    load_tracking_uri()  # the platform's MLflow server (no credential): the policy's decision needs it
    import logging
    from collections import namedtuple

    from async_grpo.launch.train_step import run_train_step

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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = run_train_step(
        dataset_path=dataset.path, dataset_source=str(dataset.metadata.get("source", "")), model_path=model.path,
        model_metadata=model.metadata, knobs=knobs, config_yaml=config_yaml, extra_overrides=extra_overrides or [],
        launch_backend=launch_backend, launch_timeout_s=launch_timeout_s, backend_options=backend_options,
        work_dir=work_dir, run_name=run_name, pipeline_job_name=pipeline_job_name, pipeline_job_id=pipeline_job_id,
        mlflow_tracking_uri=mlflow_tracking_uri, warm_start=warm_start, registered_model_name=registered_model_name,
        champion_alias=champion_alias, trainer_api=trainer_api,
    )  # fmt: skip
    outputs = namedtuple("TrainOutputs", out._fields)
    return outputs(*out)
