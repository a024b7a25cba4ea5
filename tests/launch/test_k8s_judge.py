"""The LLM judge a Kubernetes run serves (`builtin:llm_judge` + `judge_model_name_or_path`, issue 26): its
Deployment and Service, its own token, its NetworkPolicies, the platform policy's checks, the backend's create and
delete, and the trainjob path's refusal."""

from __future__ import annotations

import pytest
import yaml

from async_grpo.config import GRPOConfig, flat_dump
from async_grpo.inference.server import build_server_command
from async_grpo.launch.k8s_judge import judge_url
from async_grpo.launch.k8s_objects import ClusterSettings, build_run_objects, trainer_config
from async_grpo.launch.k8s_policy import PolicyViolation, check_run
from async_grpo.launch.k8s_trainjob import build_objects_for_api, check_trainjob_run
from async_grpo.launch.kubernetes import LAUNCHER_RBAC_RULES
from async_grpo.launch.platform_policy import PlatformPolicy

from ._api_double import FakeCluster, condition, status
from ._k8s_validate import REPO, validate_any
from .conftest import RUN
from .test_cli_render import run_cli
from .test_k8s_objects import _by_kind, _env, _pods, _secrets_used
from .test_kubernetes_backend import TIMEOUT_S, make_backend
from .test_network_policy import DNS, admitted, pod, reaches

JUDGE_MODEL = "/workspace/models/Qwen2.5-7B-Instruct"
JUDGED = {"reward_funcs": ["builtin:reverse_exact_match", "builtin:llm_judge"], "judge_model_name_or_path": JUDGE_MODEL}
TOKENS = f"{RUN}-tokens"
POLICY = PlatformPolicy()


@pytest.fixture
def judged_config(gpu_config) -> GRPOConfig:
    return GRPOConfig.model_validate({**flat_dump(gpu_config), **JUDGED})


def _objects(config, settings):
    return _by_kind(build_run_objects(config, settings, RUN))


# ------------------------------------------------------------------------------------------------ render
def test_render_of_the_2x8_example_with_a_judge_writes_valid_judge_objects(tmp_path, capsys):
    out = tmp_path / "out"
    example = REPO / "manifests/examples/gpu-2x8"
    rc = run_cli(
        [
            "render",
            str(example / "config.yaml"),
            "reward_funcs=[/workspace/rewards/gsm8k.py:accuracy, builtin:llm_judge]",
            f"judge_model_name_or_path={JUDGE_MODEL}",
            "--backend",
            "kubernetes",
            "-o",
            str(out),
            "--settings",
            str(example / "settings.yaml"),
            "--set",
            "judge_gpus=4",
        ]
    )
    assert rc == 0 and "wrote 13 objects" in capsys.readouterr().out
    names = yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    objs = _by_kind([yaml.safe_load((out / name).read_text()) for name in names])
    for obj in objs.values():
        validate_any(obj)
    deployment = objs[("Deployment", "example-gpu-judge")]
    service = objs[("Service", "example-gpu-judge")]
    assert ("NetworkPolicy", "example-gpu-judge") in objs
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert (
        container["image"]
        == objs[("Deployment", "example-gpu-vllm")]["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and spec["tolerations"]
    assert {"readinessProbe", "startupProbe", "livenessProbe"} <= set(container)
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    cmd = container["command"]
    assert cmd[cmd.index("--model") + 1] == JUDGE_MODEL
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4" and "--middleware" in cmd
    assert "--weight-transfer-config" not in cmd and "--worker-extension-cls" not in cmd
    assert "VLLM_SERVER_DEV_MODE" not in _env(container)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert "clusterIP" not in service["spec"]  # a ClusterIP Service: the launcher pins its address (hostAliases)
    # the pods' config asks the run's judge Service, under the name the judge serves
    cm = yaml.safe_load(objs[("ConfigMap", "example-gpu-config")]["data"]["config.yaml"])
    assert cm["judge_url"] == "http://example-gpu-judge.async-grpo.svc.cluster.local:8000/v1"
    assert cm["judge_model"] == JUDGE_MODEL and "judge_model_name_or_path" not in cm


def test_without_a_judge_nothing_judge_is_built(gpu_config, gpu_settings):
    objs = _objects(gpu_config, gpu_settings)
    assert not [key for key in objs if "judge" in key[1]]
    assert set(objs[("Secret", TOKENS)]["stringData"]) == {"vllm-api-key", "reward-token"}
    assert "judge_url" not in objs[("ConfigMap", f"{RUN}-config")]["data"]["config.yaml"]
    # a judge model without builtin:llm_judge is not served either
    unused = gpu_config.model_copy(update={"judge_model_name_or_path": JUDGE_MODEL})
    assert not [key for key in _objects(unused, gpu_settings) if "judge" in key[1]]


def test_build_server_command_without_weight_transfer_is_a_plain_server():
    plain = build_server_command("/m", port=1, weight_transfer_backend=None, cpu=False)
    default = build_server_command("/m", port=1, cpu=False)
    assert "--weight-transfer-config" not in plain and "--worker-extension-cls" not in plain
    weight_transfer = {"--weight-transfer-config", '{"backend": "gloo"}', "--worker-extension-cls"}
    assert plain == [a for a in default if a not in weight_transfer and not a.endswith("GlooWorkerExtension")]


# ------------------------------------------------------------------------------------------------ tokens
def test_the_judge_token_reaches_only_the_judge_and_the_pods_that_ask_it(judged_config, gpu_settings):
    objs = _objects(judged_config, gpu_settings)
    secret = objs[("Secret", TOKENS)]["stringData"]
    assert set(secret) == {"vllm-api-key", "reward-token", "judge-api-key"} and len(set(secret.values())) == 3
    pods = _pods(list(objs.values()))
    assert _secrets_used(pods["judge"]) == {(TOKENS, "judge-api-key")}
    assert _secrets_used(pods["reward"]) == {(TOKENS, "reward-token"), (TOKENS, "judge-api-key")}
    assert (TOKENS, "vllm-api-key") not in _secrets_used(pods["reward"])
    assert (TOKENS, "judge-api-key") not in _secrets_used(pods["trainer-Master"])
    assert _secrets_used(pods["vllm"]) == {(TOKENS, "vllm-api-key")}
    judge_env = _env(pods["judge"]["containers"][0])
    assert judge_env["VLLM_API_KEY"]["secretKeyRef"]["key"] == "judge-api-key"
    assert _env(pods["reward"]["containers"][0])["ASYNC_GRPO_JUDGE_API_KEY"]["secretKeyRef"]["key"] == "judge-api-key"
    for name, spec in pods.items():
        assert spec["automountServiceAccountToken"] is False, name
    # reward pods wait for the judge, the trainer for the reward pods
    assert [c["name"] for c in pods["reward"]["initContainers"]] == ["wait-for-judge"]
    assert [c["name"] for c in pods["trainer-Master"]["initContainers"]] == ["wait-for-vllm", "wait-for-rewards"]


def test_without_reward_pods_the_trainer_asks_the_judge(judged_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"reward_replicas": 0})
    objs = _objects(judged_config, settings)
    pods = _pods(list(objs.values()))
    assert "reward" not in pods
    assert (TOKENS, "judge-api-key") in _secrets_used(pods["trainer-Master"])
    assert [c["name"] for c in pods["trainer-Master"]["initContainers"]] == ["wait-for-vllm", "wait-for-judge"]
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    trainer = pods_labels(objs)["trainer"]
    judge = pods_labels(objs)["judge"]
    assert admitted(policies, trainer, judge, settings.vllm_port) and reaches(policies, trainer, pod(judge), 8000)


def test_an_outside_reward_service_cannot_ask_the_runs_judge(judged_config, gpu_settings):
    outside = judged_config.model_copy(update={"reward_url": "http://rewards.ml.svc:8080"})
    with pytest.raises(ValueError, match=r"judge_model_name_or_path with reward_url=.*Fix: drop reward_url"):
        trainer_config(outside, gpu_settings.model_copy(update={"reward_replicas": 0}), RUN)


# ------------------------------------------------------------------------------------------------ network
def pods_labels(objs: dict) -> dict[str, dict[str, str]]:
    """component -> pod labels of the run's Deployments and its trainer."""
    out = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objs.values()
        if o["kind"] == "Deployment"
    }
    job = objs[("PyTorchJob", RUN)]
    out["trainer"] = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    return out


def test_the_judge_admits_only_the_runs_reward_pods_which_reach_only_it(judged_config, gpu_config, gpu_settings):
    objs = _objects(judged_config, gpu_settings)
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    labels = pods_labels(objs)
    judge, reward, port = labels["judge"], labels["reward"], gpu_settings.vllm_port
    assert labels["judge"]["app.kubernetes.io/component"] == "judge" and labels["judge"]["async-grpo/run"] == RUN
    assert admitted(policies, reward, judge, port)
    assert not admitted(policies, reward, judge, port + 1)
    for stranger in ("trainer", "vllm"):
        assert not admitted(policies, labels[stranger], judge, port), stranger
    assert not admitted(policies, {**reward, "async-grpo/run": "agrpo-other-ffffff"}, judge, port)
    # reward pods reach the judge and nothing else (still no DNS, no vLLM); the judge reaches nothing
    assert reaches(policies, reward, pod(judge), port)
    assert not reaches(policies, reward, DNS, 53, "UDP") and not reaches(policies, reward, pod(labels["vllm"]), port)
    assert not reaches(policies, judge, DNS, 53, "UDP") and not reaches(policies, judge, {"ip": "1.1.1.1"}, 443)
    # the trainer and vLLM keep exactly their policies: the trainer does not reach the judge
    plain = _objects(gpu_config, gpu_settings)
    for name in (f"{RUN}-trainer", f"{RUN}-vllm"):
        assert objs[("NetworkPolicy", name)] == plain[("NetworkPolicy", name)]
    assert not reaches(policies, labels["trainer"], pod(judge), port)


# ------------------------------------------------------------------------------------------------ policy
def refused(config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy = POLICY) -> str:
    with pytest.raises(PolicyViolation) as info:
        check_run(config, settings, policy)
    assert "Fix:" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "model", ["Qwen/Qwen2.5-7B-Instruct", "models:/judge/1", "builtin:tiny", "/etc/judge", "/workspace/../etc"]
)
def test_a_judge_model_off_the_volume_is_refused(model, judged_config, gpu_settings):
    msg = refused(judged_config.model_copy(update={"judge_model_name_or_path": model}), gpu_settings)
    assert f"judge_model_name_or_path={model!r}" in msg and "shared volume" in msg


def test_the_judge_runs_the_vllm_image_and_obeys_its_checks(judged_config, gpu_settings):
    msg = refused(judged_config, gpu_settings.model_copy(update={"vllm_image": "docker.io/evil/vllm:1"}))
    assert "vllm_image='docker.io/evil/vllm:1' is not an allowed image" in msg


def test_too_many_judge_gpus_are_refused(judged_config, gpu_settings):
    capped = PlatformPolicy(max_gpus_per_pod=8)
    check_run(judged_config, gpu_settings.model_copy(update={"judge_gpus": 8}), capped)
    msg = refused(judged_config, gpu_settings.model_copy(update={"judge_gpus": 16}), capped)
    assert "judge_gpus=16 asks for more GPUs per pod than the platform allows (8)" in msg
    assert "vllm_gpus" not in msg and "nproc_per_node" not in msg
    check_run(judged_config, gpu_settings.model_copy(update={"judge_gpus": 16}), PlatformPolicy())  # no cap


def test_render_refuses_a_disallowed_judge_with_exit_2(tmp_path, capsys):
    judged = ["reward_funcs=[builtin:llm_judge]", "judge_model_name_or_path=Qwen/Qwen2.5-7B-Instruct"]
    config = str(REPO / "manifests/examples/gpu-2x8/config.yaml")
    assert run_cli(["render", config, *judged, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert (
        "the platform policy refuses this run" in err and "judge_model_name_or_path='Qwen/Qwen2.5-7B-Instruct'" in err
    )
    assert not (tmp_path / "o").exists()


def test_the_runs_own_judge_url_needs_no_judge_urls_entry_a_submitters_does(judged_config, gpu_settings):
    check_run(judged_config, gpu_settings, PlatformPolicy())  # judge_urls is empty
    served = trainer_config(judged_config, gpu_settings, RUN)
    assert served.rewards.judge_url == judge_url(RUN, gpu_settings)
    given = judged_config.model_copy(
        update={"judge_model_name_or_path": None, "judge_url": "http://judge.example.com/v1"}
    )
    assert "judge_url='http://judge.example.com/v1' is not an allowed LLM judge" in refused(given, gpu_settings)


def test_trainjob_refuses_a_judge_model_and_names_the_fix(judged_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    with pytest.raises(
        ValueError, match=r"judge_model_name_or_path='/workspace.*trainer_api: trainjob.*Fix:.*judge_url"
    ):
        check_trainjob_run(judged_config, settings)
    with pytest.raises(ValueError, match="judge_model_name_or_path"):
        build_objects_for_api(judged_config, settings, RUN)


# ------------------------------------------------------------------------------------------------ backend
def test_the_backend_creates_the_judge_pins_its_address_and_deletes_it_with_the_run(judged_config, gpu_settings):
    cluster = FakeCluster([status(condition("Failed"))])
    backend, _, _ = make_backend(cluster, gpu_settings)
    created: dict[tuple[str, str], dict] = {}
    real_create = cluster._create

    def remember(kind, body):
        live = real_create(kind, body)
        created[(kind, body["metadata"]["name"])] = live
        return live

    cluster._create = remember
    with pytest.raises(RuntimeError, match="failed"):
        backend.launch(judged_config, timeout_s=TIMEOUT_S)
    kinds = [
        (c.args[-1]["kind"], c.args[-1]["metadata"]["name"]) for c in cluster.calls if c.method.startswith("create_")
    ]
    assert kinds.index(("Service", f"{RUN}-judge")) < kinds.index(("Deployment", f"{RUN}-reward"))
    assert ("Deployment", f"{RUN}-judge") in kinds and ("NetworkPolicy", f"{RUN}-judge") in kinds
    job_uid = created[("PyTorchJob", RUN)]["metadata"]["uid"]
    for key in (("Service", f"{RUN}-judge"), ("Deployment", f"{RUN}-judge")):
        assert created[key]["metadata"]["ownerReferences"][0]["uid"] == job_uid
    ip = created[("Service", f"{RUN}-judge")]["spec"]["clusterIP"]
    reward = created[("Deployment", f"{RUN}-reward")]["spec"]["template"]["spec"]
    assert reward["hostAliases"] == [{"ip": ip, "hostnames": [f"{RUN}-judge.team-a.svc.cluster.local"]}]
    validate_any(created[("Deployment", f"{RUN}-reward")])
    deletes = [c.args[0] for c in cluster.calls if c.method == "delete_namespaced_deployment"]
    assert deletes == [f"{RUN}-vllm", f"{RUN}-reward", f"{RUN}-judge"]
    assert cluster.objects == {}  # the job went too, and with it everything it owned


def test_cleanup_by_label_deletes_the_judge_and_the_calls_stay_within_the_role(judged_config, gpu_settings):
    cluster = FakeCluster([status(condition("Succeeded"))])
    backend, _, _ = make_backend(cluster, gpu_settings)
    backend.launch(judged_config, timeout_s=TIMEOUT_S)
    assert ("Deployment", f"{RUN}-judge") not in cluster.objects  # deleted after success
    assert ("Service", f"{RUN}-judge") in cluster.objects  # owned by the kept job, goes with it
    cluster.objects[("Deployment", f"{RUN}-judge")] = {  # as if a killed launcher left it
        "kind": "Deployment",
        "metadata": {"name": f"{RUN}-judge", "uid": "uid-left", "labels": pods_labels_of_run()},
    }
    assert f"Deployment/{RUN}-judge" in backend.cleanup(RUN)
    granted = {(group, res, verb) for (group, res), verbs in LAUNCHER_RBAC_RULES.items() for verb in verbs}
    assert cluster.rbac_used() <= granted


def pods_labels_of_run() -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": "async-grpo",
        "app.kubernetes.io/managed-by": "async-grpo",
        "app.kubernetes.io/component": "judge",
        "async-grpo/run": RUN,
    }
