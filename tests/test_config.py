"""GRPOConfig and load_config: defaults, YAML + key=value overrides, and error messages that name the field and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_grpo.config import ConfigError, GRPOConfig, dump_config, flat_dump, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 120


def write_yaml(tmp_path: Path, data) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------ valid configs
def test_defaults_validate_and_match_trl_names():
    config = GRPOConfig()
    assert config.loss.loss_type == "dapo"
    assert config.optim.learning_rate == 1e-6
    assert config.sampling.num_generations == 8
    assert config.rewards.reward_funcs == ["builtin:reverse_exact_match", "builtin:reverse_format"]
    assert load_config(None) == config


def test_yaml_file_then_overrides_parsed_as_yaml_types(tmp_path):
    path = write_yaml(tmp_path, {"learning_rate": 1.0e-4, "max_steps": 3, "run_name": "from-file", "epsilon": 0.3})
    config = load_config(path, [
        "max_steps=7",
        "learning_rate=2.5e-5",
        "mask_truncated_completions=true",
        "reward_weights=[1, 0.5]",
        "vllm_extra_args=[--enforce-eager, --seed=3]",
        "run_name=null",
        "eval_dataset=",
        "temperature=0.7",
    ])  # fmt: skip
    assert config.batch.max_steps == 7 and isinstance(config.batch.max_steps, int)  # override wins over the file
    assert config.optim.learning_rate == pytest.approx(2.5e-5)
    assert config.loss.mask_truncated_completions is True
    assert config.rewards.reward_weights == [1.0, 0.5]
    assert config.inference.vllm_extra_args == ["--enforce-eager", "--seed=3"]
    assert config.tracking.run_name is None
    assert config.data.eval_dataset is None
    assert config.sampling.temperature == pytest.approx(0.7)
    assert config.loss.epsilon == pytest.approx(0.3)  # from the file, untouched by overrides


def test_override_value_may_contain_equals_sign():
    config = load_config(None, ["mlflow_tracking_uri=http://host:5000/?a=b"])
    assert config.tracking.mlflow_tracking_uri == "http://host:5000/?a=b"


def test_empty_yaml_file_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match="is empty. Fix"):
        load_config(path)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("max_steps: 3\nlearning_rate: [1e-5\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+.*Fix"):
        load_config(path)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_floats_are_refused_with_the_field(value):
    with pytest.raises(ConfigError, match="optim.learning_rate: Input should be a finite number"):
        load_config(None, [f"learning_rate={value}"])


def test_examples_tiny_cpu_yaml_loads():
    raw = yaml.safe_load((REPO_ROOT / "examples" / "tiny_cpu.yaml").read_text())
    config = load_config(REPO_ROOT / "examples" / "tiny_cpu.yaml")
    for key, value in raw.items():
        assert flat_dump(config)[key] == value, key
    assert config.groups_per_step * config.sampling.num_generations == (
        config.batch.per_device_train_batch_size * config.batch.gradient_accumulation_steps
    )


def test_clip_max_alias_sets_the_cap(tmp_path):
    assert load_config(None, ["vllm_importance_sampling_clip_max=5"]).off_policy.vllm_importance_sampling_cap == 5.0
    path = write_yaml(tmp_path, {"vllm_importance_sampling_clip_max": 4.5})
    assert load_config(path).off_policy.vllm_importance_sampling_cap == 4.5
    assert GRPOConfig(vllm_importance_sampling_clip_max=2.0).off_policy.vllm_importance_sampling_cap == 2.0
    assert GRPOConfig(vllm_importance_sampling_cap=2.5).off_policy.vllm_importance_sampling_cap == 2.5


def test_groups_per_step():
    config = load_config(None, ["per_device_train_batch_size=12", "gradient_accumulation_steps=2", "num_generations=4"])
    assert config.groups_per_step == 6
    assert GRPOConfig().groups_per_step == 1  # 8 x 1 / 8


def test_epsilon_high_value_defaults_to_epsilon():
    assert GRPOConfig(epsilon=0.25).epsilon_high_value == 0.25
    assert GRPOConfig(epsilon=0.25, epsilon_high=0.28).epsilon_high_value == 0.28


def test_tracking_uri_defaults_under_output_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = GRPOConfig(output_dir=str(tmp_path / "run"))
    assert config.tracking_uri == f"sqlite:///{(tmp_path / 'run').resolve() / 'mlflow.db'}"
    assert GRPOConfig(mlflow_tracking_uri="http://mlflow:5000").tracking_uri == "http://mlflow:5000"


def test_dump_config_round_trips(tmp_path):
    config = load_config(None, ["learning_rate=3e-5", "vllm_importance_sampling_clip_max=4", "epsilon_high=0.28"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


# ------------------------------------------------------------------ invalid configs
def config_error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_negative_learning_rate_names_field_and_fix():
    msg = config_error("learning_rate=-1")
    assert "learning_rate" in msg
    assert "-1" in msg
    assert "Fix" in msg


def test_unknown_field_in_yaml_names_the_typo(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, {"learning_rat": 1.0e-5}))
    assert "learning_rat" in msg
    assert "unknown field" in msg
    assert "Fix" in msg


def test_unknown_field_as_override_names_the_typo():
    msg = config_error("learning_rat=1e-5")
    assert "'learning_rat'" in msg
    assert "unknown" in msg
    assert "Fix" in msg


def test_loss_type_outside_the_list():
    msg = config_error("loss_type=ppo")
    assert "loss_type" in msg
    assert "'ppo'" in msg
    assert "dapo" in msg  # the allowed values are listed
    assert "Fix" in msg


def test_batch_not_a_multiple_of_num_generations():
    msg = config_error("per_device_train_batch_size=6", "num_generations=4")
    assert "per_device_train_batch_size" in msg
    assert "num_generations=4" in msg
    assert "Fix" in msg


def test_reward_weights_length_mismatch():
    msg = config_error("reward_weights=[1.0]")
    assert "reward_weights has 1 entries but reward_funcs has 2" in msg
    assert "Fix" in msg


def test_clip_min_not_below_cap():
    msg = config_error("vllm_importance_sampling_clip_min=3", "vllm_importance_sampling_cap=3")
    assert "vllm_importance_sampling_clip_min" in msg
    assert "Fix" in msg


def test_completion_length_leaves_no_room_for_prompt():
    msg = config_error("max_completion_length=100", "vllm_max_model_len=100")
    assert "max_completion_length=100" in msg
    assert "vllm_max_model_len" in msg
    assert "Fix" in msg


def test_wrong_type_names_field():
    msg = config_error("num_generations=many")
    assert "num_generations" in msg
    assert "'many'" in msg
    assert "Fix" in msg


def test_override_without_equals():
    msg = config_error("learning_rate")
    assert "'learning_rate'" in msg
    assert "key=value" in msg
    assert "Fix" in msg


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = config_error(path=missing)
    assert str(missing) in msg
    assert "does not exist" in msg
    assert "Fix" in msg


def test_yaml_that_is_not_a_mapping(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, ["learning_rate", 1.0]))
    assert "mapping" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_validate_assignment_rejects_bad_value():
    config = GRPOConfig()
    with pytest.raises(ValueError, match="learning_rate"):
        config.optim.learning_rate = -1.0


# ------------------------------------------------------------------ CLI: validation happens before anything starts
@pytest.mark.integration
@pytest.mark.parametrize(
    ("override", "field"),
    [("learning_rate=-1", "learning_rate"), ("learning_rat=1e-5", "learning_rat")],
)
def test_cli_rejects_bad_config_before_starting_anything(tmp_path, override, field):
    out_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "async_grpo.cli", "train", "examples/tiny_cpu.yaml", override, f"output_dir={out_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr
    assert "Fix" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out_dir / "vllm.log").exists()
    assert not out_dir.exists()  # not even the run folder: nothing expensive was started


@pytest.mark.integration
def test_cli_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "async_grpo.cli", "train", str(tmp_path / "missing.yaml")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "missing.yaml" in proc.stderr
    assert "does not exist" in proc.stderr


@pytest.mark.parametrize("override", ["run_name=2024", "run_name=yes"])
def test_string_field_override_with_yaml_scalar_text(override):
    assert load_config(None, [override]).tracking.run_name == override.split("=", 1)[1]


def test_clip_max_override_replaces_cap_from_file(tmp_path):
    path = write_yaml(tmp_path, {"vllm_importance_sampling_cap": 3.0})
    assert load_config(path, ["vllm_importance_sampling_clip_max=5"]).off_policy.vllm_importance_sampling_cap == 5.0


def test_rendezvous_address_is_loopback_for_local_servers_and_pod_ip_otherwise(monkeypatch):
    from async_grpo.transports.weights.sync import rendezvous_address

    assert rendezvous_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert rendezvous_address("http://localhost:8000") == "127.0.0.1"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert rendezvous_address("http://vllm-0.vllm.ns.svc:8000") == "10.1.2.3"


def test_multi_rank_launch_without_torchrun_env_is_refused_before_anything_starts(monkeypatch, tmp_path):
    from async_grpo.config import GRPOConfig
    from async_grpo.launch.local import run_local

    monkeypatch.setenv("WORLD_SIZE", "16")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=16 but \['RANK', 'MASTER_ADDR', 'MASTER_PORT'\].*torchrun"):
        run_local(GRPOConfig(output_dir=str(tmp_path / "run")), progress=False)
    assert not (tmp_path / "run").exists()


def test_cispo_with_a_ratio_cap_below_one_is_refused_with_the_fix():
    from async_grpo.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"loss_type=cispo caps the importance ratio.*Fix: set epsilon_high, e.g. 5.0"
    ):
        load_config(None, ["loss_type=cispo", "epsilon_high=0.28"])
    assert load_config(None, ["loss_type=cispo", "epsilon_high=5.0"]).epsilon_high_value == 5.0


@pytest.mark.parametrize("shaping", ["dynamic_sampling=true", "reroll_start_fraction=0.5"])
def test_full_determinism_with_outcome_dependent_launches_is_refused_with_the_fix(shaping):
    with pytest.raises(ConfigError, match=r"full_determinism with dynamic_sampling or reroll_start_fraction < 1.*Fix"):
        load_config(None, ["full_determinism=true", shaping])
    assert load_config(None, ["full_determinism=true"]).full_determinism is True  # TRL's name, accepted as is
