"""A second hostile tenant, against the fields that features added (issue 46): sandbox programs, model-written code
in the trainer pod, scheduling and runtime names, image modules beside credentials, reward-model folders off the
volume, a dtype that reaches vLLM's argv. Each attack is tried through the CLI (`render` and `validate --target
cluster` must both exit 2 naming the field, nothing rendered) or the train step, and the programs it names must never
run. No cluster is needed."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml
from kfp import dsl

from async_grpo.config import ConfigError, GRPOConfig, load_config
from async_grpo.launch import k8s_objects
from async_grpo.launch.k8s_policy import PolicyViolation, check_run, prepare_run
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import PlatformPolicy
from components.train_grpo.component import train_grpo

from ._k8s_validate import REPO
from .test_attacks import render_and_validate

TINY = REPO / "examples" / "tiny_cpu.yaml"
GPU_EXAMPLE = REPO / "manifests" / "examples" / "gpu-2x8"


def hostile_program(folder: Path, name: str) -> tuple[Path, Path]:
    """An executable that, if ever run, leaves `<folder>/<name>.ran` holding the MLflow password it could read."""
    marker = folder / f"{name}.ran"
    program = folder / name
    program.write_text(f'#!/bin/sh\necho "$MLFLOW_TRACKING_PASSWORD" > {marker}\nexit 0\n')
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program, marker


def test_h1_a_sandbox_program_on_the_workspace_is_refused_and_never_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    bwrap, marker = hostile_program(tmp_path, "bwrap")
    errors = render_and_validate(
        tmp_path, ["tools=[builtin:python]", f"python_tool_bwrap={bwrap}"], ["--set", "reward_replicas=0"], capsys
    )
    assert f"python_tool_bwrap='{bwrap}' is set by the platform only" in errors
    assert "builtin:python runs code the model writes; with reward_replicas=0" in errors
    # with reward pods the program is still the platform's to choose
    errors = render_and_validate(tmp_path, ["tools=[builtin:python]", f"python_tool_bwrap={bwrap}"], [], capsys)
    assert "python_tool_bwrap=" in errors and "reward_replicas=0" not in errors
    assert not marker.exists()


def test_h1_the_train_step_refuses_the_sandbox_program_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    monkeypatch.delenv("ASYNC_GRPO_POLICY_FILE", raising=False)
    bwrap, marker = hostile_program(tmp_path, "bwrap")
    data = dsl.Dataset(uri=str(tmp_path / "data"), name="d", metadata={"source": "builtin:reverse"})
    model = dsl.Model(uri=str(tmp_path / "model"), name="m")
    with pytest.raises(PolicyViolation, match="python_tool_bwrap="):
        train_grpo.python_func(
            dataset=data,
            model=model,
            launch_backend="kubernetes",
            extra_overrides=["tools=[builtin:python]", f"python_tool_bwrap={bwrap}"],
            backend_options={"reward_replicas": 0},
            mlflow_tracking_uri="http://mlflow:5000",
        )
    assert not marker.exists()


def test_h2_model_written_code_never_runs_unsandboxed_or_in_the_trainer_pod(tmp_path, capsys):
    errors = render_and_validate(
        tmp_path, ["tools=[builtin:python]", "python_tool_sandbox=none"], ["--set", "reward_replicas=0"], capsys
    )
    assert "python_tool_sandbox='none' is set by the platform only" in errors
    assert "builtin:python runs code the model writes; with reward_replicas=0" in errors
    errors = render_and_validate(tmp_path, ["tools=[builtin:python]", "python_tool_sandbox=none"], [], capsys)
    assert "python_tool_sandbox='none'" in errors  # not even in the reward pods
    # not even where the platform lets submitter files run beside credentials
    config = GRPOConfig(tools=["builtin:python"], python_tool_sandbox="none")
    with pytest.raises(PolicyViolation, match="runs only in the bwrap sandbox"):
        check_run(config, ClusterSettings(reward_replicas=1), PlatformPolicy(user_code_with_credentials=True))
    with pytest.raises(PolicyViolation, match="reward_replicas=0 it would run in the trainer pod"):
        check_run(
            GRPOConfig(tools=["builtin:python"]),
            ClusterSettings(reward_replicas=0),
            PlatformPolicy(user_code_with_credentials=True),
        )


def test_h3_an_interpreter_on_the_workspace_is_refused_and_never_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2")
    python, marker = hostile_program(tmp_path, "python3")
    errors = render_and_validate(tmp_path, ["tools=[builtin:python]", f"python_tool_interpreter={python}"], [], capsys)
    assert f"python_tool_interpreter='{python}' is set by the platform only" in errors
    assert not marker.exists()


def test_vllm_url_is_the_launchers(gpu_config, gpu_settings):
    config = gpu_config.model_copy(
        update={"inference": gpu_config.inference.model_copy(update={"vllm_url": "http://x:1"})}
    )
    with pytest.raises(PolicyViolation, match=r"vllm_url='http://x:1' is set by the platform only"):
        check_run(config, gpu_settings, PlatformPolicy())


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "priority_class_name=system-cluster-critical",
            "priority_class_name='system-cluster-critical' is not an allowed PriorityClass",
        ),
        (
            "trainer_runtime=torch-distributed",
            "trainer_runtime='torch-distributed' is not an allowed ClusterTrainingRuntime",
        ),
        ("run_as_user=1001", "run_as_user=1001 is set by the platform only"),
        ("gpu_resource=amd.com/gpu", "gpu_resource='amd.com/gpu' is set by the platform only"),
        ("node_selector={pool: team-b-reserved}", "node_selector {'pool': 'team-b-reserved'} is not allowed"),
        (
            "tolerations=[{key: team-b, operator: Exists}]",
            "tolerations [{'key': 'team-b', 'operator': 'Exists'}] are not allowed",
        ),
    ],
)
def test_scheduling_identity_and_runtime_names_come_from_the_policy(option, message, tmp_path, capsys):
    assert message in render_and_validate(tmp_path, [], ["--set", option], capsys)


def test_a_kueue_queue_must_be_listed(gpu_config, gpu_settings):
    settings = gpu_settings.model_copy(update={"trainer_api": "trainjob", "kueue_queue_name": "team-b-queue"})
    with pytest.raises(PolicyViolation, match=r"kueue_queue_name='team-b-queue' is not an allowed Kueue LocalQueue"):
        check_run(gpu_config, settings, PlatformPolicy())
    check_run(gpu_config, settings, PlatformPolicy(kueue_queues=["team-b-queue"]))


def test_the_platforms_own_values_apply_and_may_be_repeated(gpu_config, gpu_settings):
    policy = PlatformPolicy(platform_settings={"run_as_user": 2000})
    assert prepare_run(gpu_config, gpu_settings, policy).run_as_user == 2000
    assert prepare_run(gpu_config, gpu_settings.model_copy(update={"run_as_user": 2000}), policy).run_as_user == 2000
    with pytest.raises(PolicyViolation, match="run_as_user=3000"):
        prepare_run(gpu_config, gpu_settings.model_copy(update={"run_as_user": 3000}), policy)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("environment=verifiers:antigravity", "imports module 'antigravity'"),
        ("environment=openenv:os:system", "imports module 'os'"),
        ("data_producer=subprocess:run", "imports module 'subprocess'"),
    ],
)
def test_any_image_module_beside_credentials_is_refused(override, message, tmp_path, capsys):
    assert message in render_and_validate(tmp_path, [override], [], capsys)


def test_an_image_module_runs_in_the_trainer_pod_only_when_listed(gpu_config, gpu_settings):
    config = gpu_config.model_copy(
        update={"rewards": gpu_config.rewards.model_copy(update={"reward_funcs": ["os:system"]})}
    )
    with pytest.raises(PolicyViolation, match=r"name modules the policy does not list"):
        check_run(config, ClusterSettings(reward_replicas=0), PlatformPolicy())
    check_run(config, gpu_settings, PlatformPolicy())  # in the reward pods, which hold no credential


@pytest.mark.parametrize("spec", ["model:Org/reward-model", "model:/etc/secrets-rm", "/models/rm", "model:../x"])
def test_a_reward_model_folder_must_be_on_the_volume(spec, gpu_config, gpu_settings):
    config = gpu_config.model_copy(update={"rewards": gpu_config.rewards.model_copy(update={"reward_funcs": [spec]})})
    with pytest.raises(PolicyViolation, match="the file or model folder of"):
        check_run(config, gpu_settings, PlatformPolicy())
    ok = gpu_config.model_copy(
        update={"rewards": gpu_config.rewards.model_copy(update={"reward_funcs": ["model:/workspace/models/rm"]})}
    )
    check_run(ok, gpu_settings, PlatformPolicy())


@pytest.mark.parametrize("dtype", ["bfloat16 --trust-remote-code", "$(MLFLOW_TRACKING_PASSWORD)", "fp8"])
def test_vllm_dtype_is_one_of_vllms_choices(dtype):
    with pytest.raises((ConfigError, ValueError), match="vllm_dtype"):
        GRPOConfig(vllm_dtype=dtype)


def test_the_compliant_gpu_example_still_validates_and_renders():
    config = load_config(GPU_EXAMPLE / "config.yaml")
    settings = ClusterSettings.from_mapping(yaml.safe_load((GPU_EXAMPLE / "settings.yaml").read_text()))
    policy = PlatformPolicy.from_yaml((GPU_EXAMPLE / "policy.yaml").read_text(), "gpu-2x8 policy")
    resolved = prepare_run(config, settings, policy, allow_placeholders=True)
    objects = k8s_objects.build_run_objects(config, resolved, "example-gpu")
    assert {o["kind"] for o in objects} >= {"PyTorchJob", "Deployment", "NetworkPolicy"}
