"""The async GRPO pipeline: prepare_dataset -> train_grpo -> evaluate -> register_model (if it passed), cleanup on exit.

Every user-facing knob is a typed pipeline parameter, described in the Kubeflow UI, whose default comes from
the flavour's example config, so the UI shows exactly what a run will use: the GPU pipeline defaults to a real
instruct model on GSM8K (`examples/trl_qwen_gsm8k.yaml`: TRL's learning rate, no supervised warm start, the
registered name from the model), the CPU pipeline to the embedded demo (`examples/tiny_cpu.yaml`). The rest of
GRPOConfig travels in `config_yaml` and `extra_overrides`. All Kubernetes wiring (secrets, the
workspace volume, the platform policy, GPU scheduling, shared memory) is here, never in a component,
so the components run unchanged under `kfp.local`. The HF token reaches only the dataset step: no
step that runs submitter code holds it.

Compile with `async-grpo pipeline compile` (or `python -m pipelines.grpo_pipeline`); the IR files
beside this one are committed and a test fails when they are stale.
"""

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

import yaml
from kfp import compiler, dsl, kubernetes

from async_grpo.config import FIELDS, flatten_mapping
from async_grpo.launch.k8s_network import EVALUATOR_LABELS
from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH
from async_grpo.launch.platform_policy import POLICY_CONFIG_MAP, POLICY_MOUNT_DIR
from async_grpo.step_secrets import HF_SECRET_DIR, MLFLOW_SECRET_DIR
from components import ASYNC_GRPO_CPU_IMAGE
from components.cleanup.component import cleanup
from components.evaluate.component import evaluate
from components.prepare_dataset.component import prepare_dataset
from components.register_model.component import register_model
from components.train_grpo.component import train_grpo

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG_PATH = HERE.parent / "examples" / "tiny_cpu.yaml"
GPU_CONFIG_PATH = HERE.parent / "examples" / "trl_qwen_gsm8k.yaml"
# Set by the pipeline itself, so left out of the default `config_yaml`.
PIPELINE_SET_FIELDS = ("dataset", "eval_dataset", "output_dir", "run_name", "mlflow_tracking_uri")
WORKSPACE_MOUNT_PATH = DEFAULT_DATA_MOUNT_PATH  # the workspace PVC, mounted at this path in component and trainer pods
# On Kubernetes the model is a folder on the workspace volume (docs/deploy.md downloads it there)
GPU_MODEL_PATH = f"{WORKSPACE_MOUNT_PATH}/models/Qwen2.5-0.5B-Instruct"
SHM_SIZE_LIMIT = "16Gi"  # /dev/shm for vLLM and NCCL (the container default of 64 MiB is far too small)
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
# (file, GPU flavour): the cluster pipeline asks a GPU for the evaluation pod; the CPU one (dev overlay,
# kfp.local) asks none.
PACKAGES = {"grpo_pipeline.yaml": True, "grpo_pipeline_cpu.yaml": False}
# The KFP run's times, given to the dataset step for `{date}`; kfp 2.17's local runner cannot resolve them.
KFP_TIME_PLACEHOLDERS = (dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER, dsl.PIPELINE_JOB_CREATE_TIME_UTC_PLACEHOLDER)


def flavour_config(gpu: bool) -> dict:
    """The flavour's example config as flat keys (TRL aliases as our names; TRL-only keys kept as written); the
    GPU flavour's model is the folder on the workspace volume."""
    data = flatten_mapping(yaml.safe_load((GPU_CONFIG_PATH if gpu else DEFAULT_CONFIG_PATH).read_text()))
    return {**data, "model_name_or_path": GPU_MODEL_PATH} if gpu else data


def _default_config_yaml(typed_knobs: tuple[str, ...], gpu: bool) -> str:
    """The flavour config's fields that have no typed knob, as one line of YAML (JSON flow style).

    One line, because the KFP compiler copies defaults into the IR's header comment verbatim and a
    multi-line default would break the YAML.
    """
    rest = {k: v for k, v in flavour_config(gpu).items() if k not in typed_knobs and k not in PIPELINE_SET_FIELDS}
    return json.dumps(rest, sort_keys=True)


# GRPOConfig fields that are typed pipeline parameters (train_grpo takes each as an optional input).
TYPED_KNOBS = tuple(
    p for p in inspect.signature(train_grpo.python_func).parameters if p in FIELDS and p not in PIPELINE_SET_FIELDS
)
DEFAULT_CONFIG_YAML = _default_config_yaml(TYPED_KNOBS, gpu=False)


def knob_defaults(gpu: bool) -> dict:
    """Default of every typed knob (and `dataset`, `system_prompt`, `dataset_config`) for the flavour."""
    config = flavour_config(gpu)
    names = (*TYPED_KNOBS, "dataset", "system_prompt", "dataset_config")
    return {k: config.get(k, FIELDS[k].default) for k in names}


@dataclass(frozen=True)
class PipelineWiring:
    """The Secret and volume names the pipeline's steps mount: fixed when the platform engineer compiles the
    pipeline (`async-grpo pipeline compile --mlflow-secret ... --hf-token-secret ... --workspace-pvc ...`), never
    run parameters, so a run started from the Kubeflow UI cannot mount another Secret or volume into a step.

    Attributes:
        mlflow_secret: Secret holding MLFLOW_TRACKING_URI and optional MLFLOW_TRACKING_USERNAME / PASSWORD.
        hf_token_secret: Secret holding HF_TOKEN (optional key), mounted in the dataset step only.
        workspace_pvc: PersistentVolumeClaim mounted at WORKSPACE_MOUNT_PATH in the steps.
    """

    mlflow_secret: str = "mlflow-tracking"
    hf_token_secret: str = "hf-token"
    workspace_pvc: str = "async-grpo-workspace"


def _mlflow_env(task: dsl.PipelineTask, secret_name: str) -> None:
    """The MLflow Secret (MLFLOW_TRACKING_URI required; optional basic-auth credentials) as files at
    MLFLOW_SECRET_DIR, which the step loads into its own environment (`async_grpo.step_secrets`). Never as
    environment variables: the kubelet would expand a submitter's `$(MLFLOW_TRACKING_PASSWORD)` in the step's
    command, which carries the run's config. The volume is required, as the URI is: no Secret, no run."""
    kubernetes.use_secret_as_volume(task, secret_name=secret_name, mount_path=MLFLOW_SECRET_DIR)


def _hf_env(task: dsl.PipelineTask, secret_name: str) -> None:
    """HF_TOKEN for gated hub models, as a file at HF_SECRET_DIR (optional: public models need none); loaded by the
    step itself, for the reason `_mlflow_env` gives."""
    kubernetes.use_secret_as_volume(task, secret_name=secret_name, mount_path=HF_SECRET_DIR, optional=True)


def _workspace(task: dsl.PipelineTask, pvc_name: str) -> None:
    kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=WORKSPACE_MOUNT_PATH)


def _policy(task: dsl.PipelineTask) -> None:
    """The platform's allow-list (ConfigMap async-grpo-policy), read by the launcher in this step. Fixed here,
    not a parameter: a submitter cannot point a run at another policy. Required: no policy, no run."""
    kubernetes.use_config_map_as_volume(task, config_map_name=POLICY_CONFIG_MAP, mount_path=POLICY_MOUNT_DIR)


def build_pipeline(
    gpu: bool = True, wiring: PipelineWiring = PipelineWiring(), for_kfp_local: bool = False
) -> Callable:
    """The pipeline function, GPU flavour (evaluation pod asks one `nvidia.com/gpu` and is steered to GPU
    nodes by default) or CPU flavour (the CPU image for every step, no accelerator, empty node selector
    and tolerations).

    Args:
        wiring: the Secret and volume names the steps mount, compiled in as constants.
        for_kfp_local: for `kfp.local` (`async-grpo pipeline run-local`): the dataset step gets no KFP run times
            (KFP_TIME_PLACEHOLDERS), since kfp 2.17's local runner cannot resolve them (it fails with IndexError
            before any step runs); it then takes the clock's UTC date for `{date}`. A cluster's package has them.

    Returns:
        a `@dsl.pipeline` function, named `async-grpo` or `async-grpo-cpu`.
    """
    default_selector = GPU_NODE_SELECTOR if gpu else {}
    default_tolerations = GPU_TOLERATIONS if gpu else []
    d = knob_defaults(gpu)
    config_yaml_default = _default_config_yaml(TYPED_KNOBS, gpu)
    registered_default = f"{d['model_name_or_path'].rstrip('/').rsplit('/', 1)[-1]}-grpo" if gpu else "async-grpo-tiny"
    run_times = ("", "") if for_kfp_local else KFP_TIME_PLACEHOLDERS  # (scheduled, created) for `{date}`

    def flavour(task: dsl.PipelineTask) -> dsl.PipelineTask:
        return task if gpu else task.set_container_image(ASYNC_GRPO_CPU_IMAGE)

    @dsl.pipeline(
        name="async-grpo" if gpu else "async-grpo-cpu",
        description="Asynchronous GRPO post-training: vLLM rollouts, reward workers and a trainer; "
        "evaluate head to head with the champion on held-out prompts; register and promote the model in MLflow "
        "when it is shown better.",
    )
    def grpo_pipeline(
        # ---- model, data, rewards (GRPOConfig names)
        model_name_or_path: str = d["model_name_or_path"],
        dataset: str = d["dataset"],
        dataset_config: str = d["dataset_config"] or "",
        system_prompt: str = d["system_prompt"] or "",
        eval_dataset: str = "",
        eval_fraction: float = 0.05,
        reward_funcs: List[str] = d["reward_funcs"],
        reward_weights: List[float] = d["reward_weights"],
        tools: List[str] = d["tools"],
        # ---- GRPO (GRPOConfig names; TRL's where TRL has one)
        num_generations: int = d["num_generations"],
        max_completion_length: int = d["max_completion_length"],
        max_prompt_length: int = d["max_prompt_length"],
        temperature: float = d["temperature"],
        learning_rate: float = d["learning_rate"],
        per_device_train_batch_size: int = d["per_device_train_batch_size"],
        gradient_accumulation_steps: int = d["gradient_accumulation_steps"],
        max_steps: int = d["max_steps"],
        seed: int = d["seed"],
        loss_type: str = d["loss_type"],
        beta: float = d["beta"],
        epsilon: float = d["epsilon"],
        epsilon_high: float = d["epsilon_high"],
        scale_rewards: str = d["scale_rewards"],
        vllm_importance_sampling_mode: str = d["vllm_importance_sampling_mode"],
        vllm_importance_sampling_cap: float = d["vllm_importance_sampling_cap"],
        max_staleness: int = d["max_staleness"],
        vllm_sync_interval: int = d["vllm_sync_interval"],
        warmup_sft_steps: int = d["warmup_sft_steps"],
        eval_num_prompts: int = d["eval_num_prompts"],
        num_generations_eval: int = d["num_generations_eval"],
        mlflow_experiment_name: str = d["mlflow_experiment_name"],
        config_yaml: str = config_yaml_default,
        extra_overrides: List[str] = [],
        # ---- launch
        launch_backend: str = "kubernetes",
        launch_timeout_s: float = 86400.0,
        kubernetes_options: dict = {},
        trainer_api: str = "",
        run_name: str = "",
        work_dir: str = WORKSPACE_MOUNT_PATH,
        mlflow_tracking_uri: str = "",
        # ---- retraining: warm start and the registration gate
        warm_start: str = "none",
        registered_model_name: str = registered_default,
        min_eval_reward: float = 0.0,
        require_improvement: bool = True,
        min_improvement: float = 0.0,
        promotion_confidence: float = 0.95,
        # ---- Kubernetes scheduling of the evaluation pod (Secret and volume names are compiled in: PipelineWiring)
        gpu_node_selector: dict = default_selector,
        gpu_tolerations: list = default_tolerations,
    ):
        """Prepare the dataset, train with async GRPO, evaluate, register when better; always clean up.

        Typed knobs override the same fields of `config_yaml`; `extra_overrides` (`key=value`) override
        both. `launch_backend` is "kubernetes" on a cluster and "local" under kfp.local.

        Args:
            model_name_or_path: The policy to train: a Hugging Face model folder on the workspace volume (/workspace/models/...), or builtin:tiny.
            dataset: Training prompts: a Hugging Face Hub dataset id (e.g. openai/gsm8k), a .jsonl/.json/.parquet file, a folder of them (its newest file is read) or a save_to_disk folder on the workspace volume, or builtin:<task>. In a path, {date} is the run's scheduled UTC date as YYYY-MM-DD (else its creation date), e.g. /workspace/data/{date}.jsonl, so a recurring run reads each day's file. GSM8K (question/answer) and MATH (problem/solution) rows are turned into prompt + answer.
            dataset_config: Configuration of a hub dataset (TRL dataset_config), e.g. main for openai/gsm8k; empty for none.
            system_prompt: System message put before every prompt; empty for none.
            eval_dataset: Held-out prompts in the same formats ({date} and folders too); empty: a hub dataset's test split, a builtin task's held-out split, or eval_fraction of the training rows.
            eval_fraction: Share of training rows held out when there is no other held-out set, in (0, 0.5].
            reward_funcs: Reward functions: builtin:<name> (math_accuracy, think_answer_format, soft_overlong_penalty, ...), pkg.module:function, or a .py file on the workspace volume with :function. TRL's reward signature.
            reward_weights: One weight per reward function (TRL reward_weights).
            tools: Tools the model may call in multi-turn rollouts (TRL tools): builtin:<name> (calculator), pkg.module:function, or a .py file on the workspace volume with :function; empty for single-turn rollouts.
            num_generations: Completions sampled per prompt, the group size G (TRL name).
            max_completion_length: Most tokens generated per completion (TRL name).
            max_prompt_length: Prompts longer than this many tokens are dropped (and counted).
            temperature: Sampling temperature of the rollouts; the trainer scores with the same one (TRL name).
            learning_rate: AdamW learning rate (TRL name; TRL's default is 1e-6).
            per_device_train_batch_size: Completions per micro-batch on each trainer rank (TRL name).
            gradient_accumulation_steps: Micro-batches per optimizer step (TRL name); completions per step must be a multiple of num_generations.
            max_steps: Optimizer steps to run; -1 trains num_train_epochs passes over the prompts (TRL).
            seed: Seed of data order, model init, sampling and the held-out split.
            loss_type: GRPO loss aggregation: dapo, grpo, bnpo, dr_grpo, cispo or sapo (TRL name).
            beta: KL coefficient against the initial policy; 0 needs no reference model (TRL name).
            epsilon: Lower clip range of the policy ratio (TRL name).
            epsilon_high: Upper clip range (DAPO clip-higher; TRL name).
            scale_rewards: Advantage scaling: group, batch or none (TRL name).
            vllm_importance_sampling_mode: Stale-rollout correction: token_truncate, token_mask, sequence_truncate or sequence_mask (TRL name).
            vllm_importance_sampling_cap: Upper bound of the stale-rollout importance ratio (TRL vllm_importance_sampling_clip_max).
            max_staleness: Rollout groups sampled more than this many policy versions ago are dropped (counted).
            vllm_sync_interval: Push the trainer's weights to vLLM every this many optimizer steps.
            warmup_sft_steps: Supervised warm-start steps before GRPO (builtin tasks only; 0 for real models).
            eval_num_prompts: Held-out prompts scored per evaluation.
            num_generations_eval: Completions sampled per held-out prompt (TRL name).
            mlflow_experiment_name: MLflow experiment of the run.
            config_yaml: The rest of the GRPOConfig as YAML (flat TRL names or sections); typed parameters win over it. See async-grpo train --help and docs/trl.md.
            extra_overrides: key=value overrides of any GRPOConfig field, applied last (values parsed as YAML).
            launch_backend: kubernetes (PyTorchJob trainer, vLLM and reward Deployments) on a cluster; local under kfp.local.
            launch_timeout_s: Seconds the training step may run before it gives up and cleans up.
            kubernetes_options: ClusterSettings for the kubernetes backend (GPUs, nodes, images, resources); the platform policy bounds them.
            trainer_api: How the kubernetes backend launches the trainer: pytorchjob (Training Operator v1), or trainjob (a Kubeflow Trainer v2 TrainJob on the async-grpo ClusterTrainingRuntime); empty: kubernetes_options decides (default pytorchjob).
            run_name: Name of the run (MLflow run, folders, cluster objects); empty: the KFP run's name. A suffix of the KFP run id keeps names unique.
            work_dir: Shared folder for run outputs and staged data: the workspace volume's mount path or a folder under it (in a cluster pod the steps refuse any other).
            mlflow_tracking_uri: MLflow tracking URI; empty: the MLflow secret's MLFLOW_TRACKING_URI.
            warm_start: none trains model_name_or_path; champion trains the current champion of registered_model_name (the base model while there is none).
            registered_model_name: MLflow registry entry the model is registered under when it passes the gate.
            min_eval_reward: Register only when the held-out reward is at least this.
            require_improvement: Register only when the model beats the current champion on the same held-out prompts and seeds: the lower bound of the bootstrap interval of the mean per-prompt difference must exceed min_improvement.
            min_improvement: Margin (reward units) the interval's lower bound must clear.
            promotion_confidence: Confidence level of that interval, in (0, 1).
            gpu_node_selector: Node selector of the evaluation pod (it starts its own vLLM server).
            gpu_tolerations: Tolerations of the evaluation pod.
        """
        exit_task = cleanup(
            launch_backend=launch_backend,
            run_name=run_name,
            pipeline_job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            work_dir=work_dir,
            backend_options=kubernetes_options,
            trainer_api=trainer_api,
        )
        flavour(exit_task).set_display_name("cleanup").set_caching_options(False)
        _workspace(exit_task, wiring.workspace_pvc)
        _policy(exit_task)

        with dsl.ExitHandler(exit_task, name="grpo-run"):
            data = prepare_dataset(
                schedule_time_utc=run_times[0],
                create_time_utc=run_times[1],
                dataset_uri=dataset,
                eval_dataset_uri=eval_dataset,
                eval_fraction=eval_fraction,
                model_name_or_path=model_name_or_path,
                max_prompt_length=max_prompt_length,
                seed=seed,
                dataset_config=dataset_config,
                system_prompt=system_prompt,
            )
            flavour(data).set_display_name("prepare dataset").set_caching_options(False)
            _hf_env(data, wiring.hf_token_secret)
            _workspace(data, wiring.workspace_pvc)

            train = train_grpo(
                dataset=data.outputs["dataset"], config_yaml=config_yaml, model_name_or_path=model_name_or_path,
                reward_funcs=reward_funcs, reward_weights=reward_weights, tools=tools, num_generations=num_generations,
                max_completion_length=max_completion_length, max_prompt_length=max_prompt_length,
                temperature=temperature, learning_rate=learning_rate,
                per_device_train_batch_size=per_device_train_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps, max_steps=max_steps, seed=seed,
                loss_type=loss_type, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                scale_rewards=scale_rewards, vllm_importance_sampling_mode=vllm_importance_sampling_mode,
                vllm_importance_sampling_cap=vllm_importance_sampling_cap, max_staleness=max_staleness,
                vllm_sync_interval=vllm_sync_interval, warmup_sft_steps=warmup_sft_steps,
                eval_num_prompts=eval_num_prompts, num_generations_eval=num_generations_eval,
                mlflow_experiment_name=mlflow_experiment_name, extra_overrides=extra_overrides,
                launch_backend=launch_backend, launch_timeout_s=launch_timeout_s, backend_options=kubernetes_options,
                work_dir=work_dir, run_name=run_name, pipeline_job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, mlflow_tracking_uri=mlflow_tracking_uri,
                warm_start=warm_start, registered_model_name=registered_model_name, trainer_api=trainer_api,
            )  # fmt: skip
            flavour(train).set_display_name("train (async GRPO)").set_caching_options(False)
            _mlflow_env(train, wiring.mlflow_secret)
            _workspace(train, wiring.workspace_pvc)
            _policy(train)

            score = evaluate(
                model=train.outputs["model"], dataset=data.outputs["dataset"],
                mlflow_run_id=train.outputs["mlflow_run_id"], tracking_uri=train.outputs["tracking_uri"],
                resolved_config=train.outputs["resolved_config"], registered_model_name=registered_model_name,
                min_eval_reward=min_eval_reward, require_improvement=require_improvement,
                min_improvement=min_improvement, promotion_confidence=promotion_confidence,
                launch_backend=launch_backend, backend_options=kubernetes_options, run_name=train.outputs["run_name"],
                mlflow_parent_run_id=train.outputs["mlflow_parent_run_id"],
            )  # fmt: skip
            flavour(score).set_display_name("evaluate (held-out reward, vLLM)").set_caching_options(False)
            _mlflow_env(score, wiring.mlflow_secret)
            _workspace(score, wiring.workspace_pvc)
            _policy(score)
            for key, value in EVALUATOR_LABELS.items():  # its reward service admits only pods with this label
                kubernetes.add_pod_label(score, key, value)
            kubernetes.add_node_selector_json(score, gpu_node_selector)
            kubernetes.add_toleration_json(score, gpu_tolerations)
            kubernetes.empty_dir_mount(
                score, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=SHM_SIZE_LIMIT
            )
            if gpu:
                score.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)

            with dsl.If(score.outputs["Output"] == True, name="evaluation-passed"):  # noqa: E712 (KFP condition)
                register = register_model(
                    model=train.outputs["model"], metrics=score.outputs["metrics"],
                    mlflow_run_id=train.outputs["mlflow_run_id"], tracking_uri=train.outputs["tracking_uri"],
                    registered_model_name=registered_model_name, dataset=data.outputs["dataset"],
                    resolved_config=train.outputs["resolved_config"], kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    mlflow_parent_run_id=train.outputs["mlflow_parent_run_id"],
                )  # fmt: skip
                flavour(register).set_display_name("register model (MLflow)").set_caching_options(False)
                _mlflow_env(register, wiring.mlflow_secret)
                _policy(register)  # its registered_models: a run writes only its own namespace's models

    return grpo_pipeline


grpo_pipeline = build_pipeline(gpu=True)
grpo_pipeline_cpu = build_pipeline(gpu=False)


def compile_pipeline(
    package_path: str | Path, gpu: bool = True, wiring: PipelineWiring = PipelineWiring(), for_kfp_local: bool = False
) -> Path:
    """Compile the pipeline (GPU or CPU flavour, with `wiring`'s Secret and volume names; `for_kfp_local` as
    `build_pipeline`) to the IR YAML at `package_path`; returns the path."""
    path = Path(package_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(gpu, wiring, for_kfp_local), str(path))
    return path


if __name__ == "__main__":
    for name, flavour_gpu in PACKAGES.items():
        print(f"wrote {compile_pipeline(HERE / name, gpu=flavour_gpu)}")
