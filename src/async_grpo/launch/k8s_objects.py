"""Every Kubernetes object one run needs, built in one place as plain dicts from a `GRPOConfig`.

The builders are pure functions (config + `ClusterSettings` in, manifests out), so the same code
feeds the `kubernetes` launch backend, `async-grpo render` and the committed example manifests, and
tests can validate the output against the Kubernetes and Training Operator schemas offline.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import yaml

from async_grpo.config import GRPOConfig
from async_grpo.inference.server import build_server_command
from async_grpo.launch.k8s_settings import ClusterSettings

Manifest = dict[str, Any]

PART_OF = "async-grpo"
RUN_LABEL = "async-grpo/run"
COMPONENT_LABEL = "app.kubernetes.io/component"
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
PYTORCH_CONTAINER = "pytorch"  # the Training Operator requires this container name
CONFIG_DIR = "/etc/async-grpo"
CONFIG_FILE = "config.yaml"
CACHE_DIR = "/cache"  # HOME and every framework cache (the root filesystem is read-only)
TINY_MODEL_DIR = "/models/tiny"
REWARD_SERVER_MODULE = "async_grpo.rewards.server"
REWARD_URL_ENV = "ASYNC_GRPO_REWARD_URL"
POD_IP_ENV = "POD_IP"  # the trainer's address for the weight-transfer rendezvous (vLLM workers dial it)
VLLM_REPLICAS = 1  # the trainer pushes weights into exactly one server
PROBE_PERIOD_S = 10
DNS_LABEL = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"  # run names leave room for suffixes within 63 chars

# Polls vLLM's /v1/models until it answers 200 or the deadline passes (argv: base URL, timeout s).
WAIT_FOR_VLLM_PY = """\
import sys, time, urllib.request
url, timeout_s = sys.argv[1].rstrip("/") + "/v1/models", float(sys.argv[2])
deadline, err = time.monotonic() + timeout_s, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception as e:
        err = e
    time.sleep(5)
sys.exit(f"vLLM not ready at {url} after {timeout_s:.0f} s: {err}")
"""


# ------------------------------------------------------------------------------------------------ naming
def labels(run_name: str, component: str) -> dict[str, str]:
    """Labels of every object of the run (`async-grpo/run` ties them together for `kubectl delete -l`)."""
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": PART_OF,
            COMPONENT_LABEL: component, RUN_LABEL: run_name}


def selector(run_name: str, component: str) -> dict[str, str]:
    """The pod selector of one component of one run."""
    return {RUN_LABEL: run_name, COMPONENT_LABEL: component}


def vllm_url(run_name: str, settings: ClusterSettings) -> str:
    """Base URL of the run's vLLM server through its headless Service (resolves to the pod IP)."""
    return f"http://{run_name}-vllm.{settings.namespace}.svc.cluster.local:{settings.vllm_port}"


def reward_url(run_name: str, settings: ClusterSettings) -> str:
    """Base URL of the run's reward service."""
    return f"http://{run_name}-reward.{settings.namespace}.svc.cluster.local:{settings.reward_port}"


def run_output_dir(config: GRPOConfig, settings: ClusterSettings, run_name: str) -> str:
    """The run folder on the shared PVC: the config's `output_dir` when it already lies on the volume
    (the pipeline sets `<work_dir>/<run>`), else `<mount>/runs/<run>`."""
    mount = settings.data_mount_path.rstrip("/")
    if config.output_dir.startswith(f"{mount}/"):
        return config.output_dir
    return f"{mount}/runs/{run_name}"


def tracking_uri(config: GRPOConfig, settings: ClusterSettings) -> str:
    """The MLflow URI the trainer logs to: the config's when set, else the cluster's."""
    return config.mlflow_tracking_uri or settings.mlflow_tracking_uri


def owner_reference(job: Manifest) -> dict[str, Any]:
    """An ownerReference to a created PyTorchJob (needs `metadata.uid`), so deleting it deletes the rest.

    Raises:
        KeyError: `job` has no `metadata.uid` (it was not returned by the API server).
    """
    return {"apiVersion": f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}", "kind": "PyTorchJob",
            "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}


def _meta(name: str, run_name: str, component: str, settings: ClusterSettings,
          owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": settings.namespace, "labels": labels(run_name, component)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


# ------------------------------------------------------------------------------------------------ pod parts
def _pod_security(settings: ClusterSettings) -> dict[str, Any]:
    lo, hi = settings.weight_transfer_ports
    uid = settings.run_as_user
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
            "sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": f"{lo} {hi}"}]}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _scratch_volumes(settings: ClusterSettings, shm: bool) -> tuple[list[dict], list[dict]]:
    """emptyDirs for /tmp and the caches (and /dev/shm): the root filesystem stays read-only."""
    vols = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    if shm:
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{settings.shm_size_gib}Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return vols, mounts


def _base_env() -> list[dict[str, Any]]:
    """HOME and every JIT/framework cache on the writable /cache emptyDir (numba, triton and inductor
    otherwise try to write next to their sources or under ~)."""
    env = {"HOME": CACHE_DIR, "XDG_CACHE_HOME": CACHE_DIR, "HF_HOME": f"{CACHE_DIR}/huggingface",
           "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/inductor",
           "NUMBA_CACHE_DIR": f"{CACHE_DIR}/numba", "PYTHONUNBUFFERED": "1"}
    return [{"name": k, "value": v} for k, v in env.items()]


def _nccl_env(settings: ClusterSettings) -> list[dict[str, Any]]:
    env = {"NCCL_SOCKET_IFNAME": settings.nccl_socket_ifname, "GLOO_SOCKET_IFNAME": settings.nccl_socket_ifname,
           "NCCL_DEBUG": "WARN", **settings.nccl_env}
    return [{"name": k, "value": v} for k, v in env.items()]


def _resources(cpu: float, memory_gib: int, gpus: int, settings: ClusterSettings) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": f"{cpu:g}", "memory": f"{memory_gib}Gi"}
    limits: dict[str, Any] = {"memory": f"{memory_gib}Gi"}
    if gpus and settings.device == "gpu":
        requests[settings.gpu_resource] = gpus
        limits[settings.gpu_resource] = gpus
    return {"requests": requests, "limits": limits}


def _pod_spec(settings: ClusterSettings, containers: list[dict], volumes: list[dict], *,
              init_containers: list[dict] | None = None, compute: bool = True,
              restart_policy: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"serviceAccountName": settings.service_account, "automountServiceAccountToken": False,
                            "enableServiceLinks": False, "securityContext": _pod_security(settings),
                            "containers": containers, "volumes": volumes}
    if init_containers:
        spec["initContainers"] = init_containers
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if compute and settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if compute and settings.tolerations:
        spec["tolerations"] = [dict(t) for t in settings.tolerations]
    return spec


def _template(run_name: str, component: str, spec: dict[str, Any]) -> dict[str, Any]:
    # Istio sidecars keep PyTorchJob pods from ever completing and sit in the NCCL path: keep them out.
    return {"metadata": {"labels": labels(run_name, component), "annotations": {"sidecar.istio.io/inject": "false"}},
            "spec": spec}


def _data_volume(settings: ClusterSettings, read_only: bool) -> tuple[dict, dict]:
    return ({"name": "data", "persistentVolumeClaim": {"claimName": settings.pvc_name, "readOnly": read_only}},
            {"name": "data", "mountPath": settings.data_mount_path, "readOnly": read_only})


def _secret_env(settings: ClusterSettings) -> tuple[list[dict], list[dict]]:
    env, env_from = [], []
    if settings.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": settings.hf_token_secret, "key": "HF_TOKEN", "optional": True}}})
    if settings.mlflow_secret:
        env_from.append({"secretRef": {"name": settings.mlflow_secret, "optional": True}})
    return env, env_from


# ------------------------------------------------------------------------------------------------ trainer side
def trainer_config(config: GRPOConfig, settings: ClusterSettings, run_name: str) -> GRPOConfig:
    """The run config as the trainer pod sees it: vLLM, MLflow and (with reward_replicas > 0) the reward service
    in the cluster, outputs on the PVC.

    Raises:
        ValueError: `model_name_or_path` is neither `builtin:tiny` nor an absolute path (on the PVC), or
            `reward_url` points elsewhere while the run starts its own reward service.
    """
    model = config.model_name_or_path
    if model != "builtin:tiny" and not model.startswith(settings.data_mount_path.rstrip("/") + "/"):
        raise ValueError(f"model_name_or_path={model!r}: on Kubernetes the model must be a folder on the shared "
                         f"volume. Fix: copy it onto PVC {settings.pvc_name!r} and set model_name_or_path="
                         f"{settings.data_mount_path}/models/<name>.")
    data = config.model_dump()
    if settings.reward_replicas:  # the run's own reward service scores the groups
        own = reward_url(run_name, settings)
        if config.reward_url and config.reward_url != own:
            raise ValueError(f"reward_url={config.reward_url!r} and reward_replicas={settings.reward_replicas}: the run "
                             "would start a reward service and score elsewhere. Fix: set reward_replicas=0 to use your "
                             "own service, or drop reward_url.")
        data["reward_url"] = own
    data.update(vllm_url=vllm_url(run_name, settings), mlflow_tracking_uri=tracking_uri(config, settings),
                output_dir=run_output_dir(config, settings, run_name), run_name=config.run_name or run_name,
                weight_sync_backend="nccl" if settings.device == "gpu" else "gloo")
    return GRPOConfig.model_validate(data)


def build_config_map(config: GRPOConfig, settings: ClusterSettings, run_name: str,
                     owner: dict[str, Any] | None = None) -> Manifest:
    """ConfigMap `<run>-config` with the trainer's config YAML (mounted at CONFIG_DIR). It holds only the
    fields that differ from their defaults; the trainer logs the fully resolved config to MLflow."""
    fields = trainer_config(config, settings, run_name).model_dump(mode="json", exclude_defaults=True)
    text = "# Fields that differ from GRPOConfig's defaults (`async-grpo train --help` lists all).\n"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{run_name}-config", run_name, "config",
                                                                       settings, owner),
            "data": {CONFIG_FILE: text + yaml.safe_dump(fields, sort_keys=False)}}


def _trainer_pod(config: GRPOConfig, settings: ClusterSettings, run_name: str,
                 mlflow_run_id: str | None) -> dict[str, Any]:
    vols, mounts = _scratch_volumes(settings, shm=True)
    data_vol, data_mount = _data_volume(settings, read_only=False)
    vols += [data_vol, {"name": "config", "configMap": {"name": f"{run_name}-config"}}]
    mounts += [data_mount, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    secret_env, env_from = _secret_env(settings)
    env = _base_env() + _nccl_env(settings) + secret_env + [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "MLFLOW_TRACKING_URI", "value": tracking_uri(config, settings)},
    ]
    if settings.reward_replicas:
        env.append({"name": REWARD_URL_ENV, "value": reward_url(run_name, settings)})
    if mlflow_run_id:
        env.append({"name": "MLFLOW_RUN_ID", "value": mlflow_run_id})  # the Tracker resumes this run
    gpus = settings.nproc_per_node if settings.device == "gpu" else 0
    container = {
        "name": PYTORCH_CONTAINER, "image": settings.image("trainer"),
        # torchrun reads --nnodes/--nproc-per-node/--node-rank/--master-* from the operator's PET_* env
        "command": ["torchrun", "--module", "async_grpo.cli", "train", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": env, "resources": _resources(settings.trainer_cpu, settings.trainer_memory_gib, gpus, settings),
        "volumeMounts": mounts, "securityContext": _container_security(),
    }
    if env_from:
        container["envFrom"] = env_from
    wait = {"name": "wait-for-vllm", "image": settings.image("trainer"),
            "command": ["python", "-c", WAIT_FOR_VLLM_PY, vllm_url(run_name, settings),
                        f"{config.vllm_startup_timeout_s:g}"],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "securityContext": _container_security()}
    spec = _pod_spec(settings, [container], vols, init_containers=[wait])
    return _template(run_name, "trainer", spec)


def build_pytorchjob(config: GRPOConfig, settings: ClusterSettings, run_name: str,
                     mlflow_run_id: str | None = None) -> Manifest:
    """The trainer as a Training Operator v1 PyTorchJob: one Master plus `trainer_nodes - 1` Workers.

    Args:
        mlflow_run_id: an MLflow run created beforehand; the trainer logs into it (env MLFLOW_RUN_ID).
    """
    pod = _trainer_pod(config, settings, run_name, mlflow_run_id)
    replicas = {"Master": {"replicas": 1, "restartPolicy": settings.restart_policy, "template": pod}}
    if settings.trainer_nodes > 1:
        replicas["Worker"] = {"replicas": settings.trainer_nodes - 1, "restartPolicy": settings.restart_policy,
                              "template": copy.deepcopy(pod)}
    return {"apiVersion": f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}", "kind": "PyTorchJob",
            "metadata": _meta(run_name, run_name, "trainer", settings, None),
            "spec": {"nprocPerNode": str(settings.nproc_per_node),
                     "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0,
                                   "ttlSecondsAfterFinished": settings.ttl_after_finished_s},
                     "pytorchReplicaSpecs": replicas}}


# ------------------------------------------------------------------------------------------------ vLLM
def vllm_command(config: GRPOConfig, settings: ClusterSettings, model_path: str) -> list[str]:
    """The server command inside the vLLM image: `build_server_command`'s flags, with this machine's
    interpreter and CPU-build detection replaced by the target's (python3; --enforce-eager on cpu)."""
    backend = "nccl" if settings.device == "gpu" else "gloo"
    cmd = build_server_command(model_path, port=settings.vllm_port, host="0.0.0.0", dtype=config.vllm_dtype,
                               max_model_len=config.vllm_max_model_len, weight_transfer_backend=backend,
                               seed=config.seed)
    cmd = ["python3"] + [arg for arg in cmd[1:] if arg != "--enforce-eager"]
    if settings.device == "cpu":
        cmd.append("--enforce-eager")
    if settings.device == "gpu" and settings.vllm_gpus > 1:
        cmd += ["--tensor-parallel-size", str(settings.vllm_gpus)]
    return cmd + list(config.vllm_extra_args)


def build_vllm_deployment(config: GRPOConfig, settings: ClusterSettings, run_name: str,
                          owner: dict[str, Any] | None = None) -> Manifest:
    """vLLM server Deployment: dev-mode control plane, processed logprobs, readiness on /v1/models."""
    vols, mounts = _scratch_volumes(settings, shm=True)
    init = []
    if config.model_name_or_path == "builtin:tiny":  # built in the pod; the trainer pushes its own weights at v0
        model_path = TINY_MODEL_DIR
        vols.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": TINY_MODEL_DIR.rsplit("/", 1)[0]})
        init.append({"name": "make-tiny-model", "image": settings.image("trainer"),
                     "command": ["async-grpo", "make-tiny-model", TINY_MODEL_DIR, "--seed", str(config.seed)],
                     "env": _base_env(), "volumeMounts": list(mounts),
                     "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                     "securityContext": _container_security()})
    else:
        model_path = trainer_config(config, settings, run_name).model_name_or_path
        data_vol, data_mount = _data_volume(settings, read_only=True)
        vols.append(data_vol)
        mounts.append(data_mount)
    env = _base_env() + _nccl_env(settings) + [
        {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"}, {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"}, {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
    ]
    if settings.device == "cpu":
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(config.vllm_kv_cache_gib)})
    startup_failures = max(1, math.ceil(config.vllm_startup_timeout_s / PROBE_PERIOD_S))
    container = {
        "name": "vllm", "image": settings.image("vllm"), "command": vllm_command(config, settings, model_path),
        "env": env, "ports": [{"name": "http", "containerPort": settings.vllm_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S,
                         "failureThreshold": startup_failures},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S,
                          "timeoutSeconds": 5, "failureThreshold": 6},
        "resources": _resources(settings.vllm_cpu, settings.vllm_memory_gib, settings.vllm_gpus, settings),
        "volumeMounts": mounts, "securityContext": _container_security(),
    }
    spec = _pod_spec(settings, [container], vols, init_containers=init)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(f"{run_name}-vllm", run_name, "vllm", settings, owner),
            "spec": {"replicas": VLLM_REPLICAS, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": selector(run_name, "vllm")},
                     "template": _template(run_name, "vllm", spec)}}


def build_vllm_service(settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None) -> Manifest:
    """Headless Service `<run>-vllm`: its DNS name resolves straight to the vLLM pod IP."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(f"{run_name}-vllm", run_name, "vllm",
                                                                     settings, owner),
            "spec": {"clusterIP": "None", "selector": selector(run_name, "vllm"),
                     "ports": [{"name": "http", "port": settings.vllm_port, "targetPort": "http", "protocol": "TCP"}]}}


# ------------------------------------------------------------------------------------------------ rewards
def build_reward_deployment(config: GRPOConfig, settings: ClusterSettings, run_name: str,
                            owner: dict[str, Any] | None = None) -> Manifest:
    """Reward-worker Deployment serving the run's reward functions over HTTP (`REWARD_SERVER_MODULE`).

    The shared volume is mounted read-only when a reward function is a file (`/workspace/rewards/x.py:fn`)."""
    vols, mounts = _scratch_volumes(settings, shm=False)
    vols.append({"name": "config", "configMap": {"name": f"{run_name}-config"}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    if any(spec.rsplit(":", 1)[0].endswith(".py") for spec in config.reward_funcs):
        data_vol, data_mount = _data_volume(settings, read_only=True)
        vols.append(data_vol)
        mounts.append(data_mount)
    container = {
        "name": "reward", "image": settings.image("reward"),
        "command": ["python", "-m", REWARD_SERVER_MODULE, "--config", f"{CONFIG_DIR}/{CONFIG_FILE}",
                    "--host", "0.0.0.0", "--port", str(settings.reward_port),
                    "--num-workers", str(config.reward_num_workers)],
        "env": _base_env(), "ports": [{"name": "http", "containerPort": settings.reward_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "resources": _resources(settings.reward_cpu, settings.reward_memory_gib, 0, settings),
        "volumeMounts": mounts, "securityContext": _container_security(),
    }
    spec = _pod_spec(settings, [container], vols, compute=False)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(f"{run_name}-reward", run_name, "reward", settings, owner),
            "spec": {"replicas": settings.reward_replicas, "selector": {"matchLabels": selector(run_name, "reward")},
                     "template": _template(run_name, "reward", spec)}}


def build_reward_service(settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None) -> Manifest:
    """ClusterIP Service `<run>-reward` in front of the reward workers."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(f"{run_name}-reward", run_name, "reward",
                                                                     settings, owner),
            "spec": {"selector": selector(run_name, "reward"),
                     "ports": [{"name": "http", "port": settings.reward_port, "targetPort": "http",
                                "protocol": "TCP"}]}}


# ------------------------------------------------------------------------------------------------ network
def build_network_policies(settings: ClusterSettings, run_name: str,
                           owner: dict[str, Any] | None = None) -> list[Manifest]:
    """Ingress rules of the run. vLLM's dev-mode endpoints load weights, so only this run's trainer pods
    reach vLLM (HTTP port + weight-transfer range); the reward service admits only the trainer; trainer
    pods admit each other (torchrun, NCCL) and vLLM's weight-transfer connections back to rank 0."""
    lo, hi = settings.weight_transfer_ports
    wt_ports = {"protocol": "TCP", "port": lo, "endPort": hi}
    trainer_peer = {"podSelector": {"matchLabels": selector(run_name, "trainer")}}
    vllm_peer = {"podSelector": {"matchLabels": selector(run_name, "vllm")}}

    def policy(component: str, ingress: list[dict]) -> Manifest:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(f"{run_name}-{component}", run_name, component, settings, owner),
                "spec": {"podSelector": {"matchLabels": selector(run_name, component)}, "policyTypes": ["Ingress"],
                         "ingress": ingress}}

    policies = [
        policy("vllm", [{"from": [trainer_peer],
                         "ports": [{"protocol": "TCP", "port": settings.vllm_port}, wt_ports]}]),
        policy("trainer", [{"from": [trainer_peer]}, {"from": [vllm_peer], "ports": [wt_ports]}]),
    ]
    if settings.reward_replicas:
        policies.append(policy("reward", [{"from": [trainer_peer],
                                           "ports": [{"protocol": "TCP", "port": settings.reward_port}]}]))
    return policies


# ------------------------------------------------------------------------------------------------ all of it
def build_run_objects(config: GRPOConfig, settings: ClusterSettings, run_name: str, *,
                      mlflow_run_id: str | None = None, owner: dict[str, Any] | None = None) -> list[Manifest]:
    """Every object of one run, in creation order: ConfigMap, PyTorchJob, NetworkPolicies, reward
    Deployment + Service, vLLM Service + Deployment (policies exist before the pods they guard).

    Args:
        run_name: DNS-1123 label of at most 40 characters; every object name derives from it.
        mlflow_run_id: passed to the trainer (it logs into that run).
        owner: ownerReference put on every object but the PyTorchJob (see `owner_reference`).

    Raises:
        ValueError: bad run name, or a model path the cluster cannot see (see `trainer_config`).
    """
    if not re.match(DNS_LABEL, run_name):
        raise ValueError(f"run name {run_name!r} is not a DNS-1123 label of at most 40 characters "
                         "(lowercase letters, digits, '-', starting with a letter). Fix: rename it.")
    objs = [build_config_map(config, settings, run_name, owner), build_pytorchjob(config, settings, run_name,
                                                                                  mlflow_run_id)]
    objs += build_network_policies(settings, run_name, owner)
    if settings.reward_replicas:
        objs += [build_reward_deployment(config, settings, run_name, owner),
                 build_reward_service(settings, run_name, owner)]
    objs += [build_vllm_service(settings, run_name, owner), build_vllm_deployment(config, settings, run_name, owner)]
    return objs
