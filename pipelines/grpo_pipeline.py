"""The async GRPO pipeline: prepare_dataset -> train_grpo -> evaluate -> register_model (if it passed), cleanup on exit.

Every user-facing knob is a typed pipeline parameter whose default is the embedded demo config
(`examples/tiny_cpu.yaml`), so the Kubeflow UI shows exactly what a run will use; the rest of
GRPOConfig travels in `config_yaml` and `extra_overrides`. All Kubernetes wiring (secrets, the
workspace volume, GPU scheduling, shared memory) is here, never in a component, so the components run
unchanged under `kfp.local`.

Compile with `async-grpo pipeline compile` (or `python -m pipelines.grpo_pipeline`); the IR files
beside this one are committed and a test fails when they are stale.
"""

import inspect
import json
from pathlib import Path
from typing import Callable, List

import yaml
from kfp import compiler, dsl, kubernetes

from async_grpo.config import GRPOConfig
from components import ASYNC_GRPO_CPU_IMAGE
from components.cleanup.component import cleanup
from components.evaluate.component import evaluate
from components.prepare_dataset.component import prepare_dataset
from components.register_model.component import register_model
from components.train_grpo.component import train_grpo

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG_PATH = HERE.parent / "examples" / "tiny_cpu.yaml"
# Set by the pipeline itself, so left out of the default `config_yaml`.
PIPELINE_SET_FIELDS = ("dataset", "eval_dataset", "output_dir", "run_name", "mlflow_tracking_uri")
WORKSPACE_MOUNT_PATH = "/workspace"  # the workspace PVC, mounted at this path in component and trainer pods
SHM_SIZE_LIMIT = "16Gi"  # /dev/shm for vLLM and NCCL (the container default of 64 MiB is far too small)
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
# (file, GPU flavour): the cluster pipeline asks a GPU for the evaluation pod; the CPU one (dev overlay,
# kfp.local) asks none.
PACKAGES = {"grpo_pipeline.yaml": True, "grpo_pipeline_cpu.yaml": False}


def _default_config_yaml(typed_knobs: tuple[str, ...]) -> str:
    """The demo config's fields that have no typed knob, as one line of YAML (JSON flow style).

    One line, because the KFP compiler copies defaults into the IR's header comment verbatim and a
    multi-line default would break the YAML.
    """
    demo = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    rest = {k: v for k, v in demo.items() if k not in typed_knobs and k not in PIPELINE_SET_FIELDS}
    return json.dumps(rest, sort_keys=True)


# GRPOConfig fields that are typed pipeline parameters (train_grpo takes each as an optional input).
TYPED_KNOBS = tuple(p for p in inspect.signature(train_grpo.python_func).parameters
                    if p in GRPOConfig.model_fields and p not in PIPELINE_SET_FIELDS)
DEFAULT_CONFIG_YAML = _default_config_yaml(TYPED_KNOBS)


def _mlflow_env(task: dsl.PipelineTask, secret_name) -> None:
    """MLFLOW_TRACKING_URI (required) and optional basic-auth credentials from one secret."""
    kubernetes.use_secret_as_env(task, secret_name=secret_name,
                                 secret_key_to_env={"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"})
    kubernetes.use_secret_as_env(task, secret_name=secret_name, optional=True, secret_key_to_env={
        "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD"})


def _hf_env(task: dsl.PipelineTask, secret_name) -> None:
    """HF_TOKEN for gated hub models; optional, public models need none."""
    kubernetes.use_secret_as_env(task, secret_name=secret_name, optional=True,
                                 secret_key_to_env={"HF_TOKEN": "HF_TOKEN"})


def _workspace(task: dsl.PipelineTask, pvc_name) -> None:
    kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=WORKSPACE_MOUNT_PATH)


def build_pipeline(gpu: bool = True) -> Callable:
    """The pipeline function, GPU flavour (evaluation pod asks one `nvidia.com/gpu` and is steered to GPU
    nodes by default) or CPU flavour (the CPU image for every step, no accelerator, empty node selector
    and tolerations).

    Returns:
        a `@dsl.pipeline` function, named `async-grpo` or `async-grpo-cpu`.
    """
    default_selector = GPU_NODE_SELECTOR if gpu else {}
    default_tolerations = GPU_TOLERATIONS if gpu else []

    def flavour(task: dsl.PipelineTask) -> dsl.PipelineTask:
        return task if gpu else task.set_container_image(ASYNC_GRPO_CPU_IMAGE)

    @dsl.pipeline(name="async-grpo" if gpu else "async-grpo-cpu",
                  description="Asynchronous GRPO post-training: vLLM rollouts, reward workers and a trainer; "
                              "evaluate on held-out prompts; register the model in MLflow when it improved.")
    def grpo_pipeline(
        # ---- model, data, rewards (GRPOConfig names)
        model_name_or_path: str = "builtin:tiny",
        dataset: str = "builtin:reverse",
        eval_dataset: str = "",
        eval_fraction: float = 0.05,
        reward_funcs: List[str] = ["builtin:reverse_exact_match", "builtin:reverse_format"],
        reward_weights: List[float] = [1.0, 0.5],
        # ---- GRPO (GRPOConfig names; TRL's where TRL has one)
        num_generations: int = 8,
        max_completion_length: int = 12,
        max_prompt_length: int = 256,
        temperature: float = 1.0,
        learning_rate: float = 3.0e-4,
        per_device_train_batch_size: int = 64,
        gradient_accumulation_steps: int = 2,
        max_steps: int = 600,
        seed: int = 0,
        loss_type: str = "dapo",
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float = 0.28,
        scale_rewards: str = "group",
        vllm_importance_sampling_mode: str = "token_truncate",
        vllm_importance_sampling_cap: float = 3.0,
        max_staleness: int = 2,
        vllm_sync_interval: int = 1,
        warmup_sft_steps: int = 1500,
        eval_num_prompts: int = 128,
        num_generations_eval: int = 4,
        mlflow_experiment_name: str = "async-grpo",
        config_yaml: str = DEFAULT_CONFIG_YAML,
        extra_overrides: List[str] = [],
        # ---- launch
        launch_backend: str = "kubernetes",
        launch_timeout_s: float = 86400.0,
        kubernetes_options: dict = {},
        run_name: str = "",
        work_dir: str = WORKSPACE_MOUNT_PATH,
        mlflow_tracking_uri: str = "",
        # ---- registration gate
        registered_model_name: str = "async-grpo-tiny",
        min_eval_reward: float = 0.0,
        require_improvement: bool = True,
        # ---- Kubernetes wiring
        mlflow_secret_name: str = "mlflow-tracking",
        hf_token_secret_name: str = "hf-token",
        workspace_pvc_name: str = "async-grpo-workspace",
        gpu_node_selector: dict = default_selector,
        gpu_tolerations: list = default_tolerations,
    ):
        """Prepare the dataset, train with async GRPO, evaluate, register when better; always clean up.

        Typed knobs override the same fields of `config_yaml`; `extra_overrides` (`key=value`) override
        both. `launch_backend` is "kubernetes" on a cluster and "local" under kfp.local.
        """
        exit_task = cleanup(launch_backend=launch_backend, run_name=run_name,
                            pipeline_job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER, work_dir=work_dir,
                            backend_options=kubernetes_options)
        flavour(exit_task).set_display_name("cleanup").set_caching_options(False)
        _workspace(exit_task, workspace_pvc_name)

        with dsl.ExitHandler(exit_task, name="grpo-run"):
            data = prepare_dataset(dataset_uri=dataset, eval_dataset_uri=eval_dataset, eval_fraction=eval_fraction,
                                   model_name_or_path=model_name_or_path, max_prompt_length=max_prompt_length,
                                   seed=seed)
            flavour(data).set_display_name("prepare dataset").set_caching_options(False)
            _hf_env(data, hf_token_secret_name)
            _workspace(data, workspace_pvc_name)

            train = train_grpo(
                dataset=data.outputs["dataset"], config_yaml=config_yaml, model_name_or_path=model_name_or_path,
                reward_funcs=reward_funcs, reward_weights=reward_weights, num_generations=num_generations,
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
                mlflow_tracking_uri=mlflow_tracking_uri,
            )  # fmt: skip
            flavour(train).set_display_name("train (async GRPO)").set_caching_options(False)
            _mlflow_env(train, mlflow_secret_name)
            _hf_env(train, hf_token_secret_name)
            _workspace(train, workspace_pvc_name)

            score = evaluate(
                model=train.outputs["model"], dataset=data.outputs["dataset"],
                mlflow_run_id=train.outputs["mlflow_run_id"], tracking_uri=train.outputs["tracking_uri"],
                resolved_config=train.outputs["resolved_config"], registered_model_name=registered_model_name,
                min_eval_reward=min_eval_reward, require_improvement=require_improvement,
            )  # fmt: skip
            flavour(score).set_display_name("evaluate (held-out reward, vLLM)").set_caching_options(False)
            _mlflow_env(score, mlflow_secret_name)
            _hf_env(score, hf_token_secret_name)
            _workspace(score, workspace_pvc_name)
            kubernetes.add_node_selector_json(score, gpu_node_selector)
            kubernetes.add_toleration_json(score, gpu_tolerations)
            kubernetes.empty_dir_mount(score, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                       size_limit=SHM_SIZE_LIMIT)
            if gpu:
                score.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)

            with dsl.If(score.outputs["Output"] == True, name="evaluation-passed"):  # noqa: E712 (KFP condition)
                register = register_model(
                    model=train.outputs["model"], metrics=score.outputs["metrics"],
                    mlflow_run_id=train.outputs["mlflow_run_id"], tracking_uri=train.outputs["tracking_uri"],
                    registered_model_name=registered_model_name,
                )  # fmt: skip
                flavour(register).set_display_name("register model (MLflow)").set_caching_options(False)
                _mlflow_env(register, mlflow_secret_name)

    return grpo_pipeline


grpo_pipeline = build_pipeline(gpu=True)
grpo_pipeline_cpu = build_pipeline(gpu=False)


def compile_pipeline(package_path: str | Path, gpu: bool = True) -> Path:
    """Compile the pipeline (GPU or CPU flavour) to the IR YAML at `package_path`; returns the path."""
    path = Path(package_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(gpu), str(path))
    return path


if __name__ == "__main__":
    for name, flavour_gpu in PACKAGES.items():
        print(f"wrote {compile_pipeline(HERE / name, gpu=flavour_gpu)}")
