"""An OpenEnv environment on a real vLLM CPU server: a few training steps with `environment: openenv:<file>:factory`.

The environment is defined here: the guessing game of `builtin:guess` written as an OpenEnv `Environment` (a text
action, a text observation, the reward on the observation), so the session's tiny model, warm-started briefly on the
game's reference conversations, plays it over several turns through the adapter, token in and token out. MLflow must
show episodes of more than one turn (`env/turns`), no environment failures, and OpenEnv's step rewards reaching the
reward function (`rewards/env_reward/mean`, `env/reward`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local
from async_grpo.tasks import guess

interfaces = pytest.importorskip("openenv.core.env_server.interfaces", reason="openenv-core is not installed")
types = pytest.importorskip("openenv.core.env_server.types")

pytestmark = pytest.mark.integration

STEPS = 3
MAX_RUN_S = 120.0


class GuessAction(types.Action):
    message: str


class GuessObservation(types.Observation):
    text: str = ""


class GuessOpenEnv(interfaces.Environment[GuessAction, GuessObservation, types.State]):
    """builtin:guess's game as an OpenEnv environment; the secret is the row's `answer` (passed to reset by name)."""

    def __init__(self):
        super().__init__()
        self._state, self.secret = types.State(), guess.LOW

    def reset(self, seed=None, episode_id=None, answer=None, **kwargs) -> GuessObservation:
        self.secret = int(answer) if answer is not None else guess.LOW + (seed or 0) % guess.HIGH
        self._state = types.State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="")  # the dataset prompt opens the episode

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        reply, solved = guess.guess_reply(self.secret, action.message)
        reward = guess.guess_reward(solved, self._state.step_count)
        return GuessObservation(text=reply, reward=reward, done=solved)

    @property
    def state(self) -> types.State:
        return self._state


def test_a_short_run_plays_an_openenv_environment_over_several_turns(child_pids, vllm_server, tiny_model_dir, tmp_path):
    import mlflow

    spec = f"openenv:{Path(__file__).resolve()}:GuessOpenEnv"
    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir), dataset="builtin:guess", environment=spec, max_turns=4,
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
    assert len(turns) == STEPS and sum(turns) / len(turns) > 1.0, (turns, metrics)
    assert all(f == 0.0 for f in history("env/failures")), metrics
    assert "rewards/env_reward/mean" in metrics and "env/reward" in metrics, metrics
    print(f"run {elapsed:.1f} s; env/turns {turns}; env/reward {history('env/reward')}")
    assert elapsed < MAX_RUN_S, f"the run took {elapsed:.0f} s"
