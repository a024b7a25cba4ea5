"""An environment on a real vLLM CPU server: a few training steps with `environment: builtin:guess`.

The session's tiny model is warm-started briefly on the game's reference conversations (binary searches: a number,
then "higher"/"lower", ...) so that it answers with a number and stops; then the run's environment rollouts play
the game on vLLM, token in and token out, and MLflow must show episodes of more than one turn (`env/turns`), the
token-mismatch count (`env/template_drift`, which the byte-level tokenizer keeps at 0), no environment failures,
and the environment's reward reaching the reward function (`rewards/env_reward/mean`).
"""

from __future__ import annotations

import time

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local

pytestmark = pytest.mark.integration

STEPS = 3
MAX_RUN_S = 120.0  # measured: see the report in docs/environments.md


def test_a_short_run_plays_the_guessing_game_over_several_turns(child_pids, vllm_server, tiny_model_dir, tmp_path):
    import mlflow

    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir), dataset="builtin:guess", environment="builtin:guess", max_turns=4,
        reward_funcs=["builtin:env_reward"], output_dir=str(tmp_path / "run"), vllm_url=vllm_server.url,
        warmup_sft_steps=40, warmup_sft_learning_rate=3e-3, max_steps=STEPS, vllm_sync_interval=1,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4, max_completion_length=160,
        eval_num_prompts=4, torch_num_threads=1, learning_rate=1e-4, save_model=False,
    )  # fmt: skip
    before = child_pids()
    started = time.monotonic()
    summary = run_local(config, progress=False)
    elapsed = time.monotonic() - started
    assert summary.steps == STEPS
    assert not child_pids() - before, "processes left behind by the run"

    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    metrics = client.get_run(summary.run_id).data.metrics

    def history(name: str) -> list[float]:
        return [m.value for m in client.get_metric_history(summary.run_id, name)]

    turns = history("env/turns")
    assert len(turns) == STEPS and sum(turns) / len(turns) > 1.0, (turns, metrics)  # episodes of several turns
    assert metrics["eval/env/turns"] > 1.0, metrics
    # the token-mismatch count is logged every step; a byte a re-render would change (an invalid UTF-8 sequence,
    # a special token inside a turn) makes it nonzero, and the held ids are trained on regardless
    drift = history("env/template_drift")
    assert len(drift) == STEPS and all(d >= 0.0 for d in drift), metrics
    assert all(f == 0.0 for f in history("env/failures")), metrics
    assert "rewards/env_reward/mean" in metrics and "env/reward" in metrics, metrics
    print(f"run {elapsed:.1f} s; env/turns {turns}; env/template_drift {drift}; env/reward {history('env/reward')}")
    assert elapsed < MAX_RUN_S, f"the run took {elapsed:.0f} s"
