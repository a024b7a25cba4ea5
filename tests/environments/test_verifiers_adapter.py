"""The verifiers adapter (`environment: verifiers:<module:factory or env-id>`) on a verifiers 0.4 environment
defined locally (tests/environments/verifiers_guess.py: builtin:guess's game, its host a verifiers harness): the
protocol's episode (the harness's calls answered by the rollout's turns, the trace's reward at the end), the
rollout driving it token in and token out against a scripted generation client (tests/integration/
test_verifiers_adapter.py runs it on a real vLLM server), what it refuses (a rewritten history, the harness's own
tools, a row matching no task), episodes the rollout stops early are cancelled, and the spec errors."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from async_grpo.environments import EnvironmentCaller, EnvironmentSpecError, load_environment
from async_grpo.tasks import guess

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed")

from async_grpo.environments import verifiers_adapter  # noqa: E402
from async_grpo.orchestrator.env_rollout import EnvironmentRollout  # noqa: E402
from tests.environments import verifiers_guess  # noqa: E402
from tests.orchestrator.test_env_rollout import (  # noqa: E402
    IM_END,
    EnvRewardScorer,
    IdsClient,
    binary_search,
    guess_item,
    run,
)

M = "verifiers:tests.environments.test_verifiers_adapter"
FILE = Path(verifiers_guess.__file__).resolve()
GAME = f"verifiers:{FILE}:make_env"


class CountingEnv(vf.Env):
    """A verifiers Env subclass with no taskset of its own (built on its config's defaults, it cannot load)."""

    async def run(self, task, agents):
        pass


NOT_AN_ENV = object()


def row(secret: int, **columns) -> dict:
    return {"prompt": [{"role": "user", "content": guess.guess_prompt()}], "answer": str(secret), **columns}


def messages_after(state: dict, *turns: str) -> list[dict]:
    return [*row(0)["prompt"], *[{"role": "assistant", "content": t} for t in turns]]


@pytest.fixture
def game():
    env = load_environment(GAME)
    yield env
    env.close()
    assert not [t for t in threading.enumerate() if t.name == "async-grpo-verifiers"]


def test_an_episode_the_harness_drives_answered_turn_by_turn(game):
    async def play():
        caller = EnvironmentCaller(game, timeout_s=30)
        state: dict = {}
        opened = await caller.reset(row(5), state)
        state["messages"] = messages_after(state, "8")
        lower = await caller.step("8", state)
        state["messages"] = [*state["messages"], *lower.observation.messages, {"role": "assistant", "content": "5"}]
        won = await caller.step("5", state)
        await caller.close_episode(state)
        return opened, lower, won, state

    opened, lower, won, state = asyncio.run(play())
    assert opened.failure is None and opened.observation.messages == []  # the row's prompt opens the episode
    assert lower.observation.messages == [{"role": "user", "content": "lower"}] and not lower.observation.done
    assert won.observation.done and won.observation.reward == pytest.approx(guess.DISCOUNT)  # solved at turn 2
    assert state["verifiers_rewards"] == {"solved": pytest.approx(0.9)} and state["verifiers_task_idx"] == 4
    assert state["verifiers_stop_condition"] == "agent_completed"


@pytest.mark.parametrize("factory", ["make_env", "make_streaming_env"])
def test_the_rollout_plays_it_token_in_token_out(factory):
    game = load_environment(f"verifiers:{FILE}:{factory}")
    tok = pytest.importorskip("async_grpo.tiny_model").build_tiny_tokenizer()
    scorer = EnvRewardScorer()
    ro = EnvironmentRollout(scorer, tok, EnvironmentCaller(game, timeout_s=30), max_turns=5)
    try:
        group = run(ro, IdsClient(binary_search(tok)), guess_item(tok, 11))
    finally:
        game.close()
    assert [m["content"] for m in group.completions[0]] == ["8", "higher", "12", "lower", "10", "higher", "11"]
    turn = lambda s: tok.encode(s) + [IM_END]  # noqa: E731
    obs = lambda s: tok.encode(f"\n<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n")  # noqa: E731
    expected = turn("8") + obs("higher") + turn("12") + obs("lower") + turn("10") + obs("higher") + turn("11")
    assert group.completion_ids[0] == expected  # the sampled ids and the observations' template tokens, in order
    trained = [i for i, m in zip(expected, group.loss_mask[0], strict=True) if m]
    assert trained == turn("8") + turn("12") + turn("10") + turn("11")
    assert group.rollout_stats["env/turns"] == [4.0, 4.0] and group.rollout_stats["env/failures"] == [0.0, 0.0]
    assert group.rewards_per_func == [[pytest.approx(0.9**3)]] * 2  # the trace's reward, through env_reward
    assert scorer.columns["env_state"][0]["verifiers_rewards"] == {"solved": pytest.approx(0.729)}
    assert verifiers_adapter.live_episodes() == 0  # every episode closed


def test_an_episode_the_rollout_stops_is_cancelled_without_reward(game):
    tok = pytest.importorskip("async_grpo.tiny_model").build_tiny_tokenizer()
    ro = EnvironmentRollout(EnvRewardScorer(), tok, EnvironmentCaller(game, timeout_s=30), max_turns=2)
    group = run(ro, IdsClient(lambda p, c, s: tok.encode("1")), guess_item(tok, 9), g=2)
    assert group.rollout_stats["env/max_turns_reached"] == [1.0, 1.0] and group.rewards_per_func == [[0.0]] * 2
    assert verifiers_adapter.live_episodes() == 0


@pytest.mark.parametrize(
    ("factory", "words"),
    [("make_forgetful_env", "does not extend the conversation"), ("make_tool_offering_env", "its own tools")],
)
def test_what_would_break_token_in_token_out_fails_the_sample(factory, words):
    env = load_environment(f"verifiers:{FILE}:{factory}")
    tok = pytest.importorskip("async_grpo.tiny_model").build_tiny_tokenizer()
    try:
        ro = EnvironmentRollout(EnvRewardScorer(), tok, EnvironmentCaller(env, timeout_s=30), max_turns=4)
        client = IdsClient(lambda p, c, s: tok.encode("3"))
        group = run(ro, client, guess_item(tok, 9), g=2)
    finally:
        env.close()
    kind = "step_exception" if "extend" in words else "reset_exception"
    assert group.rollout_stats[f"env/failures/{kind}"] == [1.0, 1.0], group.rollout_stats
    assert group.rewards_per_func == [[0.0]] * 2


def test_rows_pick_their_task_by_task_idx_or_by_prompt_and_columns(game):
    async def opening(r):
        state: dict = {}
        caller = EnvironmentCaller(game, timeout_s=30)
        outcome = await caller.reset(r, state)
        await caller.close_episode(state)
        return outcome, state

    outcome, state = asyncio.run(opening(row(7)))
    assert outcome.failure is None and state["verifiers_task_idx"] == 6
    outcome, state = asyncio.run(opening(row(7, task_idx=2)))
    assert outcome.failure is None and state["verifiers_task_idx"] == 2
    outcome, _ = asyncio.run(opening(row(99)))
    assert outcome.failure == "reset_exception" and "no task" in outcome.error
    other = {"prompt": [{"role": "user", "content": "hello"}], "task_idx": 0}
    outcome, _ = asyncio.run(opening(other))
    assert outcome.failure == "reset_exception" and "other messages than the row's prompt" in outcome.error
    rows = [verifiers_adapter.task_row(t) for t in game.tasks]
    assert rows[3] == {"prompt": row(4)["prompt"], "task_idx": 3, "answer": "4"}


def test_a_factory_loads_and_the_first_reset_is_checked_before_anything_starts():
    from async_grpo.config import GRPOConfig
    from async_grpo.preflight.inputs import check_environment

    config = GRPOConfig(model_name_or_path="m", dataset="builtin:guess", environment=GAME)
    assert check_environment(config, local=True, row=row(3)) == ([], [])
    problems, _ = check_environment(config, local=True, row={"prompt": [{"role": "user", "content": "hi"}]})
    assert len(problems) == 1 and "reset failed on the dataset's first row" in str(problems[0])
    remote = GRPOConfig(model_name_or_path="m", dataset="builtin:guess", environment="verifiers:user-sim")
    problems, notes = check_environment(remote, local=False, row=None)
    assert problems == [] and "loaded in the image that runs the rollouts" in notes[0]


def test_an_installed_taskset_id_loads_as_vf_eval_would():
    env = load_environment(f"verifiers:{verifiers_guess.TASKSET_ID}")  # the taskset's own Env, else SingleAgentEnv
    try:
        assert type(env.env).__name__ == "SingleAgentEnv" and len(env.tasks) == 16
    finally:
        env.close()
    paired = load_environment(f"verifiers:user-sim+{verifiers_guess.TASKSET_ID}")  # <env-id>+<taskset-id>
    try:
        assert type(paired.env).__name__ == "UserSimEnv" and len(paired.tasks) == 16
    finally:
        paired.close()


def test_specs_that_are_no_usable_env_are_named_with_the_fix():
    with pytest.raises(EnvironmentSpecError, match="building CountingEnv on EnvConfig's defaults raised.*Fix: name a"):
        load_environment(f"{M}:CountingEnv")
    with pytest.raises(EnvironmentSpecError, match="cannot load environment 'user-sim'.*not found.*Fix: install"):
        load_environment("verifiers:user-sim")  # an env id alone: it needs a taskset (user-sim+<taskset-id>)
    with pytest.raises(EnvironmentSpecError, match="cannot load environment 'no-such-env'.*Fix: install"):
        load_environment("verifiers:no-such-env")
    with pytest.raises(EnvironmentSpecError, match="not a verifiers.v1.Env"):
        load_environment(f"{M}:NOT_AN_ENV")
    with pytest.raises(EnvironmentSpecError, match="no attribute 'Nope'"):
        load_environment(f"{M}:Nope")


def test_spec_forms_in_config():
    from async_grpo.config.sections.environments import EnvironmentsConfig

    for good in ("verifiers:user-sim", f"{M}:CountingEnv", "verifiers:envs/count.py:make_env"):
        assert EnvironmentsConfig(environment=good).environment == good
    for bad in ("verifiers:", "verifiers:builtin:guess"):
        with pytest.raises(ValueError, match="environment spec"):
            EnvironmentsConfig(environment=bad)


def test_a_missing_verifiers_package_is_named_with_the_fix(monkeypatch):
    for name in list(sys.modules):
        if name == "verifiers" or name.startswith("verifiers."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(EnvironmentSpecError, match="needs the verifiers package.*Fix: install"):
        load_environment(f"{M}:CountingEnv")
