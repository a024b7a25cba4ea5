"""An unmodified agent on a real vLLM CPU server (issue 51).

- The tokens trained are the tokens vLLM sampled, across a multi-turn episode and one whose agent rewrites its
  history: every completion vLLM returned (recorded at the generation client) is found, in order and with its
  logprobs, among the group's trained tokens, and the text the agent read is their decoding.
- A short run whose agent fails in every counted way in turn (tests/integration/agent_faults.py) trains every step
  and MLflow shows each fault kind.
- The example agent (examples/agents/guess_agent.py, an `openai` program) trains as a command.
"""

from __future__ import annotations

import asyncio
import sys

import openai
import pytest

from async_grpo.agents.execution import FunctionAgent
from async_grpo.agents.rollout import AgentRollout
from async_grpo.config import GRPOConfig
from async_grpo.data import PromptItem, encode_prompt
from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.launch.local import run_local
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.tiny_model import build_tiny_tokenizer
from tests.agents.test_rollout import AgentRewardScorer

pytestmark = pytest.mark.integration
KINDS = ("exception", "timeout", "bad_return", "no_call", "max_turns")


class RecordingClient:
    """The real vLLM client, keeping every completion it returned (ids and logprobs), in order."""

    def __init__(self, inner: AsyncVLLMClient):
        self.inner, self.returned = inner, []

    async def generate(self, prompt_ids, **kwargs):
        out = await self.inner.generate(prompt_ids, **kwargs)
        self.returned.extend((list(prompt_ids), c.token_ids, c.logprobs) for c in out)
        return out

    async def aclose(self):
        await self.inner.aclose()


def test_trained_tokens_are_what_vllm_sampled_across_turns_and_a_rewrite(vllm_server, tiny_model_dir):
    tok = build_tiny_tokenizer()
    seen = []

    async def agent(row, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            messages = list(row["prompt"])
            for turn in range(3):
                reply = await oai.chat.completions.create(model="policy", messages=messages, max_tokens=6)
                seen.append(reply.choices[0].message.content or "")
                messages += [{"role": "assistant", "content": seen[-1]}, {"role": "user", "content": f"turn {turn}"}]
            messages = [*row["prompt"], {"role": "user", "content": "a summary replaces the history"}]
            reply = await oai.chat.completions.create(model="policy", messages=messages, max_tokens=6)
            seen.append(reply.choices[0].message.content or "")
        return 1.0

    prompt = [{"role": "user", "content": "hello"}]
    item = PromptItem(prompt, encode_prompt(tok, prompt), {})

    async def main():
        client = RecordingClient(AsyncVLLMClient(vllm_server.url, str(tiny_model_dir)))
        ro = AgentRollout(AgentRewardScorer(), tok, FunctionAgent(agent), max_turns=8, timeout_s=120.0)
        try:
            group = await ro(client, item, SamplingSettings(1, 200, 1.0), version=lambda: 0)
        finally:
            await ro.aclose()
            ro.close()
            await client.aclose()
        return group, client.returned

    group, returned = asyncio.run(main())
    assert len(returned) == 4
    # the sampled ids, decoded as the agent reads them, are what it read
    assert seen == [tok.decode(ids, skip_special_tokens=True) for _, ids, _ in returned]
    # a re-render that reproduces the sampled ids continues the row; the rewrite always starts a new one
    assert group.episode_index[-1] == 0 and group.size >= 2
    trained = [
        (t, lp)
        for ids, mask, lps in zip(group.completion_ids, group.loss_mask, group.sampling_logprobs, strict=True)
        for t, m, lp in zip(ids, mask, lps, strict=True)
        if m
    ]
    assert trained == [(t, lp) for _, ids, lps in returned for t, lp in zip(ids, lps, strict=True)]
    for row in [group.prompt_ids + ids for ids in group.completion_ids]:  # every call sits at its place in a row
        assert any(row[: len(p) + len(ids)] == p + ids for p, ids, _ in returned)
    assert group.rollout_stats["agent/history_rewrites"][0] == group.size - 1 >= 1


def _run(vllm_server, tiny_model_dir, tmp_path, child_pids, steps, max_turns=2, timeout_s=3.0, eval_prompts=4, **agent):
    import mlflow

    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir), dataset="builtin:guess", max_turns=max_turns, agent_timeout_s=timeout_s,
        reward_funcs=["builtin:agent_reward"], output_dir=str(tmp_path / "run"), vllm_url=vllm_server.url,
        max_steps=steps, vllm_sync_interval=1, per_device_train_batch_size=8, gradient_accumulation_steps=1,
        num_generations=4, max_completion_length=96, eval_num_prompts=eval_prompts, num_generations_eval=2, torch_num_threads=1,
        learning_rate=1e-4, save_model=False, max_staleness=4, **agent,
    )  # fmt: skip
    before = child_pids()
    summary = run_local(config, progress=False)
    assert summary.steps == steps
    assert not child_pids() - before, "processes left behind by the run"
    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()

    def history(name: str) -> list[float]:
        return [m.value for m in client.get_metric_history(summary.run_id, name)]

    return summary, history


def test_a_run_counts_every_agent_fault_in_mlflow_and_goes_on(vllm_server, tiny_model_dir, tmp_path, child_pids):
    summary, history = _run(
        vllm_server, tiny_model_dir, tmp_path, child_pids, 3, agent="tests/integration/agent_faults.py:play"
    )
    for kind in KINDS:
        assert sum(history(f"agent/faults/{kind}")) > 0, kind
    assert sum(history("agent/refused/max_turns")) > 0
    assert len(history("agent/calls_per_episode/mean")) == 3
    assert history("eval/agent/fault_frac"), "the held-out evaluation ran the agent too"


def test_the_example_agent_trains_as_a_command(vllm_server, tiny_model_dir, tmp_path, child_pids):
    summary, history = _run(
        vllm_server,
        tiny_model_dir,
        tmp_path,
        child_pids,
        1,
        max_turns=5,
        timeout_s=60.0,
        eval_prompts=1,
        agent_command=[sys.executable, "examples/agents/guess_agent.py"],
    )  # fmt: skip  (one step: each episode starts a Python with `openai`, about a second of CPU)
    calls = history("agent/calls_per_episode/mean")
    assert len(calls) == 1 and all(c >= 1.0 for c in calls)
    assert all(f == 0.0 for f in history("agent/fault_frac")), history("agent/fault_frac")
