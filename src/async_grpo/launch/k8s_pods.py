"""The parts every pod of a run is made of: names and labels, security contexts, volumes, env, resources.

Kept apart from the workload builders (`k8s_objects.py`) and the network rules (`k8s_network.py`) so
that each security property (non-root, read-only root, no token, which secret reaches which pod) is
decided in exactly one function here and every pod gets it the same way.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.distillation import TEACHER_API_KEY_ENV  # noqa: F401 - re-exported
from async_grpo.inference.server import build_server_command
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.naming import DNS_LABEL  # noqa: F401 - re-exported
from async_grpo.rewards.judge import API_KEY_ENV as JUDGE_API_KEY_ENV  # noqa: F401 - re-exported
from async_grpo.rewards.wire import AUTH_TOKEN_ENV, REWARD_URL_ENV  # noqa: F401 - REWARD_URL_ENV re-exported
from async_grpo.step_secrets import MLFLOW_CREDENTIAL_KEYS

Manifest = dict[str, Any]

PART_OF = "async-grpo"
RUN_LABEL = "async-grpo/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
PYTORCH_CONTAINER = "pytorch"  # the Training Operator requires this container name
CONFIG_DIR = "/etc/async-grpo"
CONFIG_FILE = "config.yaml"
CACHE_DIR = "/cache"  # HOME and every framework cache (the root filesystem is read-only)
TINY_MODEL_DIR = "/models/tiny"
REWARD_SERVER_MODULE = "async_grpo.rewards.server"
REWARD_TOKEN_ENV = AUTH_TOKEN_ENV  # the reward service's bearer token (server checks it, client sends it)
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable: its middleware guards /v1, ours the dev-mode routes
VLLM_AUTH_MIDDLEWARE = "async_grpo.inference.auth.BearerTokenMiddleware"  # guards every vLLM route but /health


def image_server_command(
    config: GRPOConfig,
    settings: ClusterSettings,
    model: str,
    *,
    weight_transfer_backend: str | None,
    tensor_parallel_size: int = 1,
) -> list[str]:
    """A vLLM server command inside the vLLM image: `build_server_command`'s flags with this machine's interpreter
    and CPU-build detection replaced by the target's (python3; the CPU flags on cpu), `--tensor-parallel-size` when
    above 1 on gpu, and the bearer-token middleware (vLLM's own --api-key guards only /v1). Shared by the policy's
    server (`k8s_objects.vllm_command`), the run's LLM judge (`k8s_judge.judge_command`) and its distillation teacher
    (`k8s_teacher.teacher_command`), all at the run's vllm_max_model_len."""
    cmd = build_server_command(
        model,
        port=settings.vllm_port,
        host="0.0.0.0",
        dtype=config.inference.vllm_dtype,
        max_model_len=config.inference.vllm_max_model_len,
        weight_transfer_backend=weight_transfer_backend,
        seed=config.seed,
        cpu=settings.device == "cpu",
    )
    cmd = ["python3"] + cmd[1:]
    if settings.device == "gpu" and tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return cmd + ["--middleware", VLLM_AUTH_MIDDLEWARE]


def literal(values: list[str]) -> list[str]:
    """`values` escaped for a container's `command`, `args` or an env `value`, so Kubernetes passes them as written.

    The kubelet expands `$(NAME)` there to the container's variable NAME (`VLLM_API_KEY` from the run's Secret, say)
    and reduces `$$` to `$` ("Define Dependent Environment Variables", Kubernetes docs; `third_party/forked/golang/
    expansion`). A submitter's string that reaches one of those fields (`vllm_extra_args`, a model path, an
    `nccl_env` value) would otherwise pull a credential into a process's arguments, and from there into its error
    messages and the pod log: `--kv-cache-dtype=$(VLLM_API_KEY)`. Every `$` is doubled, so the process receives
    exactly `values`. Not for files (a ConfigMap key is never expanded): `from_literal` undoes it.

    Args:
        values: the strings as the process must receive them.

    Returns:
        The strings to write into the manifest, one per value.
    """
    return [value.replace("$", "$$") for value in values]


def from_literal(values: list[str]) -> list[str]:
    """The strings a process receives from manifest fields written by `literal` (every `$$` back to `$`)."""
    return [value.replace("$$", "$") for value in values]


PROBE_PERIOD_S = 10
POD_IP_ENV = "POD_IP"  # the trainer's address for the weight-transfer rendezvous (vLLM workers dial it)
TOKENS_SECRET_SUFFIX = "-tokens"
VLLM_TOKEN_KEY, REWARD_TOKEN_KEY = "vllm-api-key", "reward-token"
JUDGE_TOKEN_KEY = "judge-api-key"  # in the tokens Secret only when the run serves an LLM judge
TEACHER_TOKEN_KEY = "teacher-api-key"  # in the tokens Secret only when the run serves a distillation teacher
# Keys of the MLflow secret that reach the trainer (each optional); nothing else in that secret does.
MLFLOW_SECRET_KEYS = MLFLOW_CREDENTIAL_KEYS  # the pipeline steps read the same keys (`async_grpo.step_secrets`)


# ------------------------------------------------------------------------------------------------ naming
def labels(run_name: str, component: str) -> dict[str, str]:
    """Labels of every object of the run (`async-grpo/run` ties them together; cleanup selects on it)."""
    return {
        "app.kubernetes.io/part-of": PART_OF,
        MANAGED_BY_LABEL: PART_OF,
        COMPONENT_LABEL: component,
        RUN_LABEL: run_name,
    }


def run_selector(run_name: str) -> str:
    """The label selector (string form) of every object a launch of `run_name` creates."""
    return f"{RUN_LABEL}={run_name},{MANAGED_BY_LABEL}={PART_OF}"


def selector(run_name: str, component: str) -> dict[str, str]:
    """The pod selector of one component of one run."""
    return {RUN_LABEL: run_name, COMPONENT_LABEL: component}


def jobset_host(run_name: str, replicated_job: str, settings: ClusterSettings) -> str:
    """The stable DNS name of the first pod of `replicated_job` in the run's JobSet (trainer_api trainjob).

    JobSet names each pod `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>` under the headless Service
    `<subdomain>` (default: the JobSet's name, which Trainer v2 sets to the TrainJob's, i.e. the run's).
    """
    return f"{run_name}-{replicated_job}-0-0.{run_name}.{settings.namespace}.svc.cluster.local"


def vllm_url(run_name: str, settings: ClusterSettings) -> str:
    """Base URL of the run's vLLM server: its headless Service (resolves to the pod IP), or with trainer_api
    trainjob the JobSet hostname of the `vllm` replicated job's pod."""
    if settings.trainer_api == "trainjob":
        return f"http://{jobset_host(run_name, 'vllm', settings)}:{settings.vllm_port}"
    return f"http://{run_name}-vllm.{settings.namespace}.svc.cluster.local:{settings.vllm_port}"


def reward_url(run_name: str, settings: ClusterSettings, component: str = "reward") -> str:
    """Base URL of the run's reward service (`component` "eval-reward": the evaluate step's own, always a
    Service); with trainer_api trainjob the run's own is the JobSet hostname of the `reward` replicated job."""
    if settings.trainer_api == "trainjob" and component == "reward":
        return f"http://{jobset_host(run_name, 'reward', settings)}:{settings.reward_port}"
    return f"http://{run_name}-{component}.{settings.namespace}.svc.cluster.local:{settings.reward_port}"


def owner_reference(job: Manifest) -> dict[str, Any]:
    """An ownerReference to a created object (needs `metadata.uid`), so deleting it deletes the owned ones.

    Raises:
        KeyError: `job` has no `metadata.uid` (it was not returned by the API server).
    """
    api = job.get("apiVersion", f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}")
    return {
        "apiVersion": api,
        "kind": job.get("kind", "PyTorchJob"),
        "name": job["metadata"]["name"],
        "uid": job["metadata"]["uid"],
    }


def meta(
    name: str, run_name: str, component: str, settings: ClusterSettings, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """`metadata` of a run object: name, namespace, the run's labels, and the ownerReference if any."""
    out: dict[str, Any] = {"name": name, "namespace": settings.namespace, "labels": labels(run_name, component)}
    if owner is not None:
        out["ownerReferences"] = [owner]
    return out


# ------------------------------------------------------------------------------------------------ tokens
@dataclass(frozen=True)
class RunTokens:
    """The run's bearer tokens, kept in Secret `<run>-tokens` (a second layer under the NetworkPolicies).

    Attributes:
        vllm_api_key: guards every vLLM route but /health (vLLM's VLLM_API_KEY plus our dev-mode middleware).
        reward_token: guards the reward service's scoring routes.
        judge_api_key: guards the LLM judge's vLLM server (only used when the run serves one); a fresh random
            token unless given.
        teacher_api_key: guards the distillation teacher's vLLM server (only used when the run serves one); a fresh
            random token unless given.
    """

    vllm_api_key: str
    reward_token: str
    judge_api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    teacher_api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @classmethod
    def generate(cls) -> RunTokens:
        """Four fresh random tokens (256 bits each, URL-safe)."""
        return cls(*(secrets.token_urlsafe(32) for _ in range(4)))


def tokens_secret_name(run_name: str) -> str:
    """Name of the Secret holding a run's tokens."""
    return f"{run_name}{TOKENS_SECRET_SUFFIX}"


def build_tokens_secret(
    settings: ClusterSettings,
    run_name: str,
    tokens: RunTokens,
    *,
    component: str = "tokens",
    owner: dict[str, Any] | None = None,
    judge: bool = False,
    teacher: bool = False,
) -> Manifest:
    """Secret `<run>-<component>` (`<run>-tokens` for the run itself) holding the bearer tokens; with `judge` also
    the LLM judge's (key JUDGE_TOKEN_KEY), with `teacher` the distillation teacher's (key TEACHER_TOKEN_KEY)."""
    data = {VLLM_TOKEN_KEY: tokens.vllm_api_key, REWARD_TOKEN_KEY: tokens.reward_token}
    if judge:
        data[JUDGE_TOKEN_KEY] = tokens.judge_api_key
    if teacher:
        data[TEACHER_TOKEN_KEY] = tokens.teacher_api_key
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta(f"{run_name}-{component}", run_name, component, settings, owner),
        "stringData": data,
    }


def token_env(secret_name: str, *keys: tuple[str, str]) -> list[dict[str, Any]]:
    """Env entries `name <- secret key` for (env name, key) pairs; the key must exist (optional: false)."""
    return [{"name": env, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}} for env, key in keys]


# ------------------------------------------------------------------------------------------------ pod parts
def pod_security(settings: ClusterSettings) -> dict[str, Any]:
    """Pod securityContext: non-root UID/GID, RuntimeDefault seccomp, the weight-transfer ephemeral range."""
    lo, hi = settings.weight_transfer_ports
    uid = settings.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
        "sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": f"{lo} {hi}"}],
    }


def container_security() -> dict[str, Any]:
    """Container securityContext: no escalation, read-only root filesystem, every capability dropped."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_volumes(settings: ClusterSettings, shm: bool) -> tuple[list[dict], list[dict]]:
    """emptyDirs for /tmp and the caches (and /dev/shm, `shm_size_gib` GiB): the root filesystem stays
    read-only. Returns (volumes, volumeMounts)."""
    vols = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    if shm:
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{settings.shm_size_gib}Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return vols, mounts


def base_env() -> list[dict[str, Any]]:
    """HOME and every JIT/framework cache on the writable /cache emptyDir (numba, triton and inductor
    otherwise try to write next to their sources or under ~); no hub access (models live on the PVC); no user
    site directory (PYTHONNOUSERSITE: `.pth` files under HOME never run at start-up, also in an image that forgot
    to set it)."""
    env = {
        "PYTHONNOUSERSITE": "1",
        "HOME": CACHE_DIR,
        "XDG_CACHE_HOME": CACHE_DIR,
        "HF_HOME": f"{CACHE_DIR}/huggingface",
        "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
        "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/inductor",
        "NUMBA_CACHE_DIR": f"{CACHE_DIR}/numba",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
    }
    return [{"name": k, "value": v} for k, v in env.items()]


def nccl_env(settings: ClusterSettings) -> list[dict[str, Any]]:
    """The NCCL/gloo socket interface and the settings' extra NCCL_* variables (values `literal`: the submitter's)."""
    env = {
        "NCCL_SOCKET_IFNAME": settings.nccl_socket_ifname,
        "GLOO_SOCKET_IFNAME": settings.nccl_socket_ifname,
        "NCCL_DEBUG": "WARN",
        **settings.nccl_env,
    }
    return [{"name": k, "value": v} for k, v in zip(env, literal(list(env.values())), strict=True)]


def trainer_threads_env(settings: ClusterSettings) -> list[dict[str, Any]]:
    """OMP_NUM_THREADS for a trainer container on a CPU cluster: its CPU request (`trainer_cpu`) per trainer process
    (`nproc_per_node`), rounded up, read from the pod by Kubernetes' downward API (`resourceFieldRef` requests.cpu,
    divisor nproc_per_node). GPU clusters: nothing (torchrun's own default of 1 per process beside several).

    Without it, torch starts one OpenMP thread per core the node has (the affinity mask of a pod without the static
    CPU manager is the whole node), beside other tenants' pods: every core is then a cliff, because OpenMP's threads
    wait at every operation for the one that shares its core (on 2 cores beside one nice-19 busy loop a trainer
    step took 10x its quiet time; docs/performance.md, "A busy machine"). A run's `torch_num_threads` still
    overrides it (`torch.set_num_threads`).
    """
    if settings.device != "cpu":
        return []
    divisor = str(settings.nproc_per_node)
    return [
        {
            "name": "OMP_NUM_THREADS",
            "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": divisor}},
        }
    ]


def resources(cpu: float, memory_gib: int, gpus: int, settings: ClusterSettings) -> dict[str, Any]:
    """Requests and limits: `cpu` cores, `memory_gib` GiB (limit = request), `gpus` GPUs on gpu clusters."""
    requests: dict[str, Any] = {"cpu": f"{cpu:g}", "memory": f"{memory_gib}Gi"}
    limits: dict[str, Any] = {"memory": f"{memory_gib}Gi"}
    if gpus and settings.device == "gpu":
        requests[settings.gpu_resource] = gpus
        limits[settings.gpu_resource] = gpus
    return {"requests": requests, "limits": limits}


def pod_spec(
    settings: ClusterSettings,
    containers: list[dict],
    volumes: list[dict],
    *,
    init_containers: list[dict] | None = None,
    compute: bool = True,
    restart_policy: str | None = None,
) -> dict[str, Any]:
    """A run pod's spec: the workload ServiceAccount with no token mounted, no service links, the pod
    securityContext, the settings' PriorityClass if any, and (for `compute` pods) the node selector and
    tolerations."""
    spec: dict[str, Any] = {
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(settings),
        "containers": containers,
        "volumes": volumes,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if settings.priority_class_name:
        spec["priorityClassName"] = settings.priority_class_name
    if compute and settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if compute and settings.tolerations:
        spec["tolerations"] = [dict(t) for t in settings.tolerations]
    return spec


def template(run_name: str, component: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A pod template with the run's labels; Istio sidecars are kept out (they keep PyTorchJob pods from
    ever completing and sit in the NCCL path)."""
    return {
        "metadata": {"labels": labels(run_name, component), "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": spec,
    }


def data_volume(settings: ClusterSettings, read_only: bool) -> tuple[dict, dict]:
    """The shared workspace PVC and its mount at `data_mount_path` (read-only where code is loaded)."""
    return (
        {"name": "data", "persistentVolumeClaim": {"claimName": settings.pvc_name, "readOnly": read_only}},
        {"name": "data", "mountPath": settings.data_mount_path, "readOnly": read_only},
    )


def mlflow_secret_env(settings: ClusterSettings) -> list[dict[str, Any]]:
    """The MLflow credentials of the trainer: only MLFLOW_SECRET_KEYS of `mlflow_secret`, each optional
    (never the whole secret as envFrom)."""
    if not settings.mlflow_secret:
        return []
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": settings.mlflow_secret, "key": key, "optional": True}}}
        for key in MLFLOW_SECRET_KEYS
    ]


def vllm_probes(startup_timeout_s: float) -> dict[str, Any]:
    """A vLLM container's probes, all on /health (the one route answered without the token): readiness every
    5 s, a startup probe allowing `startup_timeout_s` seconds to load the model, liveness once started."""
    startup_failures = max(1, math.ceil(startup_timeout_s / PROBE_PERIOD_S))
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "startupProbe": {**health, "periodSeconds": PROBE_PERIOD_S, "failureThreshold": startup_failures},
        "livenessProbe": {**health, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5, "failureThreshold": 6},
    }
