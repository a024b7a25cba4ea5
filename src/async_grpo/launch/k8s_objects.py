"""Every Kubernetes object one run needs, built in one place as plain dicts from a `GRPOConfig`.

The builders are pure functions (config + `ClusterSettings` in, manifests out), so the same code
feeds the `kubernetes` launch backend, `async-grpo render` and the committed example manifests, and
tests can validate the output against the Kubernetes and Training Operator schemas offline. Pod parts
live in `k8s_pods.py`, NetworkPolicies in `k8s_network.py`, the platform's allow-list in `k8s_policy.py`, the
LLM judge a run serves in `k8s_judge.py`, its distillation teacher in `k8s_teacher.py`.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import yaml

from async_grpo.config import GRPOConfig, flat_dump
from async_grpo.config.sections.peft import lora_server_args
from async_grpo.inference.server import CPU_SERVER_ENV, RUNTIME_LORA_ENV
from async_grpo.launch.k8s_judge import (
    build_judge_deployment,
    build_judge_service,
    judge_clients,
    judge_health_url,
    judge_url,
    serves_judge,
)
from async_grpo.launch.k8s_network import EVALUATOR_LABELS, agent_endpoint_ports, build_network_policies, reward_policy
from async_grpo.launch.k8s_pods import (  # noqa: F401 - re-exported: the names other modules import from here
    CACHE_DIR,
    COMPONENT_LABEL,
    CONFIG_DIR,
    CONFIG_FILE,
    DNS_LABEL,
    JUDGE_API_KEY_ENV,
    JUDGE_TOKEN_KEY,
    POD_IP_ENV,
    PROBE_PERIOD_S,
    PYTORCH_CONTAINER,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    REWARD_SERVER_MODULE,
    REWARD_TOKEN_ENV,
    REWARD_TOKEN_KEY,
    REWARD_URL_ENV,
    RUN_LABEL,
    TEACHER_API_KEY_ENV,
    TEACHER_TOKEN_KEY,
    TINY_MODEL_DIR,
    VLLM_API_KEY_ENV,
    VLLM_AUTH_MIDDLEWARE,
    VLLM_TOKEN_KEY,
    Manifest,
    RunTokens,
    base_env,
    build_tokens_secret,
    container_security,
    data_volume,
    image_server_command,
    labels,
    literal,
    meta,
    mlflow_secret_env,
    nccl_env,
    owner_reference,
    pod_spec,
    reward_url,
    run_selector,
    scratch_volumes,
    selector,
    template,
    token_env,
    tokens_secret_name,
    trainer_threads_env,
    vllm_probes,
    vllm_url,
)
from async_grpo.launch.k8s_pods import resources as _resources
from async_grpo.launch.k8s_policy import on_volume, path_problems
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.k8s_teacher import (
    build_teacher_deployment,
    build_teacher_service,
    serves_teacher,
    teacher_health_url,
    teacher_url,
)
from async_grpo.launch.platform_policy import PlatformPolicy
from async_grpo.launch.uris import canonical_http_uri
from async_grpo.user_code import is_file_spec

TERMINATION_MARGIN_S = 30  # trainer pod: past checkpoint_signal_grace_s, for MLflow and process shutdown

# Polls vLLM's /health until it answers 200 or the deadline passes (argv: base URL, timeout s).
WAIT_FOR_VLLM_PY = """\
import sys, time, urllib.request
url, timeout_s = sys.argv[1].rstrip("/") + "/health", float(sys.argv[2])
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


def run_output_dir(config: GRPOConfig, settings: ClusterSettings, run_name: str) -> str:
    """The run folder on the shared PVC: the config's `output_dir` when it lies on the volume (`on_volume`; the
    pipeline sets `<work_dir>/<run>`), else `<mount>/runs/<run>`."""
    if on_volume(config.output_dir, settings):
        return config.output_dir.rstrip("/")
    return f"{settings.data_mount_path}/runs/{run_name}"


def tracking_uri(config: GRPOConfig, settings: ClusterSettings) -> str:
    """The MLflow URI the trainer logs to: the config's when set, else the cluster's, rebuilt from its parsed parts
    (`uris.canonical_http_uri`), so the pods connect to the host the policy checked.

    Raises:
        UnsafeURI (a ValueError): the URI is malformed or ambiguous.
    """
    return canonical_http_uri(config.tracking.mlflow_tracking_uri or settings.mlflow_tracking_uri)


# ------------------------------------------------------------------------------------------------ trainer side
def trainer_config(config: GRPOConfig, settings: ClusterSettings, run_name: str) -> GRPOConfig:
    """The run config as the trainer pod sees it: vLLM, MLflow and (with reward_replicas > 0) the reward service
    in the cluster, outputs on the PVC; a judge the run serves (`k8s_judge.serves_judge`) as `judge_url` (its
    Service) and `judge_model` (its path), with no `judge_model_name_or_path` left to serve; likewise a teacher the
    run serves (`k8s_teacher.serves_teacher`) as `teacher_url` and `teacher_model`, with no
    `teacher_model_name_or_path`; a submitter's own `teacher_url` rebuilt from its parsed parts
    (`uris.canonical_http_uri`), so the trainer connects to the host the policy checked.

    Raises:
        ValueError: a path is not on the PVC (`k8s_policy.path_problems`), `reward_url` points elsewhere while the run starts its
            own reward service or its own judge, or a URI is unsafe (`uris.UnsafeURI`).
    """
    problems = path_problems(config, settings)
    if problems:
        raise ValueError(problems[0])
    data = flat_dump(config)  # flat names, so the updates below name fields as the user does
    if settings.reward_replicas:  # the run's own reward service scores the groups
        own = reward_url(run_name, settings)
        if config.rewards.reward_url and config.rewards.reward_url != own:
            raise ValueError(
                f"reward_url={config.rewards.reward_url!r} and reward_replicas={settings.reward_replicas}: the run "
                "would start a reward service and score elsewhere. Fix: set reward_replicas=0 to use your "
                "own service, or drop reward_url."
            )
        data["reward_url"] = own
    elif config.rewards.reward_url:  # the run's own service (allowed by the policy), as the client will parse it
        data["reward_url"] = canonical_http_uri(config.rewards.reward_url)
    if serves_judge(config):
        if not settings.reward_replicas and config.rewards.reward_url:
            raise ValueError(
                f"judge_model_name_or_path with reward_url={config.rewards.reward_url!r} and reward_replicas=0: the "
                "run's own judge would be asked by a reward service outside the run, which cannot reach it. Fix: "
                "drop reward_url (the run then scores in its own pods), or give judge_url instead."
            )
        data.update(
            judge_url=judge_url(run_name, settings),
            judge_model_name_or_path=None,
            judge_model=config.rewards.judge_model_name_or_path,
        )
    if serves_teacher(config):
        data.update(
            teacher_url=teacher_url(run_name, settings),
            teacher_model_name_or_path=None,
            teacher_model=config.distillation.teacher_model_name_or_path,
        )
    elif config.distillation.teacher_url:  # the submitter's teacher (allowed by the policy), as the client parses it
        data["teacher_url"] = canonical_http_uri(config.distillation.teacher_url)
    data.update(
        vllm_url=vllm_url(run_name, settings),
        mlflow_tracking_uri=tracking_uri(config, settings),
        output_dir=run_output_dir(config, settings, run_name),
        run_name=config.tracking.run_name or run_name,
        weight_sync_backend="nccl" if settings.device == "gpu" else "gloo",
    )
    if data.get("resume_from_checkpoint") is None:  # a restarted trainer pod resumes from its newest checkpoint
        data["resume_from_checkpoint"] = True
    return GRPOConfig.model_validate(data)


def _config_map(
    name: str,
    run_name: str,
    component: str,
    settings: ClusterSettings,
    fields: dict[str, Any],
    owner: dict[str, Any] | None,
) -> Manifest:
    text = "# Fields that differ from GRPOConfig's defaults (`async-grpo train --help` lists all).\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(name, run_name, component, settings, owner),
        "data": {CONFIG_FILE: text + yaml.safe_dump(fields, sort_keys=False)},
    }


def build_config_map(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """ConfigMap `<run>-config` with the trainer's config YAML (mounted at CONFIG_DIR). It holds only the
    fields that differ from their defaults; the trainer logs the fully resolved config to MLflow."""
    fields = flat_dump(trainer_config(config, settings, run_name), mode="json", exclude_defaults=True)
    return _config_map(f"{run_name}-config", run_name, "config", settings, fields, owner)


def trainer_pod(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    mlflow_run_id: str | None,
    policy: PlatformPolicy | None = None,
) -> dict[str, Any]:
    """The trainer's pod template (PyTorchJob Master and Workers; `k8s_trainjob` splits it between the runtime
    and the TrainJob): torchrun in container PYTORCH_CONTAINER, an init container waiting for vLLM (and for the
    judge or the reward pods, and for the teacher, when the run serves them). The orchestrator, beside rank 0,
    asks the distillation teacher, so the trainer pods hold its token as ASYNC_GRPO_TEACHER_API_KEY: for a teacher
    the run serves, the run's own (`<run>-tokens`); for a submitter's `teacher_url`, the key of that name in the
    Secret the platform policy binds to it (`PlatformPolicy.teacher_token_secret`; none: no token).

    Args:
        policy: the platform policy (None: none binds a teacher token, as the built-in one binds none).
    """
    vols, mounts = scratch_volumes(settings, shm=True)
    data_vol, data_mount = data_volume(settings, read_only=False)
    vols += [data_vol, {"name": "config", "configMap": {"name": f"{run_name}-config"}}]
    mounts += [data_mount, {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    secret = tokens_secret_name(run_name)
    env = (
        base_env()
        + trainer_threads_env(settings)
        + nccl_env(settings)
        + mlflow_secret_env(settings)
        + token_env(secret, (VLLM_API_KEY_ENV, VLLM_TOKEN_KEY))
        + [
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MLFLOW_TRACKING_URI", "value": literal([tracking_uri(config, settings)])[0]},
        ]
    )
    if settings.reward_replicas:
        env.append({"name": REWARD_URL_ENV, "value": reward_url(run_name, settings)})
        env += token_env(secret, (REWARD_TOKEN_ENV, REWARD_TOKEN_KEY))
    asks_judge = judge_clients(config, settings)
    if asks_judge == "trainer":  # its reward process pool scores, so it asks the judge
        env += token_env(secret, (JUDGE_API_KEY_ENV, JUDGE_TOKEN_KEY))
    if serves_teacher(config):  # the orchestrator, beside rank 0, asks the teacher
        env += token_env(secret, (TEACHER_API_KEY_ENV, TEACHER_TOKEN_KEY))
    elif config.distillation.teacher_url and policy is not None:  # a submitter's teacher: its bound token, if any
        bound = policy.teacher_token_secret(config.distillation.teacher_url)
        if bound:
            env += token_env(bound, (TEACHER_API_KEY_ENV, TEACHER_API_KEY_ENV))
    if mlflow_run_id:
        env.append({"name": "MLFLOW_RUN_ID", "value": mlflow_run_id})  # the Tracker resumes this run
    gpus = settings.nproc_per_node if settings.device == "gpu" else 0
    container = {
        "name": PYTORCH_CONTAINER,
        "image": settings.image("trainer"),
        # torchrun reads --nnodes/--nproc-per-node/--node-rank/--master-* from the operator's PET_* env
        "command": ["torchrun", "--module", "async_grpo.cli", "train", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": env,
        "resources": _resources(settings.trainer_cpu, settings.trainer_memory_gib, gpus, settings),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    timeout_s = config.inference.vllm_startup_timeout_s
    waits = [wait_container("wait-for-vllm", settings.image("trainer"), vllm_url(run_name, settings), timeout_s)]
    if asks_judge == "trainer":
        waits.append(
            wait_container("wait-for-judge", settings.image("trainer"), judge_health_url(run_name, settings), timeout_s)
        )
    elif asks_judge == "reward":  # the reward pods become ready once the judge is (their own wait-for-judge)
        waits.append(
            wait_container("wait-for-rewards", settings.image("trainer"), reward_url(run_name, settings), timeout_s)
        )
    if serves_teacher(config):
        url = teacher_health_url(run_name, settings)
        waits.append(wait_container("wait-for-teacher", settings.image("trainer"), url, timeout_s))
    spec = pod_spec(settings, [container], vols, init_containers=waits)
    # SIGTERM -> the step ends, a checkpoint is written (checkpoint_signal_grace_s), then the pod is killed
    spec["terminationGracePeriodSeconds"] = (
        math.ceil(config.checkpoint.checkpoint_signal_grace_s) + TERMINATION_MARGIN_S
    )
    return template(run_name, "trainer", spec)


def wait_container(name: str, image: str, url: str, timeout_s: float) -> dict[str, Any]:
    """An init container that polls `url`/health until it answers 200, failing after `timeout_s` seconds
    (WAIT_FOR_VLLM_PY)."""
    return {
        "name": name,
        "image": image,
        "command": ["python", "-c", WAIT_FOR_VLLM_PY, url, f"{timeout_s:g}"],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
    }


def build_pytorchjob(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    mlflow_run_id: str | None = None,
    policy: PlatformPolicy | None = None,
) -> Manifest:
    """The trainer as a Training Operator v1 PyTorchJob: one Master plus `trainer_nodes - 1` Workers.

    Args:
        mlflow_run_id: an MLflow run created beforehand; the trainer logs into it (env MLFLOW_RUN_ID).
        policy: the platform policy (`trainer_pod`: a submitter's teacher's token).
    """
    pod = trainer_pod(config, settings, run_name, mlflow_run_id, policy)
    replicas = {"Master": {"replicas": 1, "restartPolicy": settings.restart_policy, "template": pod}}
    if settings.trainer_nodes > 1:
        replicas["Worker"] = {
            "replicas": settings.trainer_nodes - 1,
            "restartPolicy": settings.restart_policy,
            "template": copy.deepcopy(pod),
        }
    return {
        "apiVersion": f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}",
        "kind": "PyTorchJob",
        "metadata": meta(run_name, run_name, "trainer", settings, None),
        "spec": {
            "nprocPerNode": str(settings.nproc_per_node),
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": settings.backoff_limit,
                "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
            },
            "pytorchReplicaSpecs": replicas,
        },
    }


# ------------------------------------------------------------------------------------------------ vLLM
def vllm_command(config: GRPOConfig, settings: ClusterSettings, model_path: str) -> list[str]:
    """The server command inside the vLLM image: `build_server_command`'s flags, with this machine's
    interpreter and CPU-build detection replaced by the target's (python3; the CPU flags on cpu), and
    the bearer-token middleware that guards the dev-mode routes (vLLM's own --api-key guards only /v1)."""
    backend = "nccl" if settings.device == "gpu" else "gloo"
    # --tensor-parallel-size from vllm_gpus unless the config sets it (vllm_serve_args)
    tp = settings.vllm_gpus if config.inference.vllm_tensor_parallel_size == 1 else 1
    cmd = image_server_command(config, settings, model_path, weight_transfer_backend=backend, tensor_parallel_size=tp)
    return cmd + lora_server_args(config) + config.vllm_serve_args


def build_vllm_deployment(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """vLLM server Deployment: dev-mode control plane behind the run's token, processed logprobs, probes on
    /health (the only route answered without the token). No MLflow or hub credentials."""
    vols, mounts = scratch_volumes(settings, shm=True)
    init = []
    if config.model_name_or_path == "builtin:tiny":  # built in the pod; the trainer pushes its own weights at v0
        model_path = TINY_MODEL_DIR
        vols.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": TINY_MODEL_DIR.rsplit("/", 1)[0]})
        init.append(
            {
                "name": "make-tiny-model",
                "image": settings.image("trainer"),
                "command": ["async-grpo", "make-tiny-model", TINY_MODEL_DIR, "--seed", str(config.seed)],
                "env": base_env(),
                "volumeMounts": list(mounts),
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "securityContext": container_security(),
            }
        )
    else:
        model_path = trainer_config(config, settings, run_name).model_name_or_path
    if config.model_name_or_path != "builtin:tiny" or config.peft.vllm_lora_sync:  # vllm_lora_sync: adapters from the
        data_vol, data_mount = data_volume(settings, read_only=True)  # trainer's <output_dir>/lora_sync on the PVC
        vols.append(data_vol)
        mounts.append(data_mount)
    env = (
        base_env()
        + nccl_env(settings)
        + [
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        ]
        + token_env(tokens_secret_name(run_name), (VLLM_API_KEY_ENV, VLLM_TOKEN_KEY))
    )
    if config.peft.vllm_lora_sync:
        env.append({"name": RUNTIME_LORA_ENV, "value": "True"})
    if settings.device == "cpu":
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(config.inference.vllm_kv_cache_gib)})
        env += [{"name": k, "value": v} for k, v in CPU_SERVER_ENV.items()]  # the in-process executor
    container = {
        "name": "vllm",
        "image": settings.image("vllm"),
        "command": literal(vllm_command(config, settings, model_path)),  # the config's strings, unexpanded
        "env": env,
        "ports": [{"name": "http", "containerPort": settings.vllm_port, "protocol": "TCP"}],
        **vllm_probes(config.inference.vllm_startup_timeout_s),
        "resources": _resources(settings.vllm_cpu, settings.vllm_memory_gib, settings.vllm_gpus, settings),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    spec = pod_spec(settings, [container], vols, init_containers=init)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(f"{run_name}-vllm", run_name, "vllm", settings, owner),
        "spec": {
            "replicas": config.inference.vllm_replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(run_name, "vllm")},
            "template": template(run_name, "vllm", spec),
        },
    }


def build_vllm_service(settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None) -> Manifest:
    """Headless Service `<run>-vllm`: its DNS name resolves straight to the vLLM pod IPs, one A record per ready
    replica (`vllm_replicas`); the trainer resolves it to reach, balance and push to each replica."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(f"{run_name}-vllm", run_name, "vllm", settings, owner),
        "spec": {
            "clusterIP": "None",
            "selector": selector(run_name, "vllm"),
            "ports": [{"name": "http", "port": settings.vllm_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


# ------------------------------------------------------------------------------------------------ rewards
def reward_readiness_probe() -> dict[str, Any]:
    """The reward container's readiness probe (/health every 5 s)."""
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}


def build_reward_deployment(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    owner: dict[str, Any] | None = None,
    *,
    component: str = "reward",
    config_map: str | None = None,
    secret: str | None = None,
) -> Manifest:
    """Reward-worker Deployment serving the run's reward functions over HTTP (`REWARD_SERVER_MODULE`).

    Reward code is submitter code, so these pods hold no credentials: no MLflow secret, no HF token, no
    ServiceAccount token; only the reward service's own bearer token, and the judge's when the run serves an LLM
    judge (the reward pods ask it; they wait for it in an init container). The shared volume is mounted,
    read-only, only when a reward function, a tool or the agent is a file (`/workspace/rewards/x.py:fn`), or the
    agent's command names a path on it (`agent_command: [python, /workspace/agents/run.py]`): the reward pods run the
    run's agent (`rewards.agent_routes`).

    Args:
        component: "reward" (the run's service) or "eval-reward" (the evaluate step's).
        config_map, secret: the ConfigMap with the served config and the Secret with the token
            (default `<run>-config` and `<run>-tokens`).
    """
    vols, mounts = scratch_volumes(settings, shm=False)
    vols.append({"name": "config", "configMap": {"name": config_map or f"{run_name}-config"}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    agent = [config.agents.agent] if config.agents.agent is not None else []
    files = any(is_file_spec(spec) for spec in [*config.rewards.reward_funcs, *config.tools.tools, *agent])
    if files or any(on_volume(arg, settings) for arg in config.agents.agent_command or []):
        data_vol, data_mount = data_volume(settings, read_only=True)
        vols.append(data_vol)
        mounts.append(data_mount)
    container = {
        "name": "reward",
        "image": settings.image("reward"),
        "command": literal(  # nothing of the submitter's today; escaped as every command is (TrainJob: from_literal)
            [
                "python",
                "-m",
                REWARD_SERVER_MODULE,
                "--config",
                f"{CONFIG_DIR}/{CONFIG_FILE}",
                "--host",
                "0.0.0.0",
                "--port",
                str(settings.reward_port),
                "--num-workers",
                str(config.rewards.reward_num_workers),
            ]
        ),
        "env": base_env() + token_env(secret or tokens_secret_name(run_name), (REWARD_TOKEN_ENV, REWARD_TOKEN_KEY)),
        "ports": [{"name": "http", "containerPort": settings.reward_port, "protocol": "TCP"}],
        "readinessProbe": reward_readiness_probe(),
        "resources": _resources(settings.reward_cpu, settings.reward_memory_gib, 0, settings),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    init = []
    if component == "reward" and judge_clients(config, settings) == "reward":  # the run's judge: its token only
        container["env"] += token_env(secret or tokens_secret_name(run_name), (JUDGE_API_KEY_ENV, JUDGE_TOKEN_KEY))
        url, timeout_s = judge_health_url(run_name, settings), config.inference.vllm_startup_timeout_s
        init.append(wait_container("wait-for-judge", settings.image("reward"), url, timeout_s))
    spec = pod_spec(settings, [container], vols, init_containers=init, compute=False)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(f"{run_name}-{component}", run_name, component, settings, owner),
        "spec": {
            "replicas": max(settings.reward_replicas, 1),
            "selector": {"matchLabels": selector(run_name, component)},
            "template": template(run_name, component, spec),
        },
    }


def build_reward_service(
    settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None, *, component: str = "reward"
) -> Manifest:
    """ClusterIP Service `<run>-<component>` in front of the reward workers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(f"{run_name}-{component}", run_name, component, settings, owner),
        "spec": {
            "selector": selector(run_name, component),
            "ports": [{"name": "http", "port": settings.reward_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_eval_reward_objects(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    tokens: RunTokens,
    policy: PlatformPolicy | None = None,
) -> list[Manifest]:
    """The evaluate step's own reward service, so held-out scoring runs reward code in a pod without
    credentials too: ConfigMap and Secret `<run>-eval-*`, Deployment, Service and NetworkPolicy
    `<run>-eval-reward` (ingress only from pods labelled EVALUATOR_LABELS), in creation order. A run that trains an
    agent has its held-out episodes run there too (the service gets the `agents` fields), and the service's pods may
    reach the evaluating pods on the agent endpoint's ports (`k8s_network.agent_endpoint_ports`)."""
    component = "eval-reward"
    fields = {
        "reward_funcs": list(config.rewards.reward_funcs),
        "reward_weights": config.rewards.reward_weights,
        "reward_num_workers": config.rewards.reward_num_workers,
        "reward_timeout_s": config.rewards.reward_timeout_s,
    }
    agent_ports = agent_endpoint_ports(config)
    if agent_ports is not None:
        a = config.agents
        fields.update(agent=a.agent, agent_command=a.agent_command, agent_timeout_s=a.agent_timeout_s)
    clients = {"podSelector": {"matchLabels": dict(EVALUATOR_LABELS)}}
    return [
        reward_policy(
            settings,
            run_name,
            policy or PlatformPolicy(),
            component=component,
            clients=clients,
            agent_ports=agent_ports,
        ),
        _config_map(f"{run_name}-eval-config", run_name, component, settings, fields, None),
        build_tokens_secret(settings, run_name, tokens, component="eval-tokens"),
        build_reward_deployment(
            config,
            settings,
            run_name,
            component=component,
            config_map=f"{run_name}-eval-config",
            secret=f"{run_name}-eval-tokens",
        ),
        build_reward_service(settings, run_name, component=component),
    ]


# ------------------------------------------------------------------------------------------------ all of it
def build_run_objects(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    *,
    mlflow_run_id: str | None = None,
    owner: dict[str, Any] | None = None,
    tokens: RunTokens | None = None,
    policy: PlatformPolicy | None = None,
) -> list[Manifest]:
    """Every object of one run, in creation order: ConfigMap, PyTorchJob, tokens Secret, NetworkPolicies, (when
    the run serves an LLM judge, `k8s_judge`) judge Service + Deployment, (when it serves a distillation teacher,
    `k8s_teacher`) teacher Service + Deployment, reward Deployment + Service, vLLM Service + Deployment (policies
    exist before the pods they guard). The
    PyTorchJob path; `k8s_trainjob.build_objects_for_api` picks by `settings.trainer_api`.

    The images are taken from `settings` as given: resolve them and check the run with
    `k8s_policy.prepare_run` first (the backend and `render` do).

    Args:
        run_name: DNS-1123 label of at most 40 characters; every object name derives from it.
        mlflow_run_id: passed to the trainer (it logs into that run).
        owner: ownerReference put on every object but the PyTorchJob (see `owner_reference`).
        tokens: the run's bearer tokens; None draws fresh random ones.
        policy: the platform policy (DNS, MLflow peers and extra egress of the NetworkPolicies).

    Raises:
        ValueError: bad run name, or a model or dataset the cluster cannot see (see `trainer_config`).
    """
    if not re.match(DNS_LABEL, run_name):
        raise ValueError(
            f"run name {run_name!r} is not a DNS-1123 label of at most 40 characters "
            "(lowercase letters, digits, '-', starting with a letter). Fix: rename it."
        )
    asks_judge = judge_clients(config, settings)
    teacher = serves_teacher(config)
    tokens = tokens or RunTokens.generate()
    objs = [
        build_config_map(config, settings, run_name, owner),
        build_pytorchjob(config, settings, run_name, mlflow_run_id, policy),
        build_tokens_secret(settings, run_name, tokens, owner=owner, judge=bool(asks_judge), teacher=teacher),
    ]
    objs += build_network_policies(
        settings, run_name, policy, owner, judge_clients=asks_judge, teacher=teacher,
        agent_ports=agent_endpoint_ports(config),
    )  # fmt: skip
    if asks_judge:  # the Service first: the launcher pins its address into the reward pods (`k8s_judge`)
        objs += [
            build_judge_service(settings, run_name, owner),
            build_judge_deployment(config, settings, run_name, owner),
        ]
    if teacher:
        objs += [
            build_teacher_service(settings, run_name, owner),
            build_teacher_deployment(config, settings, run_name, owner),
        ]
    if settings.reward_replicas:
        objs += [
            build_reward_deployment(config, settings, run_name, owner),
            build_reward_service(settings, run_name, owner),
        ]
    objs += [build_vllm_service(settings, run_name, owner), build_vllm_deployment(config, settings, run_name, owner)]
    return objs
