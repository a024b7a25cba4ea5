"""Kubeflow Trainer v2: the TrainJob and the ClusterTrainingRuntime fit the v2.3.0 CRDs, and split today's pods
between them without losing an env entry, a volume, a token or a label."""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError
from async_grpo.launch.k8s_objects import (
    ClusterSettings,
    build_reward_deployment,
    build_run_objects,
    build_vllm_deployment,
    trainer_pod,
)
from async_grpo.launch.k8s_policy import PolicyViolation, check_run
from async_grpo.launch.k8s_trainjob import (
    NODE,
    REWARD_ARGV_KEY,
    VLLM_ARGV_KEY,
    build_cluster_training_runtime,
    build_objects_for_api,
    build_trainjob,
)
from async_grpo.launch.platform_policy import PlatformPolicy

from ._k8s_validate import validate_any, validate_trainer_object
from .conftest import RUN


@pytest.fixture
def tj_settings(gpu_settings) -> ClusterSettings:
    return gpu_settings.model_copy(update={"trainer_api": "trainjob"})


def _jobs(runtime: dict) -> dict[str, dict]:
    return {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}


def test_gpu_example_renders_schema_valid_trainjob_runtime_and_the_same_policies(gpu_config, gpu_settings, tj_settings):
    objs = build_objects_for_api(gpu_config, tj_settings, RUN, mlflow_run_id="0123abcd")
    assert [o["kind"] for o in objs] == ["ConfigMap", "TrainJob", "Secret"] + ["NetworkPolicy"] * 3
    for obj in objs:
        validate_any(obj)
    validate_trainer_object(build_cluster_training_runtime(tj_settings))
    old = [o for o in build_run_objects(gpu_config, gpu_settings, RUN) if o["kind"] == "NetworkPolicy"]
    assert [o for o in objs if o["kind"] == "NetworkPolicy"] == old


def test_kueue_labels_and_priority_class_fit_the_schema(gpu_config, tj_settings):
    settings = tj_settings.model_copy(update={"kueue_queue_name": "team-a", "priority_class_name": "high"})
    job = build_trainjob(gpu_config, settings, RUN)
    validate_trainer_object(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    runtime = build_cluster_training_runtime(settings)
    validate_trainer_object(runtime)
    assert all(
        j["template"]["spec"]["template"]["spec"]["priorityClassName"] == "high" for j in _jobs(runtime).values()
    )


def test_runtime_ends_on_the_trainer_and_restarts_as_checkpoints_allow(tj_settings):
    runtime = build_cluster_training_runtime(tj_settings)
    spec = runtime["spec"]["template"]["spec"]
    assert runtime["metadata"]["name"] == "async-grpo" and runtime["kind"] == "ClusterTrainingRuntime"
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": [NODE]}
    assert spec["failurePolicy"] == {"maxRestarts": tj_settings.backoff_limit}
    assert spec["network"]["enableDNSHostnames"] is True
    jobs = _jobs(runtime)
    assert list(jobs) == ["node", "vllm", "reward"]
    assert jobs["node"]["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert jobs["node"]["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == "node"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}


def _merge(runtime_pod: dict, patch: dict, trainer: dict | None) -> dict:
    """The pod the Trainer would build: runtime pod + the TrainJob's patch (+ spec.trainer for node)."""
    spec = dict(runtime_pod["spec"])
    pspec = patch["template"]["spec"]["template"]["spec"]
    spec["volumes"] = spec["volumes"] + pspec.get("volumes", [])
    containers = []
    for c in spec["containers"]:
        c = dict(c)
        p = next(x for x in pspec["containers"] if x["name"] == c["name"])
        c["env"] = c["env"] + p.get("env", []) + (trainer["env"] if trainer else [])
        c["volumeMounts"] = c["volumeMounts"] + p.get("volumeMounts", [])
        containers.append(c)
    spec["containers"] = containers
    labels = {**runtime_pod["metadata"]["labels"], **patch["template"]["spec"]["template"]["metadata"]["labels"]}
    return {"metadata": {"labels": labels}, "spec": spec}


def test_runtime_plus_patches_give_todays_pods(gpu_config, gpu_settings, tj_settings):
    """Env, volumes, mounts, security, resources and labels of every pod equal the PyTorchJob path's."""
    job = build_trainjob(gpu_config, tj_settings, RUN, mlflow_run_id="0123abcd")
    runtime = _jobs(
        build_cluster_training_runtime(tj_settings, vllm_startup_timeout_s=gpu_config.inference.vllm_startup_timeout_s)
    )
    patches = {
        p["name"]: p
        for p in job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    }
    old_pods = {  # today's builders, with the JobSet URLs of the trainjob settings
        "node": trainer_pod(gpu_config, tj_settings, RUN, "0123abcd"),
        "vllm": build_vllm_deployment(gpu_config, tj_settings, RUN)["spec"]["template"],
        "reward": build_reward_deployment(gpu_config, tj_settings, RUN)["spec"]["template"],
    }
    for name, old in old_pods.items():
        new = _merge(
            runtime[name]["template"]["spec"]["template"],
            patches[name],
            job["spec"]["trainer"] if name == NODE else None,
        )
        assert new["metadata"]["labels"] == old["metadata"]["labels"], name
        assert new["spec"]["automountServiceAccountToken"] is False
        for key in ("securityContext", "serviceAccountName", "nodeSelector", "tolerations", "enableServiceLinks"):
            assert new["spec"].get(key) == old["spec"].get(key), (name, key)
        extra_vols = [{"name": "config", "configMap": {"name": f"{RUN}-config"}}] if name == "vllm" else []
        assert sorted(map(str, new["spec"]["volumes"])) == sorted(map(str, old["spec"]["volumes"] + extra_vols)), name
        c_new, c_old = new["spec"]["containers"][0], old["spec"]["containers"][0]
        assert sorted(map(str, c_new["env"])) == sorted(map(str, c_old["env"])), name
        assert c_new["securityContext"] == c_old["securityContext"] and c_new["resources"] == c_old["resources"]
        for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
            assert c_new.get(probe) == c_old.get(probe), (name, probe)
    assert job["spec"]["trainer"]["resourcesPerNode"] == old_pods["node"]["spec"]["containers"][0]["resources"]


def test_config_map_holds_todays_server_commands(gpu_config, tj_settings):
    import json

    cm = build_objects_for_api(gpu_config, tj_settings, RUN)[0]
    vllm = json.loads(cm["data"][VLLM_ARGV_KEY])
    assert vllm[0] == "python3" and "--middleware" in vllm and "0.85" in vllm
    assert json.loads(cm["data"][REWARD_ARGV_KEY])[:3] == ["python", "-m", "async_grpo.rewards.server"]
    assert f"vllm_url: http://{RUN}-vllm-0-0.{RUN}.team-a.svc.cluster.local:8000" in cm["data"]["config.yaml"]


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize(
    ("update", "expected"),
    [
        ({"vllm_extra_args": ["--trust-remote-code"]}, "vllm_extra_args: flag '--trust-remote-code' is not allowed"),
    ],
)
def test_policy_refusals_are_the_same_on_both_apis(api, update, expected, gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": api})
    with pytest.raises(PolicyViolation, match=expected):
        check_run(gpu_config.model_copy(update=update), settings, PlatformPolicy())
    bad = settings.model_copy(update={"service_account": "default", "trainer_image": "evil.io/x:1"})
    with pytest.raises(PolicyViolation) as info:
        check_run(gpu_config, bad, PlatformPolicy())
    assert "service_account='default'" in str(info.value) and "trainer_image='evil.io/x:1'" in str(info.value)


@pytest.mark.parametrize(
    ("config_update", "settings_update", "field"),
    [
        ({"vllm_replicas": 2}, {}, "vllm_replicas=2"),
        ({}, {"reward_replicas": 2}, "reward_replicas=2"),
        ({"model_name_or_path": "builtin:tiny"}, {}, "builtin:tiny"),
    ],
)
def test_what_the_runtime_cannot_hold_is_refused_with_a_fix(
    config_update, settings_update, field, gpu_config, tj_settings
):
    with pytest.raises(ValueError, match="Fix:") as info:
        build_trainjob(gpu_config.model_copy(update=config_update), tj_settings.model_copy(update=settings_update), RUN)
    assert field in str(info.value)


def test_settings_validation_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="trainer_api"):
        ClusterSettings.from_mapping({"trainer_api": "mpijob"})
    with pytest.raises(ConfigError, match="kueue_queue_name.*Fix"):
        ClusterSettings.from_mapping({"kueue_queue_name": "team-a"})
    assert (
        ClusterSettings.from_mapping({"trainer_api": "trainjob", "kueue_queue_name": "team-a"}).trainer_api
        == "trainjob"
    )


def test_wait_for_vllm_gets_todays_arguments_through_env(gpu_config, tj_settings):
    job = build_trainjob(gpu_config, tj_settings, RUN)
    (node,) = [
        p
        for p in job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        if p["name"] == NODE
    ]
    env = {e["name"]: e["value"] for e in node["template"]["spec"]["template"]["spec"]["initContainers"][0]["env"]}
    runtime_wait = _jobs(build_cluster_training_runtime(tj_settings))[NODE]["template"]["spec"]["template"]["spec"]
    cmd = runtime_wait["initContainers"][0]["command"]
    expanded = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in cmd]  # Kubernetes' $(VAR) expansion
    today = trainer_pod(gpu_config, tj_settings, RUN, None)["spec"]["initContainers"][0]["command"]
    assert expanded == today


def test_priority_class_reaches_pytorchjob_pods_too(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"priority_class_name": "high"})
    objs = build_run_objects(gpu_config, settings, RUN)
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["priorityClassName"] == "high"
    validate_any(job)


def test_the_pipelines_trainer_api_parameter_merges_into_the_cluster_settings():
    from async_grpo.config import ConfigError
    from async_grpo.launch.k8s_settings import with_trainer_api

    assert with_trainer_api({"namespace": "ml"}, "trainjob") == {"namespace": "ml", "trainer_api": "trainjob"}
    assert with_trainer_api({"trainer_api": "trainjob"}, "") == {"trainer_api": "trainjob"}
    assert with_trainer_api(None, "") == {}
    with pytest.raises(ConfigError, match="set it in one place"):
        with_trainer_api({"trainer_api": "trainjob"}, "pytorchjob")
