"""The agent rollout (agents.rollout) with the real endpoint and `openai` client, against a scripted
generation client (tests/integration/test_agents.py runs it on a real vLLM server): the trained tokens are the
sampled ones across a multi-turn episode and a rewritten history, each episode's advantage is computed once, and
every fault is counted while the group is still scored."""

from __future__ import annotations

import asyncio
import math
import sys
from concurrent.futures import Future

import openai
import pytest

from async_grpo.agents.execution import CommandAgent, FunctionAgent
from async_grpo.agents.rollout import AGENT_LOG_COLUMN, AgentRollout
from async_grpo.data import PromptItem, encode_prompt
from async_grpo.inference.client import Completion
from async_grpo.orchestrator.batching import agent_metrics, make_train_batch
from async_grpo.orchestrator.rollout import RolloutDropped, SamplingSettings
from async_grpo.rewards.agent_reward import agent_reward
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.transports.scorer import ScoredGroup

IM_END = 258


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class AgentRewardScorer:
    """Scores with builtin:agent_reward in-process (a `Scorer`)."""

    names, weights = ["agent_reward"], [1.0]

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        self.completions, self.columns = completions, columns
        values = agent_reward(prompts, completions, completion_ids, **columns)
        out: Future = Future()
        out.set_result(ScoredGroup([[math.nan if v is None else v] for v in values]))
        return out

    def close(self) -> None:
        pass


class CountingClient:
    """Answers every request with the digits of how many requests came before it, then <|im_end|>; keeps what it
    sampled (ids and logprobs) per request, so a test can compare the trained rows with it."""

    def __init__(self, tok, abort_at=None):
        self.tok, self.abort_at, self.sampled = tok, abort_at, []

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None,
                       extra_body=None):  # fmt: skip
        k = len(self.sampled)
        ids = (self.tok.encode(str(k), add_special_tokens=False) + [IM_END])[:max_tokens]
        logprobs = [-(k + 1) / 100 - i / 1000 for i in range(len(ids))]
        self.sampled.append((list(prompt_ids), ids, logprobs))
        finish = "abort" if self.abort_at == k else "stop"
        return [Completion(ids, logprobs, "", finish)]


def item(tok):
    prompt = [{"role": "user", "content": "count with me"}]
    return PromptItem(prompt, encode_prompt(tok, prompt), {"answer": "3"})


def run(ro, client, it, g, versions=None, seed=None):
    counter = iter(versions or range(1000))

    async def main():
        try:
            return await ro(client, it, SamplingSettings(g, 200, 1.0), version=lambda: next(counter), seed=seed)
        finally:
            await ro.aclose()
            ro.close()

    return asyncio.run(main())


async def chat(oai, messages):
    reply = await oai.chat.completions.create(model="policy", messages=messages)
    return reply.choices[0].message.content


def test_trained_tokens_are_the_sampled_ones_across_turns_and_a_rewritten_history(tok):
    async def agent(row, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            messages = list(row["prompt"])
            for _ in range(2):  # two turns, each answered by the user
                messages += [{"role": "assistant", "content": await chat(oai, messages)},
                             {"role": "user", "content": "and?"}]  # fmt: skip
            # the agent rewrites its history (a summary replaces the turns), then goes on from it twice
            messages = [*row["prompt"], {"role": "user", "content": "summary: two turns done"}]
            messages += [{"role": "assistant", "content": await chat(oai, messages)}, {"role": "user", "content": "!"}]
            await chat(oai, messages)
            return float(row["answer"])

    client = CountingClient(tok)
    group = run(AgentRollout(AgentRewardScorer(), tok, FunctionAgent(agent), max_turns=8, timeout_s=20.0),
                client, item(tok), g=1)  # fmt: skip
    assert group.episode_index == [0, 0] and group.size == 2  # one episode, two segments
    assert group.rollout_stats["agent/history_rewrites"] == [1.0, 1.0]
    assert group.rollout_stats["agent/calls"] == [4.0, 4.0]
    # every row is the group prompt + its completion; its trained tokens are exactly what was sampled, in order
    rows = [group.prompt_ids + ids for ids in group.completion_ids]
    calls_of_row = [client.sampled[:2], client.sampled[2:]]
    for row, mask, lps, calls in zip(rows, group.loss_mask, group.sampling_logprobs, calls_of_row, strict=True):
        assert [t for t, m in zip(row[len(group.prompt_ids) :], mask, strict=True) if m] == [
            t for _, ids, _ in calls for t in ids
        ]
        assert [lp for lp, m in zip(lps, mask, strict=True) if m] == [lp for _, _, lp in calls for lp in lp]
        for prompt_ids, ids, _ in calls:  # each call's prompt and completion sit in the row at their place
            assert row[: len(prompt_ids) + len(ids)] == prompt_ids + ids
    assert group.rewards_per_func == [[3.0], [3.0]]  # both rows carry the episode's reward


def test_each_episode_counts_once_in_the_advantage(tok):
    """Two episodes, one of which is two rows: the advantage is computed over the two episodes' rewards."""

    async def agent(row, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            first = await chat(oai, list(row["prompt"]))
            if first == "0":  # the first episode to be served rewrites its history once
                await chat(oai, [{"role": "user", "content": "something else"}])
                return 1.0
            return 0.0

    group = run(AgentRollout(AgentRewardScorer(), tok, FunctionAgent(agent), max_turns=4, timeout_s=20.0),
                CountingClient(tok), item(tok), g=2)  # fmt: skip
    assert sorted(group.episode_index) == group.episode_index and group.size == 3
    batch = make_train_batch([group], ["agent_reward"], [1.0], "group")
    by_episode = {e: a for e, a in zip(group.episode_index, group.advantages, strict=True)}
    assert sorted(by_episode.values()) == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-4)
    assert [by_episode[e] for e in group.episode_index] == group.advantages
    assert batch.metrics["reward"] == pytest.approx(0.5)  # two episodes, not three rows
    assert batch.metrics["agent/segments_per_episode"] == pytest.approx(1.5)


def test_faults_are_counted_and_the_group_is_still_scored(tok):
    calls = {"n": 0}

    async def agent(row, base_url, api_key):
        calls["n"] += 1
        kind = calls["n"]
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            if kind == 1:
                return None  # no model call
            await chat(oai, list(row["prompt"]))
            if kind == 2:
                raise RuntimeError("crashed after one call")
            if kind == 3:
                await asyncio.sleep(30)  # hangs past the time-out
            if kind == 4:
                try:
                    await chat(oai, list(row["prompt"]))
                except openai.BadRequestError:  # max_turns=1: refused, seen by the agent
                    return 0.5
            if kind == 5:
                return "not a number"
            return 1.0

    scorer = AgentRewardScorer()
    ro = AgentRollout(scorer, tok, FunctionAgent(agent), max_turns=1, timeout_s=2.0)
    group = run(ro, CountingClient(tok), item(tok), g=6)
    assert group.size == 6 and group.episode_index == list(range(6))
    metrics = agent_metrics([group])
    for kind in ("no_call", "exception", "timeout", "max_turns", "bad_return"):
        assert metrics[f"agent/faults/{kind}"] == pytest.approx(1 / 6), kind
    assert metrics["agent/fault_frac"] == pytest.approx(5 / 6)
    assert metrics["agent/refused/max_turns"] == pytest.approx(1 / 6)
    # the episode without a call is one loss-masked token, scored with the others
    rows = dict(zip(group.rollout_stats["agent/calls"], range(6), strict=False))
    no_call = rows[0.0]
    assert group.completion_ids[no_call] == [tok.eos_token_id] and group.loss_mask[no_call] == [0]
    rewards = sorted(r[0] for r in group.rewards_per_func if not math.isnan(r[0]))
    assert rewards == [0.5, 1.0]  # max_turns returned 0.5, the healthy episode 1.0; faults give None
    assert "crashed after one call" in "".join(group.reward_extra[AGENT_LOG_COLUMN])


def test_a_group_without_any_call_is_dropped(tok):
    async def idle(row, base_url, api_key):
        return 1.0

    ro = AgentRollout(AgentRewardScorer(), tok, FunctionAgent(idle), max_turns=2, timeout_s=2.0)
    with pytest.raises(RolloutDropped) as err:
        run(ro, CountingClient(tok), item(tok), g=2)
    assert err.value.reason == "agent_no_call"


def test_an_aborted_call_drops_the_group(tok):
    async def agent(row, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            try:
                await chat(oai, list(row["prompt"]))
            except openai.InternalServerError:
                return None
            return 1.0

    ro = AgentRollout(AgentRewardScorer(), tok, FunctionAgent(agent), max_turns=2, timeout_s=5.0)
    with pytest.raises(RolloutDropped) as err:
        run(ro, CountingClient(tok, abort_at=0), item(tok), g=2)
    assert err.value.reason == "aborted"


def test_the_example_agent_runs_unchanged_as_a_command(tok):
    """examples/agents/guess_agent.py, an ordinary `openai` program, as `agent_command`: the game it plays against
    a client that guesses 0, 1, 2, ... reaches the secret 3 at the fourth guess: reward 0.9 ** 3."""
    guess = PromptItem([{"role": "user", "content": "guess a number from 1 to 16."}], [1], {"answer": "3"})
    guess = PromptItem(guess.prompt, encode_prompt(tok, guess.prompt), guess.columns)
    ro = AgentRollout(AgentRewardScorer(), tok, CommandAgent([sys.executable, "examples/agents/guess_agent.py"]),
                      max_turns=5, timeout_s=60.0)  # fmt: skip
    group = run(ro, CountingClient(tok), guess, g=1)
    assert group.rewards_per_func == [[pytest.approx(0.9**3)]]
    assert group.rollout_stats["agent/calls"] == [4.0] and group.rollout_stats["agent/segments"] == [1.0]
    replies = [m["content"] for m in group.completions[0] if m["role"] == "user"]
    assert replies == ["higher", "higher", "higher"]
