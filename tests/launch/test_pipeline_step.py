"""What the KFP steps share (`launch.pipeline_step`): the run config merged from a pipeline's parameters, and the
launch backend a step drives."""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError
from async_grpo.launch.local import LocalBackend
from async_grpo.launch.pipeline_step import backend_for, check_pipeline_config, resolve_run_config

YAML = """
dataset: builtin:reverse
learning_rate: 1.0e-5
optim:
  max_steps: 7
mlflow_tracking_uri: http://from-yaml:5000
"""


def test_precedence_is_yaml_then_knobs_then_the_step_then_overrides():
    config = resolve_run_config(
        YAML,
        {"learning_rate": 3e-4, "max_steps": None, "seed": "", "num_generations": 4},  # None and "" leave the YAML
        ["max_steps=9", "beta=0.1"],
        pinned={"run_name": "run-abc", "output_dir": "/work/run-abc"},
    )
    assert config.optim.learning_rate == 3e-4 and config.batch.max_steps == 9 and config.seed == 0
    assert config.sampling.num_generations == 4 and config.loss.beta == 0.1
    assert config.tracking.run_name == "run-abc" and config.output_dir == "/work/run-abc"
    assert config.tracking.mlflow_tracking_uri == "http://from-yaml:5000"  # the YAML's, when the step names none


def test_the_steps_tracking_uri_wins_and_its_default_fills_only_a_gap():
    assert resolve_run_config(YAML, {}, tracking_uri="http://step:1").tracking.mlflow_tracking_uri == "http://step:1"
    kept = resolve_run_config(YAML, {}, default_tracking_uri="http://mounted:1")
    assert kept.tracking.mlflow_tracking_uri == "http://from-yaml:5000"
    filled = resolve_run_config("dataset: builtin:reverse", {}, default_tracking_uri="http://mounted:1")
    assert filled.tracking.mlflow_tracking_uri == "http://mounted:1"


def test_an_override_may_not_take_a_pinned_field_and_bad_input_names_the_field():
    with pytest.raises(ConfigError, match=r"may not set \['output_dir', 'run_name'\].*Fix"):
        resolve_run_config(YAML, {}, ["run_name=other", "output_dir=/elsewhere"],
                           pinned={"run_name": "mine", "output_dir": "/work/mine"})  # fmt: skip
    with pytest.raises(ConfigError, match="YAML mapping"):
        resolve_run_config("- a list", {})
    with pytest.raises(ConfigError, match="learning_rate"):
        resolve_run_config(YAML, {"learning_rate": -1.0})


def test_the_pipeline_needs_a_saved_model_and_mlflow():
    check_pipeline_config(resolve_run_config(YAML, {}))
    with pytest.raises(ConfigError, match="save_model is false.*Fix"):
        check_pipeline_config(resolve_run_config(YAML, {"save_model": False}))
    with pytest.raises(ConfigError, match="report_to is none.*Fix: report_to: mlflow"):
        check_pipeline_config(resolve_run_config(YAML, {"report_to": "none"}))


def test_backend_for_names_the_backend_and_refuses_an_unknown_one(monkeypatch, caplog):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # outside a pod: local is allowed
    assert isinstance(backend_for("local", {"namespace": "x"}), LocalBackend)
    assert "ignored by the local backend" in caplog.text
    with pytest.raises(ValueError, match="launch_backend='slurm' is not one of"):
        backend_for("slurm")
