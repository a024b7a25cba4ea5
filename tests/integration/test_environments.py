"""An environment on a real vLLM CPU server: a few training steps with `environment: builtin:guess`.

The session's tiny model is warm-started briefly on the game's reference conversations (binary searches: a number,
then "higher"/"lower", ...) so that it answers with a number and stops; then the run's environment rollouts play
the game on vLLM, token in and token out, and MLflow must show episodes of more than one turn (`env/turns`), the
token-mismatch count (`env/template_drift`, which the byte-level tokenizer keeps at 0), no environment failures,
and the environment's reward reaching the reward function (`rewards/env_reward/mean`).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

STEPS = 3
MAX_RUN_S = 120.0  # measured: see the report in docs/environments.md


def test_a_short_run_plays_the_guessing_game_over_several_turns(environment_run):
    _, metrics, history, elapsed = environment_run("builtin:guess", STEPS)
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
