"""The environment protocol's pieces: the safe caller (async and sync, timeouts, failures counted), the spec
loading and its errors (named after `environment`, with the fix), and the builtin guessing game."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_grpo.environments import (
    FAILURE_KINDS,
    Environment,
    EnvironmentCaller,
    EnvironmentSpecError,
    Observation,
    check_observation,
    check_reset,
    load_environment,
)
from async_grpo.environments.builtin import GuessEnvironment
from async_grpo.tasks import get_reward_func, get_task
from async_grpo.tasks.guess import guess_reply, guess_reward, guess_transcript, parse_guess
from tests.environments import envs

M = "tests.environments.envs"


def call(caller, method, *args):
    return asyncio.run(getattr(caller, method)(*args))


def test_async_and_sync_environments_are_called_and_their_observations_checked():
    for env in (envs.EchoEnv(), envs.SyncEnv()):
        assert isinstance(env, Environment)
        caller = EnvironmentCaller(env, timeout_s=5.0)
        state = {"turn": 1}
        assert call(caller, "reset", {"prompt": []}, state).observation == Observation([])
        out = call(caller, "step", "hi", state)
        assert out.failure is None and out.observation.messages[0]["role"] in ("user", "tool")
        caller.close()


@pytest.mark.parametrize(
    "env, method, kind",
    [
        (envs.RaisingStepEnv(), "step", "step_exception"),
        (envs.RaisingResetEnv(), "reset", "reset_exception"),
        (envs.HangingStepEnv(), "step", "step_timeout"),
        (envs.HangingSyncEnv(), "step", "step_timeout"),
        (envs.BadObservationEnv(), "step", "bad_observation"),
    ],
)
def test_a_failing_call_becomes_a_counted_kind_never_an_exception(env, method, kind):
    caller = EnvironmentCaller(env, timeout_s=0.3)
    args = ({"prompt": []}, {"turn": 1}) if method == "reset" else ("7", {"turn": 1, "seen": []})
    started = time.monotonic()
    out = call(caller, method, *args)
    assert out.observation is None and out.failure == kind and kind in FAILURE_KINDS and out.error
    assert time.monotonic() - started < 1.5  # the timeout, not the hang (a sync thread is abandoned)
    caller.close()


def test_check_observation_names_what_is_wrong():
    assert check_observation(Observation([{"role": "user", "content": "x"}], 1.0, True)) is None
    assert "not an Observation" in check_observation({"messages": []})
    assert "role" in check_observation(Observation([{"role": "assistant", "content": "x"}]))
    assert "role" in check_observation(Observation([{"role": "user", "content": 3}]))
    assert "reward" in check_observation(Observation([], reward="1"))
    assert "done" in check_observation(Observation([], done=1))


def test_specs_resolve_builtins_modules_and_classes():
    assert isinstance(load_environment("builtin:guess"), GuessEnvironment)
    assert isinstance(load_environment(f"{M}:make_echo"), envs.EchoEnv)
    assert isinstance(load_environment(f"{M}:SyncEnv"), envs.SyncEnv)  # a class is a factory


@pytest.mark.parametrize(
    "spec, words",
    [
        ("guess", ["builtin:guess"]),  # no colon: the forms, and the builtin it may mean
        ("builtin:nope", ["no builtin environment", "builtin:guess"]),
        ("no_such_module_q7:make", ["cannot import", "Fix:"]),
        ("missing/file.py:make", ["does not exist", "Fix:"]),
        (f"{M}:absent", ["no attribute", "Fix:"]),
        (f"{M}:NOT_CALLABLE", ["not a callable", "Fix:"]),
        (f"{M}:needs_args", ["no arguments", "Fix:"]),
        (f"{M}:NoStepEnv", ["without a `step` method", "Fix:"]),
        (f"{M}:WrongSignatureEnv", ["reset(row, state)", "Fix:"]),
    ],
)
def test_bad_specs_name_the_field_and_the_fix(spec, words):
    with pytest.raises(EnvironmentSpecError) as err:
        load_environment(spec)
    assert "environment" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_check_reset_refuses_an_environment_that_cannot_open_the_row():
    check_reset(GuessEnvironment(), "builtin:guess", {"prompt": [], "answer": "5"}, 5.0)
    with pytest.raises(EnvironmentSpecError, match="reset failed on the dataset's first row.*reset_exception"):
        check_reset(GuessEnvironment(), "builtin:guess", {"prompt": [], "answer": "99"}, 5.0)  # out of range
    with pytest.raises(EnvironmentSpecError, match="reset_exception.*Fix:"):
        check_reset(envs.RaisingResetEnv(), "x:y", {"prompt": []}, 5.0)


def test_the_guessing_game():
    assert parse_guess(" 12\n") == 12 and parse_guess("none") is None
    assert guess_reply(9, "4") == ("higher", False) and guess_reply(9, "12") == ("lower", False)
    assert guess_reply(9, "9") == ("correct", True) and not guess_reply(9, "what")[1]
    assert guess_reward(True, 1) == 1.0 and guess_reward(True, 3) == pytest.approx(0.81)
    assert guess_reward(False, 1) == 0.0
    env, state = GuessEnvironment(), {"turn": 1}
    asyncio.run(env.reset({"prompt": [], "answer": "11"}, state))
    assert state["secret"] == 11
    assert asyncio.run(env.step("8", state)).messages == [{"role": "user", "content": "higher"}]
    state["turn"] = 2
    won = asyncio.run(env.step("11", state))
    assert won.done and won.reward == pytest.approx(0.9) and state["solved"]
    # without an answer column the secret is fixed per prompt (seeded)
    a, b = {}, {}
    asyncio.run(env.reset({"prompt": [{"role": "user", "content": "p"}]}, a))
    asyncio.run(env.reset({"prompt": [{"role": "user", "content": "p"}]}, b))
    assert a["secret"] == b["secret"] and 1 <= a["secret"] <= 16


def test_the_builtin_task_its_transcripts_and_env_reward():
    task = get_task("guess")
    row = task.eval_dataset()[0]
    assert row["prompt"][0]["role"] == "user" and 1 <= int(row["answer"]) <= 16
    conv = guess_transcript(row["prompt"][0]["content"], "16")
    assert [m["content"] for m in conv[1:]] == ["8", "higher", "12", "higher", "14", "higher", "15", "higher", "16"]
    assert max(len(guess_transcript("p", str(s))) for s in range(1, 17)) <= 1 + 2 * 5 - 1  # at most 5 guesses
    reward = get_reward_func("env_reward")
    assert reward([None, None], ["a", "b"], None, env_reward=[0.81, None]) == [0.81, 0.0]
    with pytest.raises(ValueError, match="Fix: set `environment`"):
        reward([None], ["a"], None)


def test_the_warm_start_demonstrates_a_noisy_binary_search_inside_the_open_range():
    """Every demonstrated guess lies in the range the replies leave open and every game ends on the secret; about
    half the guesses are the middle (1 - EXPLORE, plus the uniform draws that land on it), the rest spread, so the
    warm-started policy keeps choices for GRPO to weigh; the same seed gives the same demonstrations."""
    task = get_task("guess")
    convs = task.sft_transcripts(0, 400)
    assert convs == task.sft_transcripts(0, 400) and convs != task.sft_transcripts(1, 400)
    middle = guesses = 0
    for conv, (_, answer) in zip(convs, task.sft_examples(0, 400), strict=True):
        low, high = 1, 16
        for turn, reply in zip(conv[1::2], [*conv[2::2], None], strict=True):
            guess = int(turn["content"])
            assert low <= guess <= high
            guesses, middle = guesses + 1, middle + (guess == (low + high) // 2)
            if reply is None:
                assert guess == int(answer)
            else:
                low, high = (guess + 1, high) if reply["content"] == "higher" else (low, guess - 1)
    assert 0.5 < middle / guesses < 0.75
    assert guesses / len(convs) > 3.5  # longer than the exact search's 3.4 guesses on average
    # the greedy check's reference (rng None) is the exact binary search
    assert [m["content"] for m in guess_transcript("p", "16", None)[1::2]] == ["8", "12", "14", "15", "16"]
