"""The LLM judge a Kubernetes run serves for `builtin:llm_judge` when it names `judge_model_name_or_path`: a vLLM
Deployment and a ClusterIP Service `<run>-judge` (`k8s_served`), cut from the same pod parts as the policy's vLLM
server.

The judge is a plain server (no dev-mode control plane, no weight transfer) behind a bearer token of its own
(`JUDGE_TOKEN_KEY` of the run's tokens Secret). Only the pods that ask it get that token and reach it: the reward
pods when the run has them, else the trainer pod, whose reward process pool then scores (`judge_clients`). The
reward pods resolve no DNS (they reach nothing else), so the launcher pins the Service's cluster IP into their
`/etc/hosts` (`add_judge_host_alias`) once the Service exists.
"""

from __future__ import annotations

from typing import Any, Literal

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_pods import JUDGE_TOKEN_KEY, Manifest, image_server_command
from async_grpo.launch.k8s_served import (
    ServedModel,
    build_served_deployment,
    build_served_service,
    served_base_url,
    served_host,
)
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.rewards.contract import JUDGE_SPEC

JUDGE = "judge"  # component label, container name and object-name suffix


def serves_judge(config: GRPOConfig) -> bool:
    """True when the launcher serves the run's LLM judge: `builtin:llm_judge` is a reward function and
    `judge_model_name_or_path` names its model (a `judge_url` judge is the submitter's own)."""
    return config.rewards.judge_model_name_or_path is not None and JUDGE_SPEC in config.rewards.reward_funcs


def judge_clients(config: GRPOConfig, settings: ClusterSettings) -> Literal["reward", "trainer"] | None:
    """The component whose pods ask the served judge: "reward" (the run's reward pods score the groups), "trainer"
    (reward_replicas 0: the trainer pod's reward process pool scores them), or None when no judge is served."""
    if not serves_judge(config):
        return None
    return "reward" if settings.reward_replicas else "trainer"


def judge_host(run_name: str, settings: ClusterSettings) -> str:
    """The judge Service's in-cluster DNS name."""
    return served_host(run_name, settings, JUDGE)


def judge_url(run_name: str, settings: ClusterSettings) -> str:
    """The OpenAI-compatible base URL of the run's judge (`judge_url` in the run's config): its Service, /v1."""
    return f"{judge_health_url(run_name, settings)}/v1"


def judge_health_url(run_name: str, settings: ClusterSettings) -> str:
    """The judge's base URL without /v1 (its /health answers without the token)."""
    return served_base_url(run_name, settings, JUDGE)


def judge_command(config: GRPOConfig, settings: ClusterSettings) -> list[str]:
    """The judge's server command in the vLLM image: `build_server_command` without weight transfer (the judge's
    weights never change), the run's dtype, length and seed, the CPU flags on cpu, `--tensor-parallel-size` for
    several `judge_gpus`, and the bearer-token middleware (every route but /health). The model is served under its
    path, the `judge_model` the run's config names. The policy's `vllm_extra_args` are not passed (they size the
    policy's server).

    Raises:
        ValueError: the run serves no judge.
    """
    model = config.rewards.judge_model_name_or_path
    if model is None:
        raise ValueError(
            "judge_model_name_or_path is not set: the run serves no judge. Fix: set it, or drop the judge."
        )
    return image_server_command(
        config, settings, model, weight_transfer_backend=None, tensor_parallel_size=settings.judge_gpus
    )


def build_judge_deployment(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """The judge's vLLM Deployment `<run>-judge` (`judge_replicas` pods, `judge_gpus` GPUs each, the vLLM image;
    `k8s_served.build_served_deployment`): non-root with a read-only root, no ServiceAccount token, /dev/shm, probes
    on /health, the model read from the workspace volume (read-only), and only the judge's own token (as
    VLLM_API_KEY, which vLLM and the middleware check). No MLflow, hub or policy-vLLM credentials.

    Raises:
        ValueError: the run serves no judge.
    """
    served = ServedModel(
        component=JUDGE,
        command=judge_command(config, settings),
        token_key=JUDGE_TOKEN_KEY,
        replicas=settings.judge_replicas,
        gpus=settings.judge_gpus,
        cpu=settings.judge_cpu,
        memory_gib=settings.judge_memory_gib,
    )
    return build_served_deployment(config, settings, run_name, served, owner)


def build_judge_service(settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None) -> Manifest:
    """ClusterIP Service `<run>-judge` in front of the judge pods (requests spread over `judge_replicas`)."""
    return build_served_service(settings, run_name, JUDGE, owner)


def is_judge_service(obj: Manifest, run_name: str) -> bool:
    """True for the run's judge Service (`build_judge_service`)."""
    return obj["kind"] == "Service" and obj["metadata"]["name"] == f"{run_name}-{JUDGE}"


def add_judge_host_alias(deployment: Manifest, run_name: str, settings: ClusterSettings, cluster_ip: str) -> None:
    """Map the judge Service's DNS name to `cluster_ip` in the pods of `deployment` (their `hostAliases`), so pods
    that may not resolve DNS (the reward pods) reach the judge by the name in `judge_url`.

    Raises:
        ValueError: `cluster_ip` is empty (the Service has no cluster IP).
    """
    if not cluster_ip or cluster_ip == "None":
        raise ValueError(f"the judge Service of run {run_name} has no cluster IP. Fix: it must not be headless.")
    spec = deployment["spec"]["template"]["spec"]
    spec["hostAliases"] = [{"ip": cluster_ip, "hostnames": [judge_host(run_name, settings)]}]
