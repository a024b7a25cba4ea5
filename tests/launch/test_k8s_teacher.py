"""The distillation teacher a Kubernetes run serves (`teacher_model_name_or_path`, issue 52), policed as the run's LLM
judge is: its Deployment and Service (a plain vLLM one token longer than the policy's), its own token reaching only
the trainer pods, its NetworkPolicies, the platform policy's checks (the volume, the GPU cap, `teacher_urls` for a
submitter's teacher), the backend's create and delete, and the trainjob path's refusal."""

from __future__ import annotations

import pytest
import yaml

from async_grpo.config import GRPOConfig, flat_dump
from async_grpo.launch.k8s_objects import ClusterSettings, build_run_objects, trainer_config
from async_grpo.launch.k8s_policy import PolicyViolation, check_run
from async_grpo.launch.k8s_teacher import teacher_command, teacher_url
from async_grpo.launch.k8s_trainjob import build_objects_for_api, check_trainjob_run
from async_grpo.launch.kubernetes import LAUNCHER_RBAC_RULES
from async_grpo.launch.platform_policy import PlatformPolicy, load_policy

from ._api_double import FakeCluster, condition, status
from ._k8s_validate import REPO, validate_any
from .conftest import RUN
from .test_cli_render import run_cli
from .test_k8s_judge import JUDGED, pods_labels
from .test_k8s_objects import _by_kind, _env, _pods, _secrets_used
from .test_kubernetes_backend import TIMEOUT_S, make_backend
from .test_network_policy import DNS, admitted, pod, reaches

TEACHER_MODEL = "/workspace/models/Qwen2.5-7B-Instruct"
TOKENS = f"{RUN}-tokens"
POLICY = PlatformPolicy()


@pytest.fixture
def distilled_config(gpu_config) -> GRPOConfig:
    return gpu_config.model_copy(update={"teacher_model_name_or_path": TEACHER_MODEL})


def _objects(config, settings):
    return _by_kind(build_run_objects(config, settings, RUN))


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# ------------------------------------------------------------------------------------------------ render
def test_render_of_the_2x8_example_with_a_teacher_writes_valid_teacher_objects(tmp_path, capsys):
    out = tmp_path / "out"
    example = REPO / "manifests/examples/gpu-2x8"
    rc = run_cli(
        [
            "render",
            str(example / "config.yaml"),
            f"teacher_model_name_or_path={TEACHER_MODEL}",
            "--backend",
            "kubernetes",
            "-o",
            str(out),
            "--settings",
            str(example / "settings.yaml"),
            "--set",
            "teacher_gpus=4",
        ]
    )
    assert rc == 0 and "wrote 13 objects" in capsys.readouterr().out
    names = yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    objs = _by_kind([yaml.safe_load((out / name).read_text()) for name in names])
    for obj in objs.values():
        validate_any(obj)
    deployment = objs[("Deployment", "example-gpu-teacher")]
    service = objs[("Service", "example-gpu-teacher")]
    assert ("NetworkPolicy", "example-gpu-teacher") in objs
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["name"] == "teacher"
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    vllm = objs[("Deployment", "example-gpu-vllm")]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == vllm["image"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and spec["tolerations"]
    assert {"readinessProbe", "startupProbe", "livenessProbe"} <= set(container)
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    cmd = container["command"]
    assert _flag(cmd, "--model") == TEACHER_MODEL
    assert _flag(cmd, "--tensor-parallel-size") == "4" and "--middleware" in cmd
    assert "--weight-transfer-config" not in cmd and "--worker-extension-cls" not in cmd
    assert "VLLM_SERVER_DEV_MODE" not in _env(container)
    # one token longer than the policy's server: the whole sequence is the teacher's prompt, plus one generated
    assert int(_flag(cmd, "--max-model-len")) == int(_flag(vllm["command"], "--max-model-len"))  # the policy's
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert "clusterIP" not in service["spec"]
    # the pods' config asks the run's teacher Service, under the name the teacher serves
    cm = yaml.safe_load(objs[("ConfigMap", "example-gpu-config")]["data"]["config.yaml"])
    assert cm["teacher_url"] == "http://example-gpu-teacher.async-grpo.svc.cluster.local:8000/v1"
    assert cm["teacher_model"] == TEACHER_MODEL and "teacher_model_name_or_path" not in cm


def test_without_a_teacher_nothing_teacher_is_built(gpu_config, gpu_settings):
    objs = _objects(gpu_config, gpu_settings)
    assert not [key for key in objs if "teacher" in key[1]]
    assert set(objs[("Secret", TOKENS)]["stringData"]) == {"vllm-api-key", "reward-token"}
    assert "teacher" not in objs[("ConfigMap", f"{RUN}-config")]["data"]["config.yaml"]
    trainer = _pods(list(objs.values()))["trainer-Master"]
    assert "ASYNC_GRPO_TEACHER_API_KEY" not in _env(trainer["containers"][0])


def test_the_teacher_command_is_plain_and_one_token_longer(distilled_config, cpu_settings):
    cmd = teacher_command(distilled_config.model_copy(update={"vllm_max_model_len": 1024}), cpu_settings)
    assert _flag(cmd, "--max-model-len") == "1024" and _flag(cmd, "--model") == TEACHER_MODEL
    assert "--enforce-eager" in cmd and "--tensor-parallel-size" not in cmd  # the CPU build's flags, no TP on cpu
    assert _flag(cmd, "--max-num-batched-tokens") == "2048"
    assert "--gpu-memory-utilization" not in cmd  # the policy server's vllm_extra_args size the policy's server
    with pytest.raises(ValueError, match="teacher_model_name_or_path is not set.*Fix"):
        teacher_command(distilled_config.model_copy(update={"teacher_model_name_or_path": None}), cpu_settings)
    assert "--max-logprobs" not in cmd  # reverse_kl asks no top-k


def test_a_top_k_teacher_above_vllms_default_gets_max_logprobs(distilled_config, gpu_settings):
    forward = distilled_config.model_copy(update={"distillation_loss": "forward_kl", "distillation_topk": 64})
    assert _flag(teacher_command(forward, gpu_settings), "--max-logprobs") == "64"
    default = forward.model_copy(update={"distillation_topk": 20})
    assert "--max-logprobs" not in teacher_command(default, gpu_settings)  # vLLM's default serves it


# ------------------------------------------------------------------------------------------------ tokens
def test_the_teacher_token_reaches_only_the_teacher_and_the_trainer(distilled_config, gpu_settings):
    objs = _objects(distilled_config, gpu_settings)
    secret = objs[("Secret", TOKENS)]["stringData"]
    assert set(secret) == {"vllm-api-key", "reward-token", "teacher-api-key"} and len(set(secret.values())) == 3
    pods = _pods(list(objs.values()))
    assert _secrets_used(pods["teacher"]) == {(TOKENS, "teacher-api-key")}
    assert _env(pods["teacher"]["containers"][0])["VLLM_API_KEY"]["secretKeyRef"]["key"] == "teacher-api-key"
    for trainer in ("trainer-Master", "trainer-Worker"):
        env = _env(pods[trainer]["containers"][0])
        assert env["ASYNC_GRPO_TEACHER_API_KEY"]["secretKeyRef"] == {"name": TOKENS, "key": "teacher-api-key"}
        waits = [c["name"] for c in pods[trainer]["initContainers"]]
        assert waits == ["wait-for-vllm", "wait-for-teacher"], trainer
        wait = pods[trainer]["initContainers"][-1]["command"]
        assert wait[-2] == f"http://{RUN}-teacher.team-a.svc.cluster.local:8000"  # its /health, without the token
    for other in ("reward", "vllm"):
        assert (TOKENS, "teacher-api-key") not in _secrets_used(pods[other]), other
    for name, spec in pods.items():
        assert spec["automountServiceAccountToken"] is False, name


def test_a_teacher_and_a_judge_each_keep_their_own_token(distilled_config, gpu_settings):
    both = distilled_config.model_copy(update=JUDGED)
    settings = gpu_settings.model_copy(update={"reward_replicas": 0})  # the trainer then asks both
    objs = _objects(both, settings)
    secret = objs[("Secret", TOKENS)]["stringData"]
    assert {"judge-api-key", "teacher-api-key"} <= set(secret) and len(set(secret.values())) == 4
    pods = _pods(list(objs.values()))
    assert _secrets_used(pods["teacher"]) == {(TOKENS, "teacher-api-key")}
    assert _secrets_used(pods["judge"]) == {(TOKENS, "judge-api-key")}
    assert {(TOKENS, "judge-api-key"), (TOKENS, "teacher-api-key")} <= _secrets_used(pods["trainer-Master"])
    waits = [c["name"] for c in pods["trainer-Master"]["initContainers"]]
    assert waits == ["wait-for-vllm", "wait-for-judge", "wait-for-teacher"]
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    labels = pods_labels(objs)
    assert not reaches(policies, labels["teacher"], pod(labels["judge"]), 8000)
    assert not admitted(policies, labels["judge"], labels["teacher"], 8000)


BOUND = PlatformPolicy(
    teacher_urls=["http://teacher.ml.svc:8000", "http://teacher.ml.svc:8000/v1/premium"],
    teacher_token_secrets={
        "http://teacher.ml.svc:8000": "teacher-token",
        "http://teacher.ml.svc:8000/v1/premium": "premium-teacher-token",
    },
)


def _given_teacher(config: GRPOConfig, url: str) -> GRPOConfig:
    return config.model_copy(update={"teacher_model_name_or_path": None, "teacher_url": url})


def test_a_submitters_teacher_gets_the_token_the_platform_bound_to_it_in_the_trainer_only(gpu_config, gpu_settings):
    config = _given_teacher(gpu_config, "http://teacher.ml.svc:8000/v1")
    check_run(config, gpu_settings, BOUND)
    objs = build_run_objects(config, gpu_settings, RUN, policy=BOUND)
    pods = _pods(objs)
    for trainer in ("trainer-Master", "trainer-Worker"):
        env = _env(pods[trainer]["containers"][0])
        assert env["ASYNC_GRPO_TEACHER_API_KEY"]["secretKeyRef"] == {
            "name": "teacher-token",
            "key": "ASYNC_GRPO_TEACHER_API_KEY",
        }, trainer
        assert "optional" not in env["ASYNC_GRPO_TEACHER_API_KEY"]["secretKeyRef"]  # a missing key stops the pod
    for other in ("reward", "vllm"):
        assert not [s for s, _ in _secrets_used(pods[other]) if "teacher" in s], other
    # the run's own Secret holds no teacher token, and nothing waits for a teacher the run does not serve
    assert "teacher-api-key" not in _by_kind(objs)[("Secret", TOKENS)]["stringData"]
    assert [c["name"] for c in pods["trainer-Master"]["initContainers"]] == ["wait-for-vllm"]


def test_the_longest_bound_entry_wins_and_an_unbound_teacher_gets_no_token(gpu_config, gpu_settings):
    def token_secret(url: str, policy: PlatformPolicy = BOUND) -> object:
        objs = build_run_objects(_given_teacher(gpu_config, url), gpu_settings, RUN, policy=policy)
        env = _env(_pods(objs)["trainer-Master"]["containers"][0])
        return env.get("ASYNC_GRPO_TEACHER_API_KEY", {"secretKeyRef": {"name": None}})["secretKeyRef"]["name"]

    assert token_secret("http://teacher.ml.svc:8000/v1/premium/x") == "premium-teacher-token"
    assert token_secret("http://teacher.ml.svc:8000/v1") == "teacher-token"
    assert token_secret("http://teacher.ml.svc:8001/v1") is None  # another port: not covered, no token leaves
    assert BOUND.teacher_token_secret("http://teacher.ml.svc:8000@evil.com/v1") is None  # unsafe: covered by nothing
    unbound = PlatformPolicy(teacher_urls=["http://teacher.ml.svc:8000"])
    assert token_secret("http://teacher.ml.svc:8000/v1", unbound) is None
    assert token_secret("http://teacher.ml.svc:8000/v1", None) is None  # the built-in policy binds nothing


def test_a_served_teacher_keeps_the_runs_own_token_whatever_the_policy_binds(distilled_config, gpu_settings):
    objs = build_run_objects(distilled_config, gpu_settings, RUN, policy=BOUND)
    env = _env(_pods(objs)["trainer-Master"]["containers"][0])
    assert env["ASYNC_GRPO_TEACHER_API_KEY"]["secretKeyRef"] == {"name": TOKENS, "key": "teacher-api-key"}


def test_the_trainjob_trainer_gets_the_bound_teacher_token(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    config = _given_teacher(gpu_config, "http://teacher.ml.svc:8000/v1")
    objs = build_objects_for_api(config, settings, RUN, policy=BOUND)
    (job,) = [o for o in objs if o["kind"] == "TrainJob"]
    env = _env(job["spec"]["trainer"])
    assert env["ASYNC_GRPO_TEACHER_API_KEY"]["secretKeyRef"]["name"] == "teacher-token"
    unbound = build_objects_for_api(config, settings, RUN, policy=PlatformPolicy(teacher_urls=BOUND.teacher_urls))
    (job,) = [o for o in unbound if o["kind"] == "TrainJob"]
    assert "ASYNC_GRPO_TEACHER_API_KEY" not in _env(job["spec"]["trainer"])


@pytest.mark.parametrize(
    "bindings, names",
    [
        ({"http://other.ml.svc:8000": "t"}, "which is not an entry of teacher_urls"),
        ({"http://teacher.ml.svc:8000": "Teacher_Token"}, "is not a Secret name"),
        ({"http://teacher.ml.svc:8000": "../x"}, "is not a Secret name"),
    ],
)
def test_a_bad_teacher_token_binding_is_refused_naming_the_field(bindings, names):
    with pytest.raises(ValueError, match="teacher_token_secrets") as info:
        PlatformPolicy(teacher_urls=["http://teacher.ml.svc:8000"], teacher_token_secrets=bindings)
    assert names in str(info.value) and "Fix:" in str(info.value)


def test_the_policy_file_binds_teacher_tokens(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "teacher_urls: [http://teacher.ml.svc:8000]\n"
        "teacher_token_secrets: {http://teacher.ml.svc:8000: teacher-token}\n"
    )
    policy, source = load_policy(path)
    assert source == str(path)
    assert policy.teacher_token_secret("http://teacher.ml.svc:8000/v1") == "teacher-token"
    assert policy.teacher_token_secret("http://judge.ml.svc:8000/v1") is None


# ------------------------------------------------------------------------------------------------ network
def test_the_teacher_admits_only_the_runs_trainer_which_reaches_it(distilled_config, gpu_config, gpu_settings):
    objs = _objects(distilled_config, gpu_settings)
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    labels = pods_labels(objs)
    teacher, trainer, port = labels["teacher"], labels["trainer"], gpu_settings.vllm_port
    assert teacher["app.kubernetes.io/component"] == "teacher" and teacher["async-grpo/run"] == RUN
    assert admitted(policies, trainer, teacher, port)
    assert not admitted(policies, trainer, teacher, port + 1)
    for stranger in ("reward", "vllm"):
        assert not admitted(policies, labels[stranger], teacher, port), stranger
    assert not admitted(policies, {**trainer, "async-grpo/run": "agrpo-other-ffffff"}, teacher, port)
    # the trainer reaches the teacher (by DNS, which it resolves); the teacher reaches nothing, not even DNS
    assert reaches(policies, trainer, pod(teacher), port) and reaches(policies, trainer, DNS, 53, "UDP")
    assert not reaches(policies, teacher, DNS, 53, "UDP") and not reaches(policies, teacher, {"ip": "1.1.1.1"}, 443)
    assert not reaches(policies, teacher, pod(trainer), port)
    # the reward pods still reach nothing, and the vLLM and reward policies are unchanged
    assert not reaches(policies, labels["reward"], pod(teacher), port)
    plain = _objects(gpu_config, gpu_settings)
    for name in (f"{RUN}-vllm", f"{RUN}-reward"):
        assert objs[("NetworkPolicy", name)] == plain[("NetworkPolicy", name)]
    # the trainer's policy gains exactly the teacher
    gained = [
        rule
        for rule in objs[("NetworkPolicy", f"{RUN}-trainer")]["spec"]["egress"]
        if rule not in plain[("NetworkPolicy", f"{RUN}-trainer")]["spec"]["egress"]
    ]
    assert gained == [
        {"to": [{"podSelector": {"matchLabels": {"async-grpo/run": RUN, "app.kubernetes.io/component": "teacher"}}}],
         "ports": [{"protocol": "TCP", "port": port}]}
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ policy
def refused(config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy = POLICY) -> str:
    with pytest.raises(PolicyViolation) as info:
        check_run(config, settings, policy)
    assert "Fix:" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "model", ["Qwen/Qwen2.5-7B-Instruct", "models:/teacher/1", "builtin:tiny", "/etc/teacher", "/workspace/../etc"]
)
def test_a_teacher_model_off_the_volume_is_refused(model, distilled_config, gpu_settings):
    msg = refused(distilled_config.model_copy(update={"teacher_model_name_or_path": model}), gpu_settings)
    assert f"teacher_model_name_or_path={model!r}" in msg and "shared volume" in msg


def test_the_teacher_runs_the_vllm_image_and_obeys_its_checks(distilled_config, gpu_settings):
    msg = refused(distilled_config, gpu_settings.model_copy(update={"vllm_image": "docker.io/evil/vllm:1"}))
    assert "vllm_image='docker.io/evil/vllm:1' is not an allowed image" in msg


def test_too_many_teacher_gpus_are_refused_only_when_a_teacher_is_served(distilled_config, gpu_config, gpu_settings):
    capped = PlatformPolicy(max_gpus_per_pod=8)
    check_run(distilled_config, gpu_settings.model_copy(update={"teacher_gpus": 8}), capped)
    msg = refused(distilled_config, gpu_settings.model_copy(update={"teacher_gpus": 16}), capped)
    assert "teacher_gpus=16 asks for more GPUs per pod than the platform allows (8)" in msg
    assert "vllm_gpus" not in msg and "nproc_per_node" not in msg
    check_run(distilled_config, gpu_settings.model_copy(update={"teacher_gpus": 16}), PlatformPolicy())  # no cap
    check_run(gpu_config, gpu_settings.model_copy(update={"teacher_gpus": 16}), capped)  # no teacher: unused


def test_render_refuses_a_disallowed_teacher_with_exit_2(tmp_path, capsys):
    config = str(REPO / "manifests/examples/gpu-2x8/config.yaml")
    assert run_cli(["render", config, "teacher_model_name_or_path=Qwen/Qwen2.5-7B", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "the platform policy refuses this run" in err and "teacher_model_name_or_path='Qwen/Qwen2.5-7B'" in err
    assert not (tmp_path / "o").exists()


def test_the_runs_own_teacher_url_needs_no_teacher_urls_entry_a_submitters_does(distilled_config, gpu_settings):
    check_run(distilled_config, gpu_settings, PlatformPolicy())  # teacher_urls is empty
    served = trainer_config(distilled_config, gpu_settings, RUN)
    assert served.distillation.teacher_url == teacher_url(RUN, gpu_settings)
    assert served.distillation.teacher_model == TEACHER_MODEL
    assert served.distillation.teacher_model_name_or_path is None
    given = distilled_config.model_copy(
        update={"teacher_model_name_or_path": None, "teacher_url": "http://teacher.example.com/v1"}
    )
    msg = refused(given, gpu_settings)
    assert "teacher_url='http://teacher.example.com/v1' is not an allowed distillation teacher" in msg
    assert "every sampled completion would be sent there" in msg and "(teacher_urls)" in msg


def test_a_submitters_teacher_must_be_allowed_and_opens_no_egress_itself(gpu_config, gpu_settings):
    allowed = PlatformPolicy(teacher_urls=["http://teacher.ml.svc:8000"])
    config = gpu_config.model_copy(update={"teacher_url": "http://teacher.ml.svc:8000/v1"})
    check_run(config, gpu_settings, allowed)
    refused(config, gpu_settings)  # the default policy allows no teacher
    for sneaky in ("http://teacher.ml.svc:8000@evil.com/v1", "http://teacher.ml.svc:8000.evil.com/v1"):
        msg = refused(gpu_config.model_copy(update={"teacher_url": sneaky}), gpu_settings, allowed)
        assert "teacher_url" in msg, sneaky
    # the trainer connects to the URL the policy checked, and its NetworkPolicy is the plain one: an external teacher
    # is reached only through the platform's own trainer_egress
    assert trainer_config(config, gpu_settings, RUN).distillation.teacher_url == "http://teacher.ml.svc:8000/v1"
    objs, plain = _objects(config, gpu_settings), _objects(gpu_config, gpu_settings)
    assert objs[("NetworkPolicy", f"{RUN}-trainer")] == plain[("NetworkPolicy", f"{RUN}-trainer")]
    assert not [key for key in objs if "teacher" in key[1]]


def test_a_malformed_teacher_url_is_refused():
    with pytest.raises(ValueError, match="teacher_urls"):
        PlatformPolicy(teacher_urls=["http://a b/v1"])


def test_trainjob_refuses_a_teacher_model_and_names_the_fix(distilled_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob"})
    with pytest.raises(
        ValueError, match=r"teacher_model_name_or_path='/workspace.*trainer_api: trainjob.*Fix:.*teacher_url"
    ):
        check_trainjob_run(distilled_config, settings)
    with pytest.raises(ValueError, match="teacher_model_name_or_path"):
        build_objects_for_api(distilled_config, settings, RUN)


# ------------------------------------------------------------------------------------------------ backend
def test_the_backend_creates_the_teacher_and_deletes_it_with_the_run(distilled_config, gpu_settings):
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
        backend.launch(distilled_config, timeout_s=TIMEOUT_S)
    kinds = [
        (c.args[-1]["kind"], c.args[-1]["metadata"]["name"]) for c in cluster.calls if c.method.startswith("create_")
    ]
    assert kinds.index(("NetworkPolicy", f"{RUN}-teacher")) < kinds.index(("Deployment", f"{RUN}-teacher"))
    assert kinds.index(("Service", f"{RUN}-teacher")) < kinds.index(("Deployment", f"{RUN}-teacher"))
    job_uid = created[("PyTorchJob", RUN)]["metadata"]["uid"]
    for key in (("Service", f"{RUN}-teacher"), ("Deployment", f"{RUN}-teacher"), ("NetworkPolicy", f"{RUN}-teacher")):
        assert created[key]["metadata"]["ownerReferences"][0]["uid"] == job_uid
    deletes = [c.args[0] for c in cluster.calls if c.method == "delete_namespaced_deployment"]
    assert deletes == [f"{RUN}-vllm", f"{RUN}-reward", f"{RUN}-teacher"]
    assert cluster.objects == {}  # the job went too, and with it everything it owned


def test_cleanup_by_label_deletes_the_teacher_and_the_calls_stay_within_the_role(distilled_config, gpu_settings):
    cluster = FakeCluster([status(condition("Succeeded"))])
    backend, _, _ = make_backend(cluster, gpu_settings)
    backend.launch(distilled_config, timeout_s=TIMEOUT_S)
    assert ("Deployment", f"{RUN}-teacher") not in cluster.objects  # deleted after success
    assert ("Service", f"{RUN}-teacher") in cluster.objects  # owned by the kept job, goes with it
    labels = {
        "app.kubernetes.io/part-of": "async-grpo",
        "app.kubernetes.io/managed-by": "async-grpo",
        "app.kubernetes.io/component": "teacher",
        "async-grpo/run": RUN,
    }
    cluster.objects[("Deployment", f"{RUN}-teacher")] = {  # as if a killed launcher left it
        "kind": "Deployment",
        "metadata": {"name": f"{RUN}-teacher", "uid": "uid-left", "labels": labels},
    }
    assert f"Deployment/{RUN}-teacher" in backend.cleanup(RUN)
    granted = {(group, res, verb) for (group, res), verbs in LAUNCHER_RBAC_RULES.items() for verb in verbs}
    assert cluster.rbac_used() <= granted


def test_the_pods_config_reloads_with_the_teacher_fields(distilled_config, gpu_settings):
    served = trainer_config(distilled_config, gpu_settings, RUN)
    again = GRPOConfig.model_validate(flat_dump(served))
    assert again.distillation == served.distillation and again.distillation.enabled
