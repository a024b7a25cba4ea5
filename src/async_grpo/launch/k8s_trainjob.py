"""A run on Kubeflow Trainer v2 (v2.3.0, API trainer.kubeflow.org/v1alpha1): one ClusterTrainingRuntime for the
cluster, one TrainJob per run.

The runtime holds everything that does not name a run (images, resources, security contexts, probes, /dev/shm,
the JobSet's success and failure policies); the TrainJob holds the rest through the only fields v2.3.0 offers:
`spec.trainer` (image, command, env, resources, nodes) for the `node` job, and `spec.runtimePatches` (labels, env,
volumes and volume mounts, termination grace) for every job. Both halves are cut from the same pod builders as the
PyTorchJob path (`k8s_objects`), so the pods end up with the same env, volumes, tokens and labels: the patches are
exactly what today's pods hold and the runtime's do not.

Conventions from upstream (the v2.3.0 CRD schemas and kubeflow/trainer's manifests/runtimes): the torch plugin
targets the replicated job and container named `node` (PET_* env for torchrun); the trainer job carries the
label `trainer.kubeflow.org/trainjob-ancestor-step: trainer`; JobSet pods are reachable at
`<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>` (`k8s_pods.jobset_host`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_judge import serves_judge
from async_grpo.launch.k8s_network import agent_endpoint_ports
from async_grpo.launch.k8s_objects import (
    CACHE_DIR,
    CONFIG_DIR,
    CONFIG_FILE,
    POD_IP_ENV,
    PYTORCH_CONTAINER,
    RUN_LABEL,
    WAIT_FOR_VLLM_PY,
    Manifest,
    RunTokens,
    base_env,
    build_config_map,
    build_network_policies,
    build_reward_deployment,
    build_run_objects,
    build_tokens_secret,
    build_vllm_deployment,
    container_security,
    data_volume,
    labels,
    meta,
    mlflow_secret_env,
    nccl_env,
    pod_spec,
    reward_readiness_probe,
    scratch_volumes,
    trainer_pod,
    trainer_threads_env,
    vllm_probes,
    vllm_url,
)
from async_grpo.launch.k8s_pods import from_literal, resources
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.k8s_teacher import serves_teacher
from async_grpo.launch.platform_policy import PlatformPolicy

TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_PLURAL, RUNTIME_PLURAL = "trainjobs", "clustertrainingruntimes"
NODE = "node"  # Trainer v2's torch plugin: the replicated job and its container that torchrun runs in
VLLM_JOB, REWARD_JOB = "vllm", "reward"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # value "trainer" marks the trainer job
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
PATCH_MANAGER = "async-grpo"  # runtimePatches[].manager of the launcher's patch
VLLM_ARGV_KEY, REWARD_ARGV_KEY = "vllm-argv.json", "reward-argv.json"  # keys of the run's ConfigMap
# The runtime's vLLM startup probe allows this long (s) to load a model; each run's own vllm_startup_timeout_s is
# enforced by its trainer's wait-for-vllm container (v2.3.0 cannot patch probes), so this is only a ceiling.
RUNTIME_VLLM_STARTUP_TIMEOUT_S = 3600.0
VLLM_URL_ENV, VLLM_STARTUP_ENV = "ASYNC_GRPO_VLLM_URL", "ASYNC_GRPO_VLLM_STARTUP_TIMEOUT_S"  # wait-for-vllm's input

# Replaces itself by the argv stored in a JSON file (argv: the file): the runtime's vLLM and reward containers run
# it, so their command is the same for every run while each run's ConfigMap holds its own server command.
EXEC_ARGV_PY = """\
import json, os, sys
argv = json.load(open(sys.argv[1]))
os.execvp(argv[0], argv)
"""


# ------------------------------------------------------------------------------------------------ the runtime
def _runtime_labels(component: str) -> dict[str, str]:
    """The run labels without the run (the TrainJob's patch adds `async-grpo/run`)."""
    return {k: v for k, v in labels("", component).items() if k != RUN_LABEL}


def _pod(component: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"labels": _runtime_labels(component), "annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": spec,
    }


def _exec_argv_command(key: str) -> list[str]:
    return ["python3", "-c", EXEC_ARGV_PY, f"{CONFIG_DIR}/{key}"]


def _node_pod(settings: ClusterSettings) -> dict[str, Any]:
    vols, mounts = scratch_volumes(settings, shm=True)
    data_vol, data_mount = data_volume(settings, read_only=False)
    gpus = settings.nproc_per_node if settings.device == "gpu" else 0
    container = {
        "name": NODE,
        "image": settings.image("trainer"),
        # torchrun reads --nnodes/--nproc-per-node/--node-rank/--master-* from the PET_* env the torch plugin sets
        "command": ["torchrun", "--module", "async_grpo.cli", "train", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": base_env()
        + trainer_threads_env(settings)
        + nccl_env(settings)
        + mlflow_secret_env(settings)
        + [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": resources(settings.trainer_cpu, settings.trainer_memory_gib, gpus, settings),
        "volumeMounts": mounts + [data_mount],
        "securityContext": container_security(),
    }
    wait = {
        "name": "wait-for-vllm",
        "image": settings.image("trainer"),
        "command": ["python", "-c", WAIT_FOR_VLLM_PY, f"$({VLLM_URL_ENV})", f"$({VLLM_STARTUP_ENV})"],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
    }
    return _pod(
        "trainer", pod_spec(settings, [container], vols + [data_vol], init_containers=[wait], restart_policy="Never")
    )


def _vllm_pod(settings: ClusterSettings, startup_timeout_s: float) -> dict[str, Any]:
    vols, mounts = scratch_volumes(settings, shm=True)
    data_vol, data_mount = data_volume(settings, read_only=True)
    container = {
        "name": "vllm",
        "image": settings.image("vllm"),
        "command": _exec_argv_command(VLLM_ARGV_KEY),
        "env": base_env()
        + nccl_env(settings)
        + [
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        ],
        "ports": [{"name": "http", "containerPort": settings.vllm_port, "protocol": "TCP"}],
        **vllm_probes(startup_timeout_s),
        "resources": resources(settings.vllm_cpu, settings.vllm_memory_gib, settings.vllm_gpus, settings),
        "volumeMounts": mounts + [data_mount],
        "securityContext": container_security(),
    }
    return _pod("vllm", pod_spec(settings, [container], vols + [data_vol], restart_policy="OnFailure"))


def _reward_pod(settings: ClusterSettings) -> dict[str, Any]:
    vols, mounts = scratch_volumes(settings, shm=False)
    container = {
        "name": "reward",
        "image": settings.image("reward"),
        "command": _exec_argv_command(REWARD_ARGV_KEY),
        "env": base_env(),
        "ports": [{"name": "http", "containerPort": settings.reward_port, "protocol": "TCP"}],
        "readinessProbe": reward_readiness_probe(),
        "resources": resources(settings.reward_cpu, settings.reward_memory_gib, 0, settings),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    return _pod("reward", pod_spec(settings, [container], vols, compute=False, restart_policy="OnFailure"))


def _replicated_job(name: str, pod: dict[str, Any], backoff_limit: int, job_labels: dict[str, str]) -> dict:
    job: dict[str, Any] = {"spec": {"backoffLimit": backoff_limit, "template": pod}}
    if job_labels:
        job["metadata"] = {"labels": job_labels}
    return {"name": name, "replicas": 1, "template": job}


def build_cluster_training_runtime(
    settings: ClusterSettings,
    *,
    name: str | None = None,
    vllm_startup_timeout_s: float = RUNTIME_VLLM_STARTUP_TIMEOUT_S,
) -> Manifest:
    """The cluster-scoped ClusterTrainingRuntime `settings.trainer_runtime` (default `async-grpo`).

    Its JobSet has the replicated jobs `node` (torchrun, `trainer_nodes` pods; the TrainJob's trainer), `vllm`
    (one server, `vllm_gpus` GPUs) and, when `reward_replicas` is 1, `reward`. The run is over when `node`
    completes (successPolicy); any failed job restarts the whole JobSet up to `backoff_limit` times
    (failurePolicy.maxRestarts), and the restarted trainer resumes from its newest checkpoint on the PVC
    (the run config sets resume_from_checkpoint: true). vLLM and reward pods restart in place (OnFailure).

    The vLLM and reward containers run the command stored in the run's ConfigMap (EXEC_ARGV_PY), and the
    wait-for-vllm init container reads its URL from the env the TrainJob adds: nothing here names a run.

    Args:
        settings: resolved by `k8s_policy.prepare_run` (its images are the runtime's images).
        name: the runtime's name; None: `settings.trainer_runtime`.
        vllm_startup_timeout_s: what the vLLM startup probe allows (s); a run's own timeout governs its
            wait-for-vllm container (v2.3.0 cannot patch probes), so keep this at least the longest run's.
    """
    jobs = [
        _replicated_job(NODE, _node_pod(settings), 0, {ANCESTOR_LABEL: "trainer"}),
        _replicated_job(VLLM_JOB, _vllm_pod(settings, vllm_startup_timeout_s), settings.backoff_limit, {}),
    ]
    if settings.reward_replicas:
        jobs.append(_replicated_job(REWARD_JOB, _reward_pod(settings), settings.backoff_limit, {}))
    return {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "ClusterTrainingRuntime",
        "metadata": {
            "name": name or settings.trainer_runtime,
            "labels": {**_runtime_labels("runtime"), FRAMEWORK_LABEL: "torch"},
        },
        "spec": {
            "mlPolicy": {"numNodes": settings.trainer_nodes, "torch": {}},
            "template": {
                "spec": {
                    "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                    "successPolicy": {"operator": "All", "targetReplicatedJobs": [NODE]},
                    "failurePolicy": {"maxRestarts": settings.backoff_limit},
                    "replicatedJobs": jobs,
                }
            },
        },
    }


# ------------------------------------------------------------------------------------------------ one run
def check_trainjob_run(config: GRPOConfig, settings: ClusterSettings) -> None:
    """Refuse what the `async-grpo` runtime cannot hold (one vLLM pod and at most one reward pod, addressed by
    their JobSet hostnames; models on the PVC; no judge or teacher job, so no `judge_model_name_or_path` or
    `teacher_model_name_or_path` to serve).

    Raises:
        ValueError: names the field and the fix.
    """
    if config.inference.vllm_replicas != 1:
        raise ValueError(
            f"vllm_replicas={config.inference.vllm_replicas} with trainer_api: trainjob: the runtime has one vLLM "
            "pod. Fix: set vllm_replicas: 1, or use trainer_api: pytorchjob for several vLLM replicas."
        )
    if settings.reward_replicas > 1:
        raise ValueError(
            f"reward_replicas={settings.reward_replicas} with trainer_api: trainjob: the runtime has one reward "
            "pod. Fix: set reward_replicas to 0 or 1 (raise reward_num_workers instead)."
        )
    if serves_judge(config):
        raise ValueError(
            f"judge_model_name_or_path={config.rewards.judge_model_name_or_path!r} with trainer_api: trainjob: the "
            "runtime has no judge job, so no judge would be served. Fix: serve the judge yourself and give its "
            "judge_url (allowed by the platform policy's judge_urls), or use trainer_api: pytorchjob, which serves "
            "it as a Deployment."
        )
    if serves_teacher(config):
        raise ValueError(
            f"teacher_model_name_or_path={config.distillation.teacher_model_name_or_path!r} with trainer_api: "
            "trainjob: the runtime has no teacher job, so no teacher would be served. Fix: serve the teacher yourself "
            "and give its teacher_url (allowed by the platform policy's teacher_urls), or use trainer_api: "
            "pytorchjob, which serves it as a Deployment."
        )
    if config.model_name_or_path == "builtin:tiny":
        raise ValueError(
            "model_name_or_path='builtin:tiny' with trainer_api: trainjob: the runtime's vLLM pod loads its model "
            "from the PVC. Fix: use trainer_api: pytorchjob for the builtin model, or a model on the PVC."
        )


def _extra(full: list[dict], base: list[dict]) -> list[dict]:
    """The entries of `full` that `base` lacks (what the TrainJob adds to the runtime)."""
    return [copy.deepcopy(e) for e in full if e not in base]


def _patch(
    job: str,
    run_name: str,
    run_pod: dict[str, Any],
    runtime_pod: dict[str, Any],
    *,
    init_env: dict[str, list[dict[str, Any]]] | None = None,
    mount_config: bool = False,
) -> dict[str, Any]:
    """A replicatedJobs patch: the run label, and each container's env and mounts (and the pod's volumes)
    that today's pod `run_pod` holds and the runtime's `runtime_pod` does not.

    Args:
        init_env: init container name -> env entries to add to it.
        mount_config: also mount the run's ConfigMap at CONFIG_DIR (vLLM reads its command there; today's vLLM
            pod has no ConfigMap).
    """
    run_spec, rt_spec = run_pod["spec"], runtime_pod["spec"]
    rt_containers = {c["name"]: c for c in rt_spec["containers"]}
    containers = []
    for c in run_spec["containers"]:
        name = NODE if c["name"] == PYTORCH_CONTAINER else c["name"]
        rt = rt_containers[name]
        entry: dict[str, Any] = {"name": name}
        if job != NODE:  # the node container's env travels in spec.trainer.env
            env = _extra(c.get("env", []), rt.get("env", []))
            if env:
                entry["env"] = env
        mounts = _extra(c.get("volumeMounts", []), rt.get("volumeMounts", []))
        if mount_config:
            mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
        if mounts:
            entry["volumeMounts"] = mounts
        containers.append(entry)
    spec: dict[str, Any] = {"containers": containers}
    volumes = _extra(run_spec.get("volumes", []), rt_spec.get("volumes", []))
    if mount_config:
        volumes.append({"name": "config", "configMap": {"name": f"{run_name}-config"}})
    if volumes:
        spec["volumes"] = volumes
    if init_env:
        spec["initContainers"] = [{"name": n, "env": env} for n, env in init_env.items()]
    if "terminationGracePeriodSeconds" in run_spec:
        spec["terminationGracePeriodSeconds"] = run_spec["terminationGracePeriodSeconds"]
    return {
        "name": job,
        "template": {"spec": {"template": {"metadata": {"labels": {RUN_LABEL: run_name}}, "spec": spec}}},
    }


def build_trainjob(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    mlflow_run_id: str | None = None,
    policy: PlatformPolicy | None = None,
) -> Manifest:
    """The run's TrainJob on the ClusterTrainingRuntime `settings.trainer_runtime`.

    spec.trainer carries the trainer's image, command, per-run env (tokens, MLFLOW_RUN_ID, tracking and reward
    URLs), resources, node and process counts; spec.runtimePatches (manager PATCH_MANAGER) add the run label, the
    run's ConfigMap, token env and termination grace to each replicated job. Labels: the run's, plus Kueue's
    queue and priority class when the settings name them.

    Args:
        mlflow_run_id: an MLflow run created beforehand; the trainer logs into it (env MLFLOW_RUN_ID).
        policy: the platform policy (`k8s_objects.trainer_pod`: a submitter's teacher's token).

    Raises:
        ValueError: what `check_trainjob_run` or `k8s_objects.trainer_config` refuse.
    """
    check_trainjob_run(config, settings)
    runtime = build_cluster_training_runtime(settings)  # what the patches complete (probes are not compared)
    rt_pods = {
        j["name"]: j["template"]["spec"]["template"] for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    trainer = trainer_pod(config, settings, run_name, mlflow_run_id, policy)
    node = trainer["spec"]["containers"][0]
    wait_env = [  # the arguments today's wait-for-vllm container gets on its command line
        {"name": VLLM_URL_ENV, "value": vllm_url(run_name, settings)},
        {"name": VLLM_STARTUP_ENV, "value": f"{config.inference.vllm_startup_timeout_s:g}"},
    ]
    patches = [_patch(NODE, run_name, trainer, rt_pods[NODE], init_env={"wait-for-vllm": wait_env})]
    vllm = build_vllm_deployment(config, settings, run_name)["spec"]["template"]
    patches.append(_patch(VLLM_JOB, run_name, vllm, rt_pods[VLLM_JOB], mount_config=True))
    if settings.reward_replicas:
        reward = build_reward_deployment(config, settings, run_name)["spec"]["template"]
        patches.append(_patch(REWARD_JOB, run_name, reward, rt_pods[REWARD_JOB]))
    metadata = meta(run_name, run_name, "trainer", settings, None)
    if settings.kueue_queue_name:
        metadata["labels"][KUEUE_QUEUE_LABEL] = settings.kueue_queue_name
        if settings.priority_class_name:
            metadata["labels"][KUEUE_PRIORITY_LABEL] = settings.priority_class_name
    rt_node = rt_pods[NODE]["spec"]["containers"][0]
    return {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {
                "apiGroup": TRAINER_GROUP,
                "kind": "ClusterTrainingRuntime",
                "name": settings.trainer_runtime,
            },
            "trainer": {
                "image": node["image"],
                "command": node["command"],
                "env": _extra(node["env"], rt_node["env"]),
                "numNodes": settings.trainer_nodes,
                "numProcPerNode": settings.nproc_per_node,
                "resourcesPerNode": node["resources"],
            },
            "runtimePatches": [
                {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": patches}}}}
            ],
        },
    }


def build_trainjob_config_map(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, owner: dict[str, Any] | None = None
) -> Manifest:
    """`k8s_objects.build_config_map`'s ConfigMap plus the vLLM and reward server commands (JSON argv, the
    ones today's Deployments run), which the runtime's containers exec."""
    cm = build_config_map(config, settings, run_name, owner)
    vllm = build_vllm_deployment(config, settings, run_name)["spec"]["template"]["spec"]["containers"][0]
    # a file is not expanded by the kubelet: the argv the process must receive, not the manifest's escaped form
    cm["data"][VLLM_ARGV_KEY] = json.dumps(from_literal(vllm["command"]))
    if settings.reward_replicas:
        reward = build_reward_deployment(config, settings, run_name)["spec"]["template"]["spec"]["containers"][0]
        cm["data"][REWARD_ARGV_KEY] = json.dumps(from_literal(reward["command"]))
    return cm


def build_trainjob_run_objects(
    config: GRPOConfig,
    settings: ClusterSettings,
    run_name: str,
    *,
    mlflow_run_id: str | None = None,
    owner: dict[str, Any] | None = None,
    tokens: RunTokens | None = None,
    policy: PlatformPolicy | None = None,
) -> list[Manifest]:
    """Every namespaced object of one trainjob run, in creation order: ConfigMap, TrainJob, tokens Secret,
    NetworkPolicies (the same as the PyTorchJob path's: the pods carry the same run and component labels).
    The ClusterTrainingRuntime is the cluster's (`build_cluster_training_runtime`), never created per run."""
    return [
        build_trainjob_config_map(config, settings, run_name, owner),
        build_trainjob(config, settings, run_name, mlflow_run_id, policy),
        build_tokens_secret(settings, run_name, tokens or RunTokens.generate(), owner=owner),
        *build_network_policies(settings, run_name, policy, owner, agent_ports=agent_endpoint_ports(config)),
    ]


def build_objects_for_api(
    config: GRPOConfig, settings: ClusterSettings, run_name: str, **kwargs: Any
) -> list[Manifest]:
    """A run's objects for `settings.trainer_api`: `build_trainjob_run_objects` for trainjob, else
    `k8s_objects.build_run_objects` (keyword arguments as theirs)."""
    if settings.trainer_api == "trainjob":
        return build_trainjob_run_objects(config, settings, run_name, **kwargs)
    return build_run_objects(config, settings, run_name, **kwargs)
