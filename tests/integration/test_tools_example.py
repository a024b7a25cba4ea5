"""The tool-calling example learns (issue 29): `examples/tools_cpu.yaml` as a user runs it, with fewer RL steps.

A fresh tiny model, the example's own warm start (reference conversations: tool call, result, answer), a real vLLM
CPU server, calculator workers, reward workers and MLflow. Two things are asserted, each the thing that broke:
- the warm start formed the digit copies: teacher-forced turn accuracy on held-out reference conversations is at
  least 0.5 (at the old warm-start learning rate, 3e-3, it was 0.23 for seed 0 and 0.008 for seed 2, and held-out
  exact match after warm start was 0.027, which left RL's groups without signal);
- RL then raises held-out exact match and reward on the same 64 prompts, each sampled with the same per-prompt seed
  before and after, by more than the spread seen between seeds (see MIN_* below).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow(seconds=450)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools_cpu.yaml"
# After 100 RL steps one seed of two had not yet moved (seed 2: exact match -0.03, then +0.15 at step 200).
RL_STEPS = 200
MIN_WARM_START_TURN_ACCURACY = 0.5
# Measured at step 200 (2 cores, two runs side by side): seed 0 exact match 0.535 -> 0.672 (+0.137), reward (max
# 2.0) 1.329 -> 1.550 (+0.221); seed 2 0.547 -> 0.695 (+0.148), 1.298 -> 1.552 (+0.254). The floors are about a third
# of the smaller gain: a run that only repeats its warm start (gain 0 +- the ~0.03 the step-100 dip shows) fails.
MIN_EXACT_MATCH_GAIN = 0.05
MIN_REWARD_GAIN = 0.08


@pytest.mark.timeout(1800)  # 318 s alone on 2 cores, 603 s beside another test worker (`make test`)
def test_the_tool_calling_example_learns(tmp_path):
    import mlflow

    from async_grpo.launch.local import run_local

    config = load_config(
        EXAMPLE,
        [f"output_dir={tmp_path / 'run'}", f"max_steps={RL_STEPS}", "save_model=false"],
    )
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    metrics = mlflow.tracking.MlflowClient().get_run(summary.run_id).data.metrics
    assert metrics["warmup/heldout_sequence_accuracy"] >= MIN_WARM_START_TURN_ACCURACY, metrics
    exact = "eval/rewards/calc_exact_match/mean"
    before, after = summary.eval_before, summary.eval_after
    assert after[exact] - before[exact] >= MIN_EXACT_MATCH_GAIN, (before, after)
    assert after["eval/reward"] - before["eval/reward"] >= MIN_REWARD_GAIN, (before, after)
    assert summary.steps == RL_STEPS
