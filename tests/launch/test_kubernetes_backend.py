"""KubernetesBackend's create / wait / cleanup logic against a recording Kubernetes API double."""

from __future__ import annotations

import logging
import re

import pytest
from kubernetes.client import ApiException

from async_grpo.config import ConfigError, GRPOConfig
from async_grpo.launch.k8s_objects import build_run_objects
from async_grpo.launch.k8s_policy import PolicyViolation
from async_grpo.launch.kubernetes import (
    LAUNCHER_RBAC_RULES,
    KubernetesBackend,
    k8s_run_name,
    latest_condition,
    make_run_name,
)
from async_grpo.launch.platform_policy import PlatformPolicy

from ._api_double import FakeClock, FakeCluster, FakeTracking, condition, status
from .conftest import RUN

RUN_POD = f"{RUN}-master-0"
VLLM_POD = f"{RUN}-vllm-5d9c-x2"
TIMEOUT_S = 600.0
POLL_S = 10.0


def make_backend(
    cluster: FakeCluster, settings, clock: FakeClock | None = None, tracking: FakeTracking | None = None
) -> tuple[KubernetesBackend, FakeClock, FakeTracking]:
    clock = clock or FakeClock()
    tracking = tracking or FakeTracking()
    cluster.add_pod(RUN_POD, {"training.kubeflow.org/job-name": RUN, "training.kubeflow.org/replica-type": "master"})
    cluster.add_pod(VLLM_POD, {"async-grpo/run": RUN, "app.kubernetes.io/component": "vllm"})
    cluster.add_pod("unrelated", {"app": "other"})
    backend = KubernetesBackend(
        settings,
        **cluster.kwargs(),
        tracking=tracking,
        run_name=RUN,
        policy=PlatformPolicy(),
        poll_interval_s=POLL_S,
        clock=clock,
        sleep=clock.sleep,
    )
    return backend, clock, tracking


def kinds_left(cluster: FakeCluster) -> set[str]:
    return {kind for kind, _ in cluster.objects}


def test_success_keeps_the_job_and_deletes_vllm_and_rewards(gpu_config, gpu_settings, caplog):
    cluster = FakeCluster(
        [
            {},
            status(condition("Created")),
            status(condition("Created"), condition("Running")),
            status(condition("Created"), condition("Running"), condition("Succeeded")),
        ]
    )
    backend, clock, tracking = make_backend(cluster, gpu_settings)
    with caplog.at_level(logging.INFO, logger="async_grpo.launch.kubernetes"):
        result = backend.launch(gpu_config, timeout_s=TIMEOUT_S)

    assert result.mlflow_run_id == "mlflow-run-1" and result.tracking_uri == "http://mlflow:5000"
    assert result.model_dir == f"/workspace/runs/{RUN}/final-model"
    assert tracking.created == [("http://mlflow:5000", "async-grpo", RUN)] and tracking.ended == []
    # what stays: the finished job and what it owns (its config, tokens, Services and NetworkPolicies), removed
    # with it by its TTL; the Deployments (GPUs) are gone
    assert kinds_left(cluster) == {"PyTorchJob", "ConfigMap", "Secret", "Service", "NetworkPolicy"}
    # the job is created first and every other object is owned by it, so deleting the job deletes the run
    job_uid = cluster.objects[("PyTorchJob", RUN)]["metadata"]["uid"]
    creates = [c.args[-1] for c in cluster.calls if c.method.startswith("create_")]
    assert [o["kind"] for o in creates] == [
        "PyTorchJob",
        "ConfigMap",
        "Secret",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "Deployment",
        "Service",
        "Service",
        "Deployment",
    ]
    for obj in creates[1:]:
        assert obj["metadata"]["ownerReferences"][0]["uid"] == job_uid
    assert "patch_namespaced_config_map" not in cluster.methods()
    # only Deployments are deleted, the vLLM one (dev-mode endpoints, created last) first
    deletes = [(c.method, c.args[0]) for c in cluster.calls if c.method.startswith("delete_")]
    assert deletes == [
        ("delete_namespaced_deployment", f"{RUN}-vllm"),
        ("delete_namespaced_deployment", f"{RUN}-reward"),
    ]
    assert all(
        c.kwargs.get("propagation_policy") == "Background" for c in cluster.calls if c.method.startswith("delete_")
    )
    # the trainer logs into the pre-created MLflow run
    job = cluster.objects[("PyTorchJob", RUN)]
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MLFLOW_RUN_ID", "value": "mlflow-run-1"} in env
    # status changes are streamed, once each
    text = caplog.text
    assert text.count("PyTorchJob agrpo-test-abc123: Running") == 1 and "Succeeded" in text
    assert clock.sleeps == [POLL_S] * 3


def test_failed_job_surfaces_reason_and_logs_and_cleans_up(gpu_config, gpu_settings):
    failed = condition("Failed", "PyTorchJobFailed", f"PyTorchJob {RUN} is failed because 1 Master replica(s) failed.")
    cluster = FakeCluster(
        [status(condition("Created")), status(condition("Running")), status(condition("Running"), failed)],
        logs={RUN_POD: "step 3\nRuntimeError: CUDA out of memory", VLLM_POD: "INFO vLLM ready"},
    )
    backend, _, tracking = make_backend(cluster, gpu_settings)
    with pytest.raises(RuntimeError) as info:
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    msg = str(info.value)
    assert "PyTorchJobFailed" in msg and "1 Master replica(s) failed" in msg
    assert "CUDA out of memory" in msg and "INFO vLLM ready" in msg
    log_calls = [c for c in cluster.calls if c.method == "read_namespaced_pod_log"]
    assert [(c.args[0], c.kwargs["container"]) for c in log_calls] == [(RUN_POD, "pytorch"), (VLLM_POD, "vllm")]
    assert cluster.objects == {}  # the job deleted, and everything it owned with it
    assert tracking.ended == [("mlflow-run-1", "FAILED")]


def test_timeout_raises_and_cleans_up(gpu_config, gpu_settings):
    cluster = FakeCluster([status(condition("Created")), status(condition("Running"))])
    backend, clock, tracking = make_backend(cluster, gpu_settings)
    with pytest.raises(TimeoutError, match=r"did not finish within 60 s \(last condition: Running\)"):
        backend.launch(gpu_config, timeout_s=60)
    assert cluster.objects == {}
    assert clock.now == pytest.approx(60.0) and cluster.reads == 7  # polled every 10 s, then gave up
    assert tracking.ended == [("mlflow-run-1", "FAILED")]


def test_error_while_creating_deletes_what_was_created(gpu_config, gpu_settings):
    cluster = FakeCluster(fail_on_create="Deployment")
    backend, _, tracking = make_backend(cluster, gpu_settings)
    with pytest.raises(ApiException) as info:
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert info.value.status == 403
    assert cluster.objects == {}  # the job deleted; what it owned went with it
    deleted = [c.args[0] if c.api != "custom" else c.args[4] for c in cluster.calls if c.method.startswith("delete_")]
    assert deleted == [RUN]  # the job alone: the refused Deployment never existed
    assert "get_namespaced_custom_object" not in cluster.methods()  # never started waiting
    assert tracking.ended == [("mlflow-run-1", "FAILED")]


def test_cleanup_goes_on_when_one_delete_fails(gpu_config, gpu_settings, caplog):
    cluster = FakeCluster([status(condition("Failed", "Boom"))], fail_on_delete="Deployment")
    backend, _, _ = make_backend(cluster, gpu_settings)
    with pytest.raises(RuntimeError, match="Boom"):  # the run's error, not the cleanup's
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert cluster.objects == {}  # the Deployments go with the job anyway; the failed delete is logged
    assert "could not delete Deployment" in caplog.text and "kubectl delete -n team-a -l async-grpo/run=" in caplog.text


def test_interrupt_while_waiting_cleans_up_and_marks_the_run_killed(gpu_config, gpu_settings):
    cluster = FakeCluster([status(condition("Running"))])
    clock = FakeClock()

    def interrupted(_seconds):
        raise KeyboardInterrupt

    clock.sleep = interrupted
    backend, _, tracking = make_backend(cluster, gpu_settings, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert cluster.objects == {}
    assert tracking.ended == [("mlflow-run-1", "KILLED")]


def test_bad_config_fails_before_any_api_call(gpu_settings):
    cluster = FakeCluster()
    backend, _, tracking = make_backend(cluster, gpu_settings)
    with pytest.raises(ValueError, match="on Kubernetes the model folder must be a builtin, a normalized path"):
        backend.launch(GRPOConfig(model_name_or_path="Qwen/Qwen2.5-7B"), timeout_s=TIMEOUT_S)
    assert cluster.calls == [] and tracking.created == []


def test_a_registry_model_passes_the_volume_rule_but_no_other_field_does(gpu_settings):
    """`models:/` is resolved onto the volume by the train step before any pod starts; a dataset may not use it."""
    from async_grpo.launch.k8s_policy import path_problems

    assert path_problems(GRPOConfig(model_name_or_path="models:/m@champion"), gpu_settings) == []
    (problem,) = path_problems(GRPOConfig(dataset="models:/m@champion"), gpu_settings)
    assert problem.startswith("dataset='models:/m@champion'")


def test_job_deleted_behind_our_back_is_an_error(gpu_config, gpu_settings):
    cluster = FakeCluster([status(condition("Running"))])
    backend, clock, _ = make_backend(cluster, gpu_settings)
    clock_sleep = clock.sleep

    def delete_job_then_sleep(seconds):
        cluster.objects.pop(("PyTorchJob", RUN), None)
        clock_sleep(seconds)

    backend.sleep = delete_job_then_sleep
    with pytest.raises(RuntimeError, match="was deleted while the run was in progress"):
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    cluster.collect_garbage()  # the job was popped behind the fake's back
    assert cluster.objects == {}


def test_backend_calls_need_exactly_the_launcher_role(gpu_config, gpu_settings):
    """The union of what the backend calls over success and failure is exactly LAUNCHER_RBAC_RULES."""
    used: set[tuple[str, str, str]] = set()
    for statuses in ([status(condition("Succeeded"))], [status(condition("Failed"))]):
        cluster = FakeCluster(statuses)
        backend, _, _ = make_backend(cluster, gpu_settings)
        try:
            backend.launch(gpu_config, timeout_s=TIMEOUT_S)
        except RuntimeError:
            pass
        backend.cleanup(RUN)  # the exit handler's deletions by label
        with backend.reward_service(gpu_config, RUN):  # the evaluate step's reward service
            pass
        used |= cluster.rbac_used()
    assert not {(g, r, v) for g, r, v in used if r == "secrets" and v != "create"}  # never reads or deletes one
    granted = {(group, res, verb) for (group, res), verbs in LAUNCHER_RBAC_RULES.items() for verb in verbs}
    assert used == granted


def test_latest_condition_prefers_terminal_states():
    st = {"conditions": [condition("Created"), dict(condition("Running"), status="False"), condition("Succeeded")]}
    assert latest_condition(st)["type"] == "Succeeded"
    assert latest_condition({"conditions": [condition("Created"), condition("Running")]})["type"] == "Running"
    assert latest_condition({}) == {}


@pytest.mark.parametrize("run_name", [None, "Qwen 7B / GSM8K — ünïcode run name that is far too long for k8s"])
def test_run_names_are_dns_labels(run_name):
    config = GRPOConfig(run_name=run_name)
    names = {make_run_name(config.tracking) for _ in range(5)}
    assert len(names) == 5
    for name in names | {make_run_name(config.tracking, unique=False)}:
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name), name


def test_options_dict_becomes_settings(gpu_settings, tmp_path, monkeypatch):
    """The pipeline passes `kubernetes_options` as keyword arguments; no cluster is contacted to build it."""
    monkeypatch.setattr("async_grpo.launch.kubernetes.SA_NAMESPACE_FILE", tmp_path / "not-in-a-pod")
    backend = KubernetesBackend(gpu_settings, namespace="ml", trainer_nodes=4)
    assert backend.settings.namespace == "ml" and backend.settings.trainer_nodes == 4
    assert backend.settings.nproc_per_node == 8  # the rest from `settings`
    assert KubernetesBackend(**{"device": "cpu"}).settings.device == "cpu"
    assert KubernetesBackend().settings.namespace == "async-grpo"


def test_in_a_pod_the_namespace_defaults_to_the_pods(tmp_path, monkeypatch):
    ns_file = tmp_path / "namespace"
    ns_file.write_text("kubeflow-user-example-com\n")
    monkeypatch.setattr("async_grpo.launch.kubernetes.SA_NAMESPACE_FILE", ns_file)
    assert KubernetesBackend().settings.namespace == "kubeflow-user-example-com"
    assert KubernetesBackend(namespace="kubeflow-user-example-com").settings.namespace == "kubeflow-user-example-com"
    with pytest.raises(PolicyViolation, match="namespace='ml' is not this launcher's namespace"):
        KubernetesBackend(namespace="ml")  # a submitter's kubernetes_options never reach another namespace


def test_bad_options_fail_early():
    with pytest.raises(ConfigError, match=r"cluster settings:\n  trainer_nodez: unknown field.*ClusterSettings"):
        KubernetesBackend(trainer_nodez=2)


def test_named_runs_use_their_name_and_cleanup_finds_them(gpu_config, gpu_settings):
    """launch(config with run_name) and cleanup(run_name) agree on object names, whatever the name."""
    for run_name in ("my-run-1", "Nightly GSM8K run for the Qwen2.5 7B model, take 2"):
        cluster = FakeCluster([status(condition("Succeeded"))])
        backend = KubernetesBackend(
            gpu_settings, **cluster.kwargs(), tracking=FakeTracking(), sleep=lambda s: None, policy=PlatformPolicy()
        )
        result = backend.launch(gpu_config.model_copy(update={"run_name": run_name}), timeout_s=TIMEOUT_S)
        name = k8s_run_name(run_name)
        assert ("PyTorchJob", name) in cluster.objects
        assert result.model_dir == f"/workspace/runs/{name}/final-model"
        assert backend.cleanup(run_name) == [f"PyTorchJob/{name}"]
        assert cluster.objects == {}
    assert k8s_run_name("my-run-1") == "my-run-1"


def _leave_behind(cluster: FakeCluster, objs: list[dict]) -> None:
    """Objects a killed launcher left on the cluster (the API server gave each a uid)."""
    for obj in objs:
        cluster._create(obj["kind"], obj)


def _leave_behind_owned(cluster: FakeCluster, objs: list[dict]) -> None:
    """A killed launch's objects as `launch` creates them: the PyTorchJob first, every other object owned by it."""
    job = next(o for o in objs if o["kind"] == "PyTorchJob")
    owner = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": job["metadata"]["name"],
        "uid": cluster._create("PyTorchJob", job)["metadata"]["uid"],
    }
    for obj in objs:
        if obj is not job:
            cluster._create(obj["kind"], {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}})


def test_cleanup_of_a_killed_launch_deletes_every_object(gpu_config, gpu_settings):
    cluster = FakeCluster()
    backend, _, _ = make_backend(cluster, gpu_settings)
    _leave_behind_owned(cluster, build_run_objects(gpu_config, gpu_settings, RUN))
    removed = backend.cleanup(RUN)
    assert removed == [f"Deployment/{RUN}-reward", f"Deployment/{RUN}-vllm", f"PyTorchJob/{RUN}"]  # workloads first
    assert cluster.objects == {}  # the rest was owned by the job
    assert backend.cleanup(RUN) == []  # idempotent
    lists = [c for c in cluster.calls if c.method.startswith("list_") and c.method != "list_namespaced_pod"]
    assert {c.kwargs["label_selector"] for c in lists} == {
        f"async-grpo/run={RUN},app.kubernetes.io/managed-by=async-grpo"
    }
    for call in (c for c in cluster.calls if c.method.startswith("delete_")):
        assert call.kwargs["body"]["preconditions"]["uid"].startswith("uid-")  # by uid, never by bare name


def test_cleanup_never_touches_another_run_or_an_unlabelled_namesake(gpu_config, gpu_settings):
    """Two runs submitted with the same name get different object names (the pipeline adds the run id), and
    even a namesake without the run's label survives: cleanup selects by label, deletes by uid."""
    cluster = FakeCluster()
    backend, _, _ = make_backend(cluster, gpu_settings)
    other = f"{RUN}x"  # a name the old prefix-and-suffix deletion would have confused with ours
    _leave_behind_owned(cluster, build_run_objects(gpu_config, gpu_settings, RUN))
    _leave_behind_owned(cluster, build_run_objects(gpu_config, gpu_settings, other))
    stranger = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{RUN}-vllm2", "labels": {}}}
    _leave_behind(cluster, [stranger])
    backend.cleanup(RUN)
    assert {name for kind, name in cluster.objects} == (
        {o["metadata"]["name"] for o in build_run_objects(gpu_config, gpu_settings, other)} | {f"{RUN}-vllm2"}
    )


def test_a_run_name_in_use_is_a_clear_error(gpu_config, gpu_settings):
    cluster = FakeCluster([status(condition("Succeeded"))])
    backend, _, _ = make_backend(cluster, gpu_settings)
    backend.launch(gpu_config, timeout_s=TIMEOUT_S)  # leaves the finished job
    with pytest.raises(RuntimeError, match=f"a run named '{RUN}' is there.*delete pytorchjob {RUN}"):
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert kinds_left(cluster) == {"PyTorchJob", "ConfigMap", "Secret", "Service", "NetworkPolicy"}  # old run intact
    assert len(cluster.objects) == len(build_run_objects(gpu_config, gpu_settings, RUN)) - 2  # minus its Deployments


def test_mlflow_run_tracking_creates_the_run_the_trainer_resumes(tmp_path):
    """Against a real (sqlite) MLflow store: the experiment is created once, the run ends as told."""
    from mlflow import MlflowClient

    from async_grpo.launch.kubernetes import MlflowRunTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = MlflowRunTracking()
    first = tracking.create_run(uri, "exp-k8s", "run-a")
    second = tracking.create_run(uri, "exp-k8s", "run-b")
    client = MlflowClient(uri)
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("exp-k8s").experiment_id])}
    assert set(runs) == {first, second} and runs[first].info.run_name == "run-a"
    assert runs[first].data.tags["async_grpo.backend"] == "kubernetes"
    tracking.end_run(uri, first, "FAILED")
    assert client.get_run(first).info.status == "FAILED" and client.get_run(second).info.status == "RUNNING"


@pytest.mark.parametrize(
    "option, message",
    [
        (
            {"trainer_image": "docker.io/evil/x:latest"},
            "trainer_image='docker.io/evil/x:latest' is not an allowed image",
        ),
        ({"service_account": "default"}, "service_account='default' is not allowed"),
        ({"mlflow_secret": "mlflow-postgres"}, "mlflow_secret='mlflow-postgres' is not an allowed secret"),
        ({"pvc_name": "mlflow-data"}, "pvc_name='mlflow-data' is not an allowed workspace volume"),
    ],
)
@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_the_policy_refuses_before_any_api_call(gpu_config, gpu_settings, option, message, api):
    cluster = FakeCluster()
    backend, _, tracking = make_backend(cluster, gpu_settings.model_copy(update={**option, "trainer_api": api}))
    with pytest.raises(PolicyViolation, match=re.escape(message)):
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert cluster.calls == [] and tracking.created == []


def test_a_foreign_tracking_uri_never_receives_the_credentials(gpu_config, gpu_settings):
    cluster = FakeCluster()
    backend, _, tracking = make_backend(cluster, gpu_settings)
    with pytest.raises(PolicyViolation, match="mlflow_tracking_uri='https://collector.example.com' is not an allowed"):
        backend.launch(
            gpu_config.model_copy(update={"mlflow_tracking_uri": "https://collector.example.com"}), timeout_s=TIMEOUT_S
        )
    assert tracking.created == [] and cluster.calls == []


def test_the_policy_default_images_are_used_and_placeholders_refused(gpu_config, gpu_settings):
    pinned = "registry.corp/async-grpo/{}@sha256:" + "a" * 64
    policy = PlatformPolicy(
        image_prefixes=["registry.corp/async-grpo/"],
        require_digest=True,
        default_images={r: pinned.format(r) for r in ("trainer", "vllm", "reward")},
    )
    cluster = FakeCluster([status(condition("Succeeded"))])
    backend = KubernetesBackend(
        gpu_settings, **cluster.kwargs(), tracking=FakeTracking(), run_name=RUN, policy=policy, sleep=lambda s: None
    )
    backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    job = cluster.objects[("PyTorchJob", RUN)]
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == pinned.format(
        "trainer"
    )
    placeholder = PlatformPolicy(default_images={"trainer": "ghcr.io/async-grpo/trainer@sha256:" + "0" * 64})
    backend = KubernetesBackend(gpu_settings, **FakeCluster().kwargs(), tracking=FakeTracking(), policy=placeholder)
    with pytest.raises(PolicyViolation, match="carries the placeholder digest"):
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)


def test_the_evaluate_steps_reward_service_lives_only_inside_the_block(gpu_config, gpu_settings):
    cluster = FakeCluster()
    backend, _, _ = make_backend(cluster, gpu_settings)
    with backend.reward_service(gpu_config, RUN) as (url, token):
        assert url == f"http://{RUN}-eval-reward.team-a.svc.cluster.local:8080" and len(token) >= 32
        inside = dict(cluster.objects)
        assert {k for k, _ in inside} == {"ConfigMap", "Secret", "Deployment", "Service", "NetworkPolicy"}
        secret = inside[("Secret", f"{RUN}-eval-tokens")]
        assert secret["stringData"]["reward-token"] == token
        dep_uid = inside[("Deployment", f"{RUN}-eval-reward")]["metadata"]["uid"]
        for key, obj in inside.items():  # everything goes with the Deployment
            if key[0] != "Deployment":
                assert obj["metadata"]["ownerReferences"][0]["uid"] == dep_uid, key
    assert cluster.objects == {}


# ------------------------------------------------------------------------------------------------ Trainer v2
def test_trainjob_path_creates_waits_and_keeps_the_job_after_success(gpu_config, gpu_settings, caplog):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    cluster = FakeCluster([{}, status(condition("Created")), status(condition("Created"), condition("Complete"))])
    backend, clock, tracking = make_backend(cluster, settings)
    with caplog.at_level(logging.INFO, logger="async_grpo.launch.kubernetes"):
        result = backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert result.mlflow_run_id == "mlflow-run-1" and tracking.ended == []
    creates = [c for c in cluster.calls if c.method.startswith("create_")]
    assert [c.args[-1]["kind"] for c in creates] == ["TrainJob", "ConfigMap", "Secret"] + ["NetworkPolicy"] * 3
    assert creates[0].args[:4] == ("trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs")
    job = cluster.objects[("TrainJob", RUN)]
    assert job["spec"]["runtimeRef"]["name"] == "async-grpo"
    assert {"name": "MLFLOW_RUN_ID", "value": "mlflow-run-1"} in job["spec"]["trainer"]["env"]
    for obj in (c.args[-1] for c in creates[1:]):
        assert obj["metadata"]["ownerReferences"][0] == {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "name": RUN,
            "uid": job["metadata"]["uid"],
        }
    assert not [c for c in cluster.calls if c.method.startswith("delete_")]  # kept after success, like PyTorchJob
    assert kinds_left(cluster) == {"TrainJob", "ConfigMap", "Secret", "NetworkPolicy"}
    assert "TrainJob agrpo-test-abc123: Complete" in caplog.text
    from async_grpo.launch.k8s_api import TRAINJOB_RBAC_RULES

    granted = {(g, r, v) for (g, r), verbs in {**LAUNCHER_RBAC_RULES, **TRAINJOB_RBAC_RULES}.items() for v in verbs}
    assert ("trainer.kubeflow.org", "trainjobs", "get") in cluster.rbac_used() <= granted


def test_trainjob_failure_deletes_it_and_its_objects_and_reports_the_trainer_logs(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    cluster = FakeCluster(
        [{}, status(condition("Failed", "JobSetFailed", "node exited 1"))], logs={"node-0": "Traceback: boom"}
    )
    backend, _, tracking = make_backend(cluster, settings)
    cluster.add_pod("node-0", {"jobset.sigs.k8s.io/jobset-name": RUN, "jobset.sigs.k8s.io/replicatedjob-name": "node"})
    with pytest.raises(RuntimeError, match="TrainJob agrpo-test-abc123 failed: JobSetFailed") as info:
        backend.launch(gpu_config, timeout_s=TIMEOUT_S)
    assert "Traceback: boom" in str(info.value)
    deletes = [(c.method, c.args[3], c.args[4]) for c in cluster.calls if c.method.startswith("delete_")]
    assert deletes == [("delete_namespaced_custom_object", "trainjobs", RUN)]
    assert cluster.objects == {} and tracking.ended == [("mlflow-run-1", "FAILED")]


def test_trainjob_timeout_deletes_it(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    cluster = FakeCluster([status(condition("Created"))])
    backend, _, _ = make_backend(cluster, settings)
    with pytest.raises(TimeoutError, match="describe trainjob"):
        backend.launch(gpu_config, timeout_s=3 * POLL_S)
    assert cluster.objects == {}
