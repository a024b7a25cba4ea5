"""A model a Kubernetes run serves beside its policy, for one client: the LLM judge (`k8s_judge`) and the distillation
teacher (`k8s_teacher`). Each is a plain vLLM Deployment behind a ClusterIP Service `<run>-<component>`, cut from the
same pod parts as the policy's server, and differs only in its model, its sizes, its length and its token.

A served model is a plain server: no dev-mode control plane, no weight transfer (its weights never change), the
bearer-token middleware on every route but /health, its own token (a key of the run's tokens Secret) and no other
credential. Its NetworkPolicy (`k8s_network.served_model_policy`) admits only the pods that ask it and gives it no
egress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.inference.server import CPU_SERVER_ENV
from async_grpo.launch.k8s_pods import (
    CACHE_DIR,
    VLLM_API_KEY_ENV,
    Manifest,
    base_env,
    container_security,
    data_volume,
    literal,
    meta,
    pod_spec,
    resources,
    scratch_volumes,
    selector,
    template,
    token_env,
    tokens_secret_name,
    vllm_probes,
)
from async_grpo.launch.k8s_settings import ClusterSettings


@dataclass(frozen=True)
class ServedModel:
    """What tells one served model's Deployment from another's.

    Attributes:
        component: component label, container name and object-name suffix ("judge", "teacher").
        command: the server's command in the vLLM image (`k8s_pods.image_server_command`), as the process gets it.
        token_key: key of the run's tokens Secret holding its bearer token (given to vLLM as VLLM_API_KEY).
        replicas: pods of the Deployment.
        gpus: GPUs per pod (on gpu clusters).
        cpu: CPU cores requested per pod.
        memory_gib: memory per pod (GiB, limit = request).
    """

    component: str
    command: list[str]
    token_key: str
    replicas: int
    gpus: int
    cpu: float
    memory_gib: int


def served_host(run_name: str, settings: ClusterSettings, component: str) -> str:
    """The in-cluster DNS name of the Service `<run>-<component>`."""
    return f"{run_name}-{component}.{settings.namespace}.svc.cluster.local"


def served_base_url(run_name: str, settings: ClusterSettings, component: str) -> str:
    """The served model's base URL without /v1 (its /health answers without the token)."""
    return f"http://{served_host(run_name, settings, component)}:{settings.vllm_port}"


def build_served_deployment(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    served: ServedModel,
    owner: dict[str, Any] | None = None,
) -> Manifest:
    """The served model's vLLM Deployment `<run>-<component>` (`served.replicas` pods, `served.gpus` GPUs each, the
    vLLM image): non-root with a read-only root, no ServiceAccount token, /dev/shm, probes on /health, the model
    read from the workspace volume (read-only), and only its own token (as VLLM_API_KEY, which vLLM and the
    middleware check). No MLflow, hub or policy-vLLM credentials."""
    vols, mounts = scratch_volumes(settings, shm=True)
    data_vol, data_mount = data_volume(settings, read_only=True)
    vols.append(data_vol)
    mounts.append(data_mount)
    env = (
        base_env()
        + [
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        ]
        + token_env(tokens_secret_name(run_name), (VLLM_API_KEY_ENV, served.token_key))
    )
    if settings.device == "cpu":
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(config.inference.vllm_kv_cache_gib)})
        env += [{"name": k, "value": v} for k, v in CPU_SERVER_ENV.items()]
    container = {
        "name": served.component,
        "image": settings.image("vllm"),
        "command": literal(served.command),  # the config's strings, unexpanded
        "env": env,
        "ports": [{"name": "http", "containerPort": settings.vllm_port, "protocol": "TCP"}],
        **vllm_probes(config.inference.vllm_startup_timeout_s),
        "resources": resources(served.cpu, served.memory_gib, served.gpus, settings),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    spec = pod_spec(settings, [container], vols)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(f"{run_name}-{served.component}", run_name, served.component, settings, owner),
        "spec": {
            "replicas": served.replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(run_name, served.component)},
            "template": template(run_name, served.component, spec),
        },
    }


def build_served_service(
    settings: ClusterSettings, run_name: str, component: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """ClusterIP Service `<run>-<component>` in front of a served model's pods (requests spread over its replicas)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(f"{run_name}-{component}", run_name, component, settings, owner),
        "spec": {
            "selector": selector(run_name, component),
            "ports": [{"name": "http", "port": settings.vllm_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
