"""An OpenEnv environment on a real vLLM CPU server: a few training steps with `environment: openenv:<file>:factory`.

The environment is defined here: the guessing game of `builtin:guess` written as an OpenEnv `Environment` (a text
action, a text observation, the reward on the observation), so the session's tiny model, warm-started briefly on the
game's reference conversations, plays it over several turns through the adapter, token in and token out. MLflow must
show episodes of more than one turn (`env/turns`), no environment failures, and OpenEnv's step rewards reaching the
reward function (`rewards/env_reward/mean`, `env/reward`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_a_short_run_plays_an_openenv_environment_over_several_turns(environment_run):
    spec = f"openenv:{Path(__file__).resolve()}:GuessOpenEnv"
    _, metrics, history, elapsed = environment_run(spec, STEPS)
    turns = history("env/turns")
    assert len(turns) == STEPS and sum(turns) / len(turns) > 1.0, (turns, metrics)
    assert all(f == 0.0 for f in history("env/failures")), metrics
    assert "rewards/env_reward/mean" in metrics and "env/reward" in metrics, metrics
    print(f"run {elapsed:.1f} s; env/turns {turns}; env/reward {history('env/reward')}")
    assert elapsed < MAX_RUN_S, f"the run took {elapsed:.0f} s"
