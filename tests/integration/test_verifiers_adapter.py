"""A verifiers 0.4 environment on a real vLLM CPU server: a few training steps with
`environment: verifiers:<file>:make_env`.

The environment is defined locally (tests/environments/verifiers_guess.py): builtin:guess's game as a verifiers
taskset, its host a verifiers harness that calls the model through verifiers' interception server, its reward a
`@vf.reward` on the trace. The session's tiny model, warm-started briefly on the game's reference conversations,
plays it over several turns through the adapter: each of the harness's model calls is answered by the rollout's
turn, sampled by vLLM from the held token ids. MLflow must show episodes of more than one turn (`env/turns`), no
environment failures, and the traces' rewards reaching the reward function (`rewards/env_reward/mean`, `env/reward`).
(`env/template_drift` is not asserted: it counts turns whose re-rendering would differ from the held ids, which
the tiny model's byte-level samples sometimes cause; the held ids are trained on either way.)
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed")

from tests.environments import verifiers_guess

pytestmark = pytest.mark.integration

STEPS = 3
MAX_RUN_S = 150.0


def test_a_short_run_plays_a_verifiers_environment_over_several_turns(environment_run):
    spec = f"verifiers:{verifiers_guess.__file__}:make_env"
    _, metrics, history, elapsed = environment_run(spec, STEPS)
    turns = history("env/turns")
    assert len(turns) == STEPS and sum(turns) / len(turns) > 1.0, (turns, metrics)
    assert all(f == 0.0 for f in history("env/failures")), metrics
    assert "rewards/env_reward/mean" in metrics and "env/reward" in metrics, metrics
    assert max(history("env/reward")) > 0.0, history("env/reward")  # some game was won and scored by verifiers
    assert not [t for t in threading.enumerate() if t.name == "async-grpo-verifiers"], "the adapter's thread lives"
    print(f"run {elapsed:.1f} s; env/turns {turns}; env/reward {history('env/reward')}")
    assert elapsed < MAX_RUN_S, f"the run took {elapsed:.0f} s"
