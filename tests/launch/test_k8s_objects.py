"""The objects the kubernetes backend builds: schema-valid, and wired the way the run needs."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_objects import (
    ClusterSettings,
    build_run_objects,
    owner_reference,
    trainer_config,
    trainer_pod,
    vllm_url,
)
from async_grpo.launch.k8s_trainjob import build_cluster_training_runtime

from ._k8s_validate import validate_any, validate_builtin, validate_pytorchjob
from .conftest import RUN


def _by_kind(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ids avoid the bare word "gpu": tests/conftest.py skips items with a `gpu` keyword when there is no CUDA
SETUPS = pytest.mark.parametrize("setup", ["gpu", "cpu"], ids=["2x8-gpus", "cpu-only"])


@SETUPS
def test_every_object_validates_against_its_schema(setup, request):
    config = request.getfixturevalue(f"{setup}_config")
    settings = request.getfixturevalue(f"{setup}_settings")
    objs = build_run_objects(
        config,
        settings,
        RUN,
        mlflow_run_id="0123abcd",
        owner={"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": RUN, "uid": "u-1"},
    )
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "PyTorchJob",
        "Secret",
        "Service",
        "Service",
    ]
    for obj in objs:
        validate_any(obj)


def test_schema_checks_reject_unknown_fields(gpu_config, gpu_settings):
    """The validators are strict: a misspelt field fails (the API server would silently drop it)."""
    import jsonschema

    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

    objs = _by_kind(build_run_objects(gpu_config, gpu_settings, RUN))
    job = copy.deepcopy(objs[("PyTorchJob", RUN)])
    job["spec"]["nprocsPerNode"] = "8"
    with pytest.raises(jsonschema.ValidationError):
        validate_pytorchjob(job)
    job = copy.deepcopy(objs[("PyTorchJob", RUN)])
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate_pytorchjob(job)
    dep = copy.deepcopy(objs[("Deployment", f"{RUN}-vllm")])
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(dep)


def test_vllm_deployment_and_headless_service(gpu_config, gpu_settings):
    objs = _by_kind(build_run_objects(gpu_config, gpu_settings, RUN))
    svc = objs[("Service", f"{RUN}-vllm")]
    assert svc["spec"]["clusterIP"] == "None"
    dep = objs[("Deployment", f"{RUN}-vllm")]
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    cmd = c["command"]
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--model") + 1] == "/workspace/models/Qwen2.5-1.5B-Instruct"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.85"]
    assert "--enforce-eager" not in cmd and "--worker-extension-cls" not in cmd
    # the dev-mode routes are guarded by our middleware, /v1 by vLLM's own VLLM_API_KEY check
    assert cmd[cmd.index("--middleware") + 1] == "async_grpo.inference.auth.BearerTokenMiddleware"
    env = _env(c)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_DISABLE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": f"{RUN}-tokens", "key": "vllm-api-key"}}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # the one route without a token
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert vols[mounts["/workspace"]]["persistentVolumeClaim"] == {
        "claimName": "async-grpo-workspace",
        "readOnly": True,
    }
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # vLLM's startup probe covers the run's startup timeout
    probe = c["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= gpu_config.inference.vllm_startup_timeout_s


def test_cpu_vllm_uses_gloo_and_builds_the_tiny_model(cpu_config, cpu_settings):
    objs = _by_kind(build_run_objects(cpu_config, cpu_settings, RUN))
    pod = objs[("Deployment", f"{RUN}-vllm")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/async-grpo/cpu:0.1.0"
    cmd = c["command"]
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "gloo"}
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "async_grpo.transports.weights.gloo.GlooWorkerExtension"
    assert "--enforce-eager" in cmd and "nvidia.com/gpu" not in json.dumps(pod)
    assert _env(c)["VLLM_CPU_KVCACHE_SPACE"] == str(cpu_config.inference.vllm_kv_cache_gib)
    (init,) = pod["initContainers"]
    model = cmd[cmd.index("--model") + 1]
    assert init["command"][:3] == ["async-grpo", "make-tiny-model", model]
    assert {m["name"] for m in init["volumeMounts"]} >= {"model"}


def test_pytorchjob_master_workers_nccl_and_vllm_url(gpu_config, gpu_settings):
    objs = _by_kind(build_run_objects(gpu_config, gpu_settings, RUN, mlflow_run_id="run-42"))
    job = objs[("PyTorchJob", RUN)]
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["spec"]["nprocPerNode"] == "8"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Master": 1, "Worker": 1}
    assert {v["restartPolicy"] for v in specs.values()} == {"OnFailure"}  # a restarted trainer resumes
    assert job["spec"]["runPolicy"]["backoffLimit"] == gpu_settings.backoff_limit == 3
    assert (
        specs["Master"]["template"]["spec"]["terminationGracePeriodSeconds"]
        == gpu_config.checkpoint.checkpoint_signal_grace_s + 30
    )  # the checkpoint on SIGTERM fits
    assert specs["Master"]["template"] is not specs["Worker"]["template"]  # independent dicts, no YAML aliases
    pod = specs["Master"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch"
    assert c["command"][:3] == ["torchrun", "--module", "async_grpo.cli"]
    env = _env(c)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["MLFLOW_RUN_ID"] == "run-42"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "envFrom" not in c  # never a whole secret: only the MLflow credentials by key
    assert env["MLFLOW_TRACKING_PASSWORD"] == {
        "secretKeyRef": {"name": "mlflow-tracking", "key": "MLFLOW_TRACKING_PASSWORD", "optional": True}
    }
    assert "HF_TOKEN" not in env and env["HF_HUB_OFFLINE"] == "1"  # models and data come from the PVC
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": f"{RUN}-tokens", "key": "vllm-api-key"}}
    assert env["ASYNC_GRPO_REWARD_TOKEN"] == {"secretKeyRef": {"name": f"{RUN}-tokens", "key": "reward-token"}}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/workspace"]]["persistentVolumeClaim"]["claimName"] == "async-grpo-workspace"
    assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # the config the trainer reads points at the vLLM Service DNS name, MLflow and the PVC
    cm = objs[("ConfigMap", f"{RUN}-config")]
    assert vols[mounts["/etc/async-grpo"]]["configMap"]["name"] == cm["metadata"]["name"]
    trainer_cfg = GRPOConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    assert (
        trainer_cfg.inference.vllm_url
        == f"http://{RUN}-vllm.team-a.svc.cluster.local:8000"
        == vllm_url(RUN, gpu_settings)
    )
    assert trainer_cfg.weight_sync.weight_sync_backend == "nccl"
    assert trainer_cfg.output_dir == f"/workspace/runs/{RUN}"
    assert trainer_cfg.tracking.mlflow_tracking_uri == "http://mlflow:5000"
    assert trainer_cfg.checkpoint.resume_from_checkpoint is True  # a restarted pod resumes from the PVC
    # ranks wait for vLLM (its open /health) before starting
    (wait,) = pod["initContainers"]
    assert trainer_cfg.inference.vllm_url in wait["command"] and '+ "/health"' in wait["command"][2]


def test_single_node_job_has_no_workers(cpu_config, cpu_settings):
    job = _by_kind(build_run_objects(cpu_config, cpu_settings, RUN))[("PyTorchJob", RUN)]
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    c = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_cpu_trainers_take_their_cpu_request_as_threads_per_process(api, cpu_config, cpu_settings, gpu_settings):
    """Torch's default is one thread per core of the node, beside other tenants' pods: every core is then a cliff
    (docs/performance.md, "A busy machine"). On a CPU cluster each trainer process gets its share of the pod's CPU
    request, through the downward API; GPU clusters keep torchrun's defaults."""
    settings = cpu_settings.model_copy(update={"trainer_api": api, "nproc_per_node": 2, "trainer_cpu": 3})
    if api == "pytorchjob":
        job = _by_kind(build_run_objects(cpu_config, settings, RUN))[("PyTorchJob", RUN)]
        validate_pytorchjob(job)
        env = _env(job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0])
    else:
        runtime = build_cluster_training_runtime(settings)
        node = next(j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node")
        env = _env(node["template"]["spec"]["template"]["spec"]["containers"][0])
    assert env["OMP_NUM_THREADS"] == {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "2"}}  # ceil(3/2)
    gpu_pod = trainer_pod(cpu_config, gpu_settings, RUN, None)
    assert "OMP_NUM_THREADS" not in _env(gpu_pod["spec"]["containers"][0])


@SETUPS
def test_pods_run_non_root_read_only_without_escalation(setup, request):
    objs = build_run_objects(
        request.getfixturevalue(f"{setup}_config"), request.getfixturevalue(f"{setup}_settings"), RUN
    )
    templates = [o["spec"]["template"] for o in objs if o["kind"] == "Deployment"]
    templates += [
        r["template"] for o in objs if o["kind"] == "PyTorchJob" for r in o["spec"]["pytorchReplicaSpecs"].values()
    ]
    assert len(templates) == (4 if setup == "gpu" else 3)
    for tpl in templates:
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            if c["name"] != "wait-for-vllm":  # the readiness poller writes nothing
                assert {"/tmp", "/cache"} <= {m["mountPath"] for m in c["volumeMounts"]}


def test_labels_and_owner_references_tie_the_run_together(gpu_config, gpu_settings):
    job_live = {"metadata": {"name": RUN, "uid": "1234-uid"}}
    owner = owner_reference(job_live)
    objs = build_run_objects(gpu_config, gpu_settings, RUN, owner=owner)
    for obj in objs:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "async-grpo"
        assert obj["metadata"]["labels"]["async-grpo/run"] == RUN
        assert obj["metadata"]["namespace"] == "team-a"
        if obj["kind"] == "PyTorchJob":
            assert "ownerReferences" not in obj["metadata"]
        else:
            assert obj["metadata"]["ownerReferences"] == [
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": RUN, "uid": "1234-uid"}
            ]


def test_reward_service_runs_by_default_and_is_left_out_with_zero_replicas(gpu_config):
    objs = build_run_objects(gpu_config, ClusterSettings(), RUN)
    reward = [o for o in objs if o["metadata"]["labels"]["app.kubernetes.io/component"] == "reward"]
    assert sorted(o["kind"] for o in reward) == ["Deployment", "NetworkPolicy", "Service"]
    job = _by_kind(objs)[("PyTorchJob", RUN)]
    assert f"http://{RUN}-reward.async-grpo.svc.cluster.local:8080" in json.dumps(job)
    objs = build_run_objects(gpu_config, ClusterSettings(reward_replicas=0), RUN)
    assert not [o for o in objs if o["metadata"]["labels"]["app.kubernetes.io/component"] == "reward"]
    job = _by_kind(objs)[("PyTorchJob", RUN)]
    assert "ASYNC_GRPO_REWARD_URL" not in json.dumps(job)


def test_trainer_config_points_at_the_runs_reward_service_and_refuses_a_conflicting_url(gpu_config):
    own = f"http://{RUN}-reward.async-grpo.svc.cluster.local:8080"
    assert trainer_config(gpu_config, ClusterSettings(), RUN).rewards.reward_url == own
    assert trainer_config(gpu_config, ClusterSettings(reward_replicas=0), RUN).rewards.reward_url is None
    external = gpu_config.model_copy(update={"reward_url": "http://rewards.other:9000"})
    assert (
        trainer_config(external, ClusterSettings(reward_replicas=0), RUN).rewards.reward_url
        == "http://rewards.other:9000"
    )
    with pytest.raises(ValueError, match=r"reward_url=.*reward_replicas=1.*Fix: set reward_replicas=0"):
        trainer_config(external, ClusterSettings(), RUN)


def test_reward_pods_mount_the_volume_only_for_reward_files(gpu_config, gpu_settings):
    def mounts(config: GRPOConfig) -> list[str]:
        dep = _by_kind(build_run_objects(config, gpu_settings, RUN))[("Deployment", f"{RUN}-reward")]
        return [m["mountPath"] for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]]

    assert "/workspace" not in mounts(gpu_config)  # builtin rewards
    files = gpu_config.model_copy(update={"reward_funcs": ["/workspace/rewards/math.py:accuracy"]})
    assert "/workspace" in mounts(files)


def test_model_outside_the_volume_is_rejected_with_a_fix(gpu_settings):
    config = GRPOConfig(model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct")
    with pytest.raises(ValueError, match="Fix: copy it onto PVC"):
        trainer_config(config, gpu_settings, RUN)


@pytest.mark.parametrize("field", ["dataset", "eval_dataset"])
def test_a_hub_dataset_is_rejected_with_a_fix(gpu_config, gpu_settings, field):
    """Run pods reach no hub (egress policy, HF_HUB_OFFLINE): a hub id would fail late, so it fails here."""
    with pytest.raises(ValueError, match=rf"{field}='openai/gsm8k'.*Fix: copy it onto PVC"):
        trainer_config(gpu_config.model_copy(update={field: "openai/gsm8k"}), gpu_settings, RUN)


def _pods(objs: list[dict]) -> dict[str, dict]:
    """component -> pod spec of every pod template of the run."""
    out = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["spec"]
        for o in objs
        if o["kind"] == "Deployment"
    }
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    out.update({f"trainer-{k}": r["template"]["spec"] for k, r in job["spec"]["pytorchReplicaSpecs"].items()})
    return out


def _secrets_used(spec: dict) -> set[tuple[str, str]]:
    """(secret, key) of every secret a pod spec reads, through env, envFrom or volumes."""
    used = set()
    for c in spec["containers"] + spec.get("initContainers", []):
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                used.add((ref["name"], ref["key"]))
        used |= {(f["secretRef"]["name"], "*") for f in c.get("envFrom", []) if "secretRef" in f}
    used |= {(v["secret"]["secretName"], "*") for v in spec["volumes"] if "secret" in v}
    return used


@SETUPS
def test_no_pod_holds_a_token_or_secret_it_does_not_need(setup, request):
    """Reward code (submitter code) runs with its own service token only; vLLM with its API key only; the
    trainer, which runs only image code, gets the MLflow credentials by key; no pod mounts an SA token."""
    objs = build_run_objects(
        request.getfixturevalue(f"{setup}_config").model_copy(
            update={"reward_funcs": ["/workspace/rewards/math.py:accuracy"]}
        ),
        request.getfixturevalue(f"{setup}_settings"),
        RUN,
    )
    pods = _pods(objs)
    tokens = f"{RUN}-tokens"
    assert _secrets_used(pods["reward"]) == {(tokens, "reward-token")}
    assert _secrets_used(pods["vllm"]) == {(tokens, "vllm-api-key")}
    mlflow = {
        ("mlflow-tracking", k)
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    }
    assert _secrets_used(pods["trainer-Master"]) == mlflow | {(tokens, "vllm-api-key"), (tokens, "reward-token")}
    for name, spec in pods.items():
        assert spec["automountServiceAccountToken"] is False, name
        assert not any(v.get("projected") for v in spec["volumes"]), name
    # reward code is loaded from the workspace, which it sees read-only
    reward = pods["reward"]
    (mount,) = [m for m in reward["containers"][0]["volumeMounts"] if m["name"] == "data"]
    (vol,) = [v for v in reward["volumes"] if v["name"] == "data"]
    assert mount["readOnly"] is True and vol["persistentVolumeClaim"]["readOnly"] is True


def test_the_tokens_secret_holds_two_distinct_random_tokens(gpu_config, gpu_settings):
    first = _by_kind(build_run_objects(gpu_config, gpu_settings, RUN))[("Secret", f"{RUN}-tokens")]["stringData"]
    second = _by_kind(build_run_objects(gpu_config, gpu_settings, RUN))[("Secret", f"{RUN}-tokens")]["stringData"]
    assert set(first) == {"vllm-api-key", "reward-token"} and first["vllm-api-key"] != first["reward-token"]
    assert first != second and all(len(v) >= 32 for v in first.values())


def test_nccl_env_cannot_load_code():
    for key in (
        "LD_PRELOAD",
        "PYTHONPATH",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "NCCL_CONF_FILE",
        "NCCL_TOPO_FILE",
        "NCCL_GRAPH_FILE",
        "NCCL_DEBUG_FILE",
        "GLOO_PLUGIN",
    ):
        with pytest.raises(ValueError, match=rf"nccl_env may only set NCCL/gloo tuning variables.*{key}"):
            ClusterSettings(nccl_env={key: "/workspace/evil.so"})
    assert ClusterSettings(nccl_env={"NCCL_IB_HCA": "mlx5"}).nccl_env == {"NCCL_IB_HCA": "mlx5"}


@pytest.mark.parametrize("name", ["Bad_Name", "9starts-with-digit", "x" * 41, "ends-with-"])
def test_bad_run_names_are_rejected(name, cpu_config, cpu_settings):
    with pytest.raises(ValueError, match="DNS-1123"):
        build_run_objects(cpu_config, cpu_settings, name)


def test_settings_reject_overlapping_ports():
    with pytest.raises(ValueError, match="inside weight_transfer_ports"):
        ClusterSettings(vllm_port=40100)
    with pytest.raises(ValueError, match="at least 256 ports"):
        ClusterSettings(weight_transfer_ports=(40000, 40010))


def test_pipeline_paths_and_tracking_uri_are_kept(gpu_settings):
    """The pipeline sets output_dir under the workspace mount and the MLflow URI from its secret: both stay."""
    config = GRPOConfig(
        model_name_or_path="/workspace/models/m",
        output_dir="/workspace/my-run",
        mlflow_tracking_uri="http://mlflow.team-a.svc:5000",
    )
    cfg = trainer_config(config, gpu_settings, RUN)
    assert cfg.output_dir == "/workspace/my-run" and cfg.tracking.mlflow_tracking_uri == "http://mlflow.team-a.svc:5000"
    # a path off the volume (the local default runs/tiny) moves onto it
    assert trainer_config(GRPOConfig(), gpu_settings, RUN).output_dir == f"/workspace/runs/{RUN}"


@SETUPS
def test_two_vllm_replicas_render_valid_objects_the_trainer_resolves(setup, request):
    """`vllm_replicas: 2`: the Deployment runs two pods behind the headless Service, and the trainer's config names
    that Service with vllm_replicas=2, so it resolves both pod addresses (inference.replicas.replica_urls)."""
    config = request.getfixturevalue(f"{setup}_config").model_copy(deep=True)
    config.inference.vllm_replicas = 2
    settings = request.getfixturevalue(f"{setup}_settings")
    objs = build_run_objects(config, settings, RUN)
    for obj in objs:
        validate_any(obj)
    by_kind = _by_kind(objs)
    assert by_kind[("Deployment", f"{RUN}-vllm")]["spec"]["replicas"] == 2
    assert by_kind[("Service", f"{RUN}-vllm")]["spec"]["clusterIP"] == "None"  # one DNS record per pod
    seen = trainer_config(config, settings, RUN)
    assert seen.inference.vllm_replicas == 2 and seen.inference.vllm_url == vllm_url(RUN, settings)


def test_tensor_parallel_size_from_the_config_is_not_passed_twice(gpu_config, gpu_settings):
    config = gpu_config.model_copy(deep=True)
    config.inference.vllm_tensor_parallel_size = 4
    dep = _by_kind(build_run_objects(config, gpu_settings, RUN))[("Deployment", f"{RUN}-vllm")]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd.count("--tensor-parallel-size") == 1 and cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
