"""The platform policy: each escape the submitter had is refused with the field and the fix, allowed runs pass."""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError, GRPOConfig
from async_grpo.config.trust import Trust
from async_grpo.launch.k8s_policy import PLACEHOLDER_DIGEST, PolicyViolation, check_run, prepare_run, uri_allowed
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import EgressRule, PlatformPolicy, load_policy

POLICY = PlatformPolicy()


def refused(config: GRPOConfig, settings: ClusterSettings | None = None, policy: PlatformPolicy = POLICY) -> str:
    with pytest.raises(PolicyViolation) as info:
        check_run(config, settings or ClusterSettings(), policy)
    assert "Fix:" in str(info.value)
    return str(info.value)


def test_the_defaults_pass(gpu_config, gpu_settings):
    check_run(gpu_config, gpu_settings, POLICY)
    check_run(GRPOConfig(), ClusterSettings(device="cpu"), POLICY)


@pytest.mark.parametrize(
    "flag",
    [
        "--trust-remote-code",
        "--worker-extension-cls",
        "--middleware",
        "--api-key",
        "--host",
        "--tool-parser-plugin",
        "--compilation-config",
        "--allowed-origins",
    ],
)
def test_vllm_flags_that_load_code_or_change_auth_are_refused(flag, gpu_config, gpu_settings):
    config = gpu_config.model_copy(update={"vllm_extra_args": [f"{flag}=x"]})
    assert f"vllm_extra_args: flag '{flag}' is not allowed" in refused(config, gpu_settings)


def test_allowed_vllm_flags_and_their_values_pass(gpu_config, gpu_settings):
    config = gpu_config.model_copy(
        update={
            "vllm_extra_args": [
                "--gpu-memory-utilization",
                "0.85",
                "--max-num-seqs=64",
                "--enable-prefix-caching",
                "--swap-space",
                "-1",
            ]
        }
    )
    check_run(config, gpu_settings, POLICY)
    widened = PlatformPolicy(vllm_flags=[*POLICY.vllm_flags, "--trust-remote-code"])
    check_run(gpu_config.model_copy(update={"vllm_extra_args": ["--trust-remote-code"]}), gpu_settings, widened)


def test_reward_files_never_run_in_the_trainer_pod(gpu_config):
    files = gpu_config.model_copy(update={"reward_funcs": ["/workspace/rewards/x.py:f", "builtin:reverse_format"]})
    msg = refused(files, ClusterSettings(reward_replicas=0))
    assert "reward_funcs ['/workspace/rewards/x.py:f']" in msg and "reward_replicas >= 1" in msg
    check_run(files, ClusterSettings(reward_replicas=1), POLICY)  # in reward pods: fine
    modules = gpu_config.model_copy(update={"reward_funcs": ["mypkg.rewards:accuracy"]})
    check_run(modules, ClusterSettings(reward_replicas=1), POLICY)  # image code in the reward pods
    msg = refused(modules, ClusterSettings(reward_replicas=0))  # any function of any module, beside credentials
    assert "reward_funcs ['mypkg.rewards:accuracy'] name modules the policy does not list" in msg
    check_run(modules, ClusterSettings(reward_replicas=0), PlatformPolicy(code_modules=["mypkg.*"]))
    check_run(
        gpu_config.model_copy(update={"reward_funcs": ["trl.rewards:think_format_reward"]}),
        ClusterSettings(reward_replicas=0),
        POLICY,
    )  # listed by default
    check_run(files, ClusterSettings(reward_replicas=0), PlatformPolicy(user_code_with_credentials=True))


def test_tool_files_never_run_in_the_trainer_pod(gpu_config):
    files = gpu_config.model_copy(update={"tools": ["/workspace/tools/t.py:lookup", "builtin:calculator"]})
    msg = refused(files, ClusterSettings(reward_replicas=0))
    assert "tools ['/workspace/tools/t.py:lookup']" in msg and "reward_replicas >= 1" in msg
    check_run(files, ClusterSettings(reward_replicas=1), POLICY)  # tool calls run in the reward pods
    check_run(
        gpu_config.model_copy(update={"tools": ["builtin:calculator"]}), ClusterSettings(reward_replicas=0), POLICY
    )  # image code


def test_a_data_producer_file_is_refused_a_module_is_not(gpu_config, gpu_settings):
    msg = refused(gpu_config.model_copy(update={"data_producer": "/workspace/p.py:make"}), gpu_settings)
    assert "data_producer='/workspace/p.py:make'" in msg
    module = gpu_config.model_copy(update={"data_producer": "mypkg.producer:make"})
    assert "imports module 'mypkg.producer'" in refused(module, gpu_settings)  # runs beside credentials: listed only
    check_run(module, gpu_settings, PlatformPolicy(code_modules=["mypkg.producer"]))


def test_an_environment_file_is_refused_in_the_trainer_pod_a_module_or_builtin_is_not(gpu_config, gpu_settings):
    msg = refused(gpu_config.model_copy(update={"environment": "/workspace/e.py:make"}), gpu_settings)
    assert "environment='/workspace/e.py:make' is a file" in msg and "pkg.module:factory" in msg
    msg = refused(gpu_config.model_copy(update={"environment": "envs/e.py:make"}), gpu_settings)
    assert "environment='envs/e.py'" in msg and "shared volume" in msg  # a file off the volume
    check_run(gpu_config.model_copy(update={"environment": "builtin:guess"}), gpu_settings, POLICY)
    module = gpu_config.model_copy(update={"environment": "mypkg.envs:make"})
    assert "imports module 'mypkg.envs'" in refused(module, gpu_settings)
    check_run(module, gpu_settings, PlatformPolicy(code_modules=["mypkg.*"]))


def test_an_adapters_file_is_judged_as_the_file_it_names(gpu_config, gpu_settings):
    msg = refused(gpu_config.model_copy(update={"environment": "openenv:/workspace/e.py:make"}), gpu_settings)
    assert "is a file" in msg and "environment='/workspace/e.py'" not in msg  # on the volume: only the pod rule
    msg = refused(gpu_config.model_copy(update={"environment": "openenv:envs/e.py:make"}), gpu_settings)
    assert "environment='envs/e.py'" in msg and "shared volume" in msg
    module = gpu_config.model_copy(update={"environment": "openenv:mypkg.envs:make"})
    assert "imports module 'mypkg.envs'" in refused(module, gpu_settings)
    check_run(module, gpu_settings, PlatformPolicy(code_modules=["mypkg.envs"]))
    taskset = gpu_config.model_copy(update={"environment": "verifiers:antigravity"})  # the id names its module
    assert "imports module 'antigravity'" in refused(taskset, gpu_settings)


def test_an_agent_runs_in_the_reward_pods_with_its_file_on_the_volume(gpu_config, gpu_settings):
    assert gpu_settings.reward_replicas == 1  # the episodes run in the reward pods: no credential there
    for spec in ("/workspace/agents/react.py:run", "acme_agents.react:run"):  # a file, or any module of the image
        check_run(gpu_config.model_copy(update={"agent": spec}), gpu_settings, POLICY)
    msg = refused(gpu_config.model_copy(update={"agent": "agents/react.py:run"}), gpu_settings)
    assert "agent='agents/react.py'" in msg and "shared volume" in msg  # a file off the volume
    msg = refused(gpu_config.model_copy(update={"agent": "/workspace/../etc/a.py:run"}), gpu_settings)
    assert "agent='/workspace/../etc/a.py'" in msg


def test_without_reward_pods_an_agent_is_judged_as_an_environment(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"reward_replicas": 0})
    msg = refused(gpu_config.model_copy(update={"agent": "/workspace/agents/react.py:run"}), settings)
    assert "agent='/workspace/agents/react.py:run' is a file: it would run in the trainer pod" in msg
    assert "set reward_replicas >= 1" in msg and "pkg.module:function" in msg
    module = gpu_config.model_copy(update={"agent": "acme_agents.react:run"})
    assert "agent='acme_agents.react:run' imports module 'acme_agents.react'" in refused(module, settings)
    check_run(module, settings, PlatformPolicy(code_modules=["acme_agents.*"]))
    trusted = PlatformPolicy(user_code_with_credentials=True)
    check_run(gpu_config.model_copy(update={"agent": "/workspace/agents/react.py:run"}), settings, trusted)
    msg = refused(gpu_config.model_copy(update={"agent": "agents/react.py:run"}), settings, trusted)
    assert "shared volume" in msg  # the volume rule holds whatever the policy trusts
    # an external reward service (reward_url, allowed by the policy) is no placement for an agent
    external = gpu_config.model_copy(
        update={"agent": "/workspace/a.py:run", "reward_url": "http://rewards.ml.svc:8080"}
    )
    assert "is a file: it would run in the trainer pod" in refused(
        external, settings, PlatformPolicy(reward_urls=["http://rewards.ml.svc:8080"])
    )


def test_an_agent_command_runs_sandboxed_in_the_reward_pods_its_paths_on_the_volume(gpu_config, gpu_settings):
    for argv in (["python", "/workspace/agents/run.py"], ["/usr/bin/python3", "-u", "/workspace/a/run.py", "--x"]):
        check_run(gpu_config.model_copy(update={"agent_command": argv}), gpu_settings, POLICY)
    for path in ("/cache/run.py", "/workspace/../etc/passwd", "/proc/1/environ", "/usr/../workspace/a.py"):
        msg = refused(gpu_config.model_copy(update={"agent_command": ["python", path]}), gpu_settings)
        assert f"agent_command={path!r}: on Kubernetes each path the agent's command names must be a normalized" in msg
    trusted = PlatformPolicy(user_code_with_credentials=True)  # the volume rule holds whatever the policy trusts
    assert "agent_command='/cache/run.py'" in refused(
        gpu_config.model_copy(update={"agent_command": ["python", "/cache/run.py"]}), gpu_settings, trusted
    )


def test_without_reward_pods_an_agent_command_runs_only_where_code_may_run_beside_credentials(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"reward_replicas": 0})
    config = gpu_config.model_copy(update={"agent_command": ["python", "/workspace/agents/run.py"]})
    msg = refused(config, settings)
    command = "agent_command=['python', '/workspace/agents/run.py']"
    assert f"{command} with reward_replicas=0 would run in the trainer pod" in msg
    assert "which holds the MLflow credentials" in msg and "set reward_replicas >= 1" in msg
    assert "bwrap sandbox" in msg and "user_code_with_credentials" in msg
    check_run(config, settings, PlatformPolicy(user_code_with_credentials=True))
    check_run(config, settings, PlatformPolicy(user_code_with_credentials=True, code_modules=[]))


def test_the_agent_endpoint_ports_must_not_overlap_the_trainers_other_listeners(gpu_config, gpu_settings):
    config = gpu_config.model_copy(update={"agent": "/workspace/agents/react.py:run"})
    for update, clash in (
        ({"weight_transfer_ports": (8100, 8800)}, "weight_transfer_ports"),
        ({"vllm_port": 8703}, "vllm_port"),
        ({"reward_port": 8700}, "reward_port"),
    ):
        msg = refused(config, gpu_settings.model_copy(update=update))
        assert "agent_endpoint_port: the agent endpoint's ports 8700-8703" in msg and f"overlap {clash}" in msg
    check_run(config, gpu_settings.model_copy(update={"vllm_port": 8704, "reward_port": 8699}), POLICY)
    # no agent: nothing is opened, nothing to clash with
    check_run(gpu_config, gpu_settings.model_copy(update={"vllm_port": 8700}), POLICY)


def test_the_agent_endpoint_port_is_the_platforms(gpu_config, gpu_settings):
    # torchrun's rendezvous port: it would be opened to tenant code
    config = gpu_config.model_copy(update={"agent": "/workspace/a.py:run", "agent_endpoint_port": 29500})
    assert config.agents.agent_endpoint_port == 29500
    assert "agent_endpoint_port=29500 is set by the platform only" in refused(config, gpu_settings)


def test_a_code_field_the_gate_has_no_placement_for_fails_closed(gpu_config, gpu_settings):
    from async_grpo.config.trust import TrustClass
    from async_grpo.launch.k8s_policy import FieldValue, RunContext, code_problems

    ctx = RunContext(gpu_config, gpu_settings, POLICY, allow_placeholders=False)
    grown = FieldValue("config", "new_feature_hook", "pkg.mod:f", None, TrustClass(Trust.CODE))
    (problem,) = code_problems(grown, ctx)
    assert problem.startswith("new_feature_hook='pkg.mod:f' is refused on Kubernetes") and "Fix:" in problem
    assert code_problems(FieldValue("config", "new_feature_hook", None, None, TrustClass(Trust.CODE)), ctx) == []
    trusted = RunContext(gpu_config, gpu_settings, PlatformPolicy(user_code_with_credentials=True), False)
    assert code_problems(grown, trusted) == []


def test_an_external_reward_service_must_be_allowed(gpu_config):
    config = gpu_config.model_copy(update={"reward_url": "http://collector.example.com:80"})
    assert "reward_url='http://collector.example.com:80'" in refused(config, ClusterSettings(reward_replicas=0))
    allowed = PlatformPolicy(reward_urls=["http://rewards.ml.svc:8080"])
    check_run(
        gpu_config.model_copy(update={"reward_url": "http://rewards.ml.svc:8080"}),
        ClusterSettings(reward_replicas=0),
        allowed,
    )


def test_an_llm_judge_must_be_allowed(gpu_config, gpu_settings):
    judged = {"reward_funcs": [*gpu_config.rewards.reward_funcs, "builtin:llm_judge"]}
    config = gpu_config.model_copy(update={**judged, "judge_url": "http://collector.example.com/v1"})
    msg = refused(config, gpu_settings)
    assert "judge_url='http://collector.example.com/v1' is not an allowed LLM judge" in msg
    allowed = POLICY.model_copy(update={"judge_urls": ["http://judge.ml.svc:8000"]})
    check_run(
        gpu_config.model_copy(update={**judged, "judge_url": "http://judge.ml.svc:8000/v1"}), gpu_settings, allowed
    )
    sneaky = gpu_config.model_copy(update={**judged, "judge_url": "http://judge.ml.svc:8000@evil.com/v1"})
    with pytest.raises(PolicyViolation, match="judge_url"):
        check_run(sneaky, gpu_settings, allowed)


@pytest.mark.parametrize(
    "uri, ok",
    [
        ("http://mlflow:5000", True),
        ("http://MLFLOW:5000/", True),
        ("http://mlflow:5000/sub/path", True),
        ("https://mlflow:5000", False),
        ("http://mlflow:5001", False),
        ("http://mlflow:5000.evil.com", False),
        ("http://mlflow:5000@evil.com", False),
        ("http://evil.com/?x=http://mlflow:5000", False),
        ("sqlite:///tmp/mlflow.db", False),
        ("file:///workspace/mlruns", False),
    ],
)
def test_tracking_uris_are_compared_by_scheme_host_port_and_path(uri, ok):
    assert uri_allowed(uri, ["http://mlflow:5000"]) is ok
    assert uri_allowed("https://mlflow.corp/team-a/x", ["https://mlflow.corp/team-a"])
    assert not uri_allowed("https://mlflow.corp/team-ab", ["https://mlflow.corp/team-a"])


def test_images_by_prefix_exact_reference_and_digest():
    digest = "@sha256:" + "c" * 64
    policy = PlatformPolicy(
        image_prefixes=["reg.corp/ml/"], images=["docker.io/vllm/vllm-openai" + digest], require_digest=True
    )
    settings = ClusterSettings(
        trainer_image="reg.corp/ml/trainer" + digest,
        vllm_image="docker.io/vllm/vllm-openai" + digest,
        reward_image="reg.corp/ml/reward" + digest,
    )
    check_run(GRPOConfig(), settings, policy)
    msg = refused(GRPOConfig(), settings.model_copy(update={"reward_image": "reg.corp/ml/reward:latest"}), policy)
    assert "reward_image='reg.corp/ml/reward:latest' is not pinned by digest" in msg
    msg = refused(GRPOConfig(), settings.model_copy(update={"vllm_image": "docker.io/vllm/vllm-openai:latest"}), policy)
    assert "vllm_image='docker.io/vllm/vllm-openai:latest' is not an allowed image" in msg
    # the registry prefix is a prefix of the reference, not of any string that contains it
    msg = refused(GRPOConfig(), settings.model_copy(update={"trainer_image": "evil.io/reg.corp/ml/t" + digest}), policy)
    assert "trainer_image='evil.io/reg.corp/ml/t" in msg


def test_every_problem_is_listed_at_once():
    settings = ClusterSettings(
        trainer_image="docker.io/evil/x:latest", service_account="default", mlflow_secret="any", pvc_name="mlflow-data"
    )
    msg = refused(GRPOConfig(mlflow_tracking_uri="http://evil:80", vllm_extra_args=["--trust-remote-code"]), settings)
    for field in (
        "trainer_image=",
        "service_account=",
        "mlflow_secret=",
        "pvc_name=",
        "mlflow_tracking_uri=",
        "vllm_extra_args",
    ):
        assert field in msg, field


def test_default_images_fill_only_what_the_run_leaves_open():
    policy = PlatformPolicy(
        default_images={
            "trainer": "ghcr.io/async-grpo/trainer@sha256:" + "d" * 64,
            "cpu": "ghcr.io/async-grpo/cpu@sha256:" + "e" * 64,
        }
    )
    resolved = prepare_run(GRPOConfig(), ClusterSettings(), policy)
    assert resolved.image("trainer").endswith("d" * 64) and resolved.image("vllm") == "ghcr.io/async-grpo/vllm:0.1.0"
    assert prepare_run(GRPOConfig(), ClusterSettings(device="cpu"), policy).image("vllm").endswith("e" * 64)
    own = prepare_run(GRPOConfig(), ClusterSettings(image_tag="0.2.0"), policy)
    assert own.image("trainer") == "ghcr.io/async-grpo/trainer:0.2.0"  # the run chose its images
    with pytest.raises(PolicyViolation, match="placeholder digest"):
        prepare_run(GRPOConfig(), ClusterSettings(trainer_image="ghcr.io/async-grpo/t@" + PLACEHOLDER_DIGEST), policy)


def test_load_policy_precedence_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    monkeypatch.setattr("async_grpo.launch.platform_policy.POLICY_MOUNT_DIR", str(tmp_path / "mount"))
    assert load_policy() == (PlatformPolicy(), "built-in defaults")
    (tmp_path / "mount").mkdir()
    (tmp_path / "mount" / "policy.yaml").write_text("pvcs: [mounted]\n")
    assert load_policy()[0].pvcs == ["mounted"]
    env_file = tmp_path / "env.yaml"
    env_file.write_text("pvcs: [from-env]\n")
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(env_file))
    assert load_policy()[0].pvcs == ["from-env"]
    given = tmp_path / "given.yaml"
    given.write_text("pvcs: [given]\n")
    assert load_policy(given) == (PlatformPolicy(pvcs=["given"]), str(given))
    given.write_text("pvc: [typo]\n")
    with pytest.raises(ConfigError, match=r"(?s)invalid platform policy .*given.yaml.*pvc: unknown field"):
        load_policy(given)
    with pytest.raises(ConfigError, match="does not exist"):
        load_policy(tmp_path / "missing.yaml")


def test_egress_rules_validate_ranges():
    with pytest.raises(ValueError):
        EgressRule(cidr="10.0.0.0/33")
    assert EgressRule(cidr="10.0.0.0/8").ip_block() == {"cidr": "10.0.0.0/8"}
    assert EgressRule(cidr="0.0.0.0/0").ip_block() == {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}
    assert EgressRule(cidr="::/0").ip_block() == {"cidr": "::/0", "except": ["fd00:ec2::254/128"]}
