"""The on-policy distillation teacher a Kubernetes run serves when it names `teacher_model_name_or_path`: a vLLM
Deployment and a ClusterIP Service `<run>-teacher` (`k8s_served`), cut from the same pod parts as the policy's
server, and the run's config pointing `teacher_url` at that Service.

The teacher's one client is the orchestrator, which runs beside trainer rank 0: only the trainer pods get the
teacher's bearer token (`TEACHER_TOKEN_KEY` of the run's tokens Secret, as ASYNC_GRPO_TEACHER_API_KEY), reach its
pods (`k8s_network`) and wait for it (an init container). The trainer resolves DNS, so the Service's name needs no
pinning. The teacher serves the policy's context length (`vllm_max_model_len`): a sequence that fills it is scored but
for its last token (`distillation.teacher`).
"""

from __future__ import annotations

from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_pods import TEACHER_TOKEN_KEY, Manifest, image_server_command
from async_grpo.launch.k8s_served import (
    ServedModel,
    build_served_deployment,
    build_served_service,
    served_base_url,
)
from async_grpo.launch.k8s_settings import ClusterSettings

TEACHER = "teacher"  # component label, container name and object-name suffix


def serves_teacher(config: GRPOConfig) -> bool:
    """True when the launcher serves the run's distillation teacher: `teacher_model_name_or_path` names its model
    (a `teacher_url` teacher is the submitter's own)."""
    return config.distillation.teacher_model_name_or_path is not None


def teacher_health_url(run_name: str, settings: ClusterSettings) -> str:
    """The teacher's base URL without /v1 (its /health answers without the token)."""
    return served_base_url(run_name, settings, TEACHER)


def teacher_url(run_name: str, settings: ClusterSettings) -> str:
    """The OpenAI-compatible base URL of the run's teacher (`teacher_url` in the trainer's config): its Service, /v1."""
    return f"{teacher_health_url(run_name, settings)}/v1"


def teacher_command(config: GRPOConfig, settings: ClusterSettings) -> list[str]:
    """The teacher's server command in the vLLM image: `image_server_command` without weight transfer (the teacher's
    weights never change), the run's dtype and seed, `--max-model-len` of the policy's (`distillation.teacher` says
    why not one more), the CPU flags on cpu, `--tensor-parallel-size` for several `teacher_gpus`, the bearer-token
    middleware (every route but /health), and `--max-logprobs K` when top-k distillation asks for more than vLLM's
    default of 20 (`DistillationConfig.teacher_serve_args`). The model is served under its path, the `teacher_model`
    the trainer's config names. The policy's `vllm_extra_args` are not passed (they size the policy's server).

    Raises:
        ValueError: the run serves no teacher.
    """
    model = config.distillation.teacher_model_name_or_path
    if model is None:
        raise ValueError(
            "teacher_model_name_or_path is not set: the run serves no teacher. Fix: set it, or give teacher_url."
        )
    command = image_server_command(
        config,
        settings,
        model,
        weight_transfer_backend=None,
        tensor_parallel_size=settings.teacher_gpus,
    )
    return command + config.distillation.teacher_serve_args


def build_teacher_deployment(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """The teacher's vLLM Deployment `<run>-teacher` (`teacher_replicas` pods, `teacher_gpus` GPUs each, the vLLM
    image; `k8s_served.build_served_deployment`): non-root with a read-only root, no ServiceAccount token, /dev/shm,
    probes on /health, the model read from the workspace volume (read-only), and only the teacher's own token (as
    VLLM_API_KEY). No MLflow, hub or policy-vLLM credentials.

    Raises:
        ValueError: the run serves no teacher.
    """
    served = ServedModel(
        component=TEACHER,
        command=teacher_command(config, settings),
        token_key=TEACHER_TOKEN_KEY,
        replicas=settings.teacher_replicas,
        gpus=settings.teacher_gpus,
        cpu=settings.teacher_cpu,
        memory_gib=settings.teacher_memory_gib,
    )
    return build_served_deployment(config, settings, run_name, served, owner)


def build_teacher_service(settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None) -> Manifest:
    """ClusterIP Service `<run>-teacher` in front of the teacher pods (requests spread over `teacher_replicas`)."""
    return build_served_service(settings, run_name, TEACHER, owner)
