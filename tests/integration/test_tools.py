"""Multi-turn tool calling on a real vLLM CPU server, with real tool workers.

The tiny model is warm-started (SFT) on the calc task's reference conversations so that it calls the calculator;
then, on the session's vLLM server (tests/integration/conftest.py) serving its weights, pushed before each test:
- a rollout's token ids, loss mask and sampling logprobs are checked turn by turn against the chat template's
  rendering of the same conversation and against the trainer model's logprobs;
- a tool that hangs and one that raises become errors the model reads, and the run goes on;
- weights pushed between two turns of one rollout: the tokens carry both policy versions, and each turn's logprobs
  are those of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_grpo.config import GRPOConfig
from async_grpo.data import PromptItem
from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.runner.tool_setup import warm_start_pairs
from async_grpo.tasks import get_task
from async_grpo.tiny_model import build_tiny_model
from async_grpo.tools.executor import ToolExecutor
from async_grpo.tools.loading import load_tools
from async_grpo.tools.render import render_ids, tool_suffix
from async_grpo.trainer.sft import supervised_warm_start
from async_grpo.transports.weights.checkpoint import push_checkpoint
from async_grpo.transports.weights.sync import WeightPusher
from tests.orchestrator.test_tool_rollout import ExactScorer

pytestmark = [pytest.mark.integration, pytest.mark.slow(seconds=15)]  # 75 s for the module

SFT_STEPS = 120  # the call format has formed by then (held-out loss 0.297 at 100 steps, 0.289 at 250); seeds 0-2 pass
MODEL_FAILURES = ("malformed", "unknown_tool", "bad_arguments")  # the sampled call's fault, not the tool's
TEMPERATURE = 0.7
TOOLS = Path(__file__).with_name("calc_tools.py")


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory) -> Path:
    """The tiny model after a short SFT on calc conversations (it calls the calculator, then answers)."""
    out = build_tiny_model(tmp_path_factory.mktemp("tool-model") / "model", seed=0)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    pairs = warm_start_pairs(GRPOConfig(dataset="builtin:calc"), get_task("calc"), tok, 512, [])
    torch.manual_seed(0)
    supervised_warm_start(model, pairs, steps=SFT_STEPS, learning_rate=3e-3, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    return out


@dataclass(frozen=True)
class Served:
    """A vLLM server and the model name it serves (requests must name it)."""

    url: str
    model: str


@pytest.fixture
def server(vllm_server, tiny_model_dir, tool_model_dir) -> Served:
    """The session's vLLM server serving the tool model: its weights pushed from its files before each test (same
    layout as the session's model; another test may have pushed other weights since)."""
    push_checkpoint(tool_model_dir, vllm_server.url, vllm_dtype="float32", backend="gloo", timeout_s=120)
    return Served(vllm_server.url, str(tiny_model_dir))


@pytest.fixture(scope="module")
def tok(tool_model_dir):
    return AutoTokenizer.from_pretrained(tool_model_dir)


def rollout_group(server, tool_model_dir, tok, backend, expr="347*912", g=4, seed=1, version=lambda: 0):
    async def go():
        client = AsyncVLLMClient(server.url, server.model)
        try:
            rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, backend)
            item = PromptItem([{"role": "user", "content": expr}], [], {"answer": str(eval(expr))})
            return await rollout(client, item, SamplingSettings(g, 160, TEMPERATURE), version=version, seed=seed)
        finally:
            await client.aclose()

    return asyncio.run(go())


def trainer_logps(model, prompt_ids, completion_ids) -> torch.Tensor:
    """The model's per-token logprobs of the completion at the sampling temperature."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in `mask`."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_turn_by_turn_against_the_chat_template_and_the_trainer(server, tool_model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32)
    with ToolExecutor(load_tools(["builtin:calculator"]), num_workers=1) as backend:
        group = rollout_group(server, tool_model_dir, tok, backend, g=4)
    schemas = [t.schema for t in backend.tools]
    assert group.prompt_ids == render_ids(tok, group.prompt, schemas, add_generation_prompt=True)
    called = [i for i in range(4) if group.rollout_stats["tools/calls"][i] > 0]
    assert called, f"the warm-started model called no tool: {group.completions}"
    for i in called:
        ids, mask, lps, conv = (
            group.completion_ids[i],
            group.loss_mask[i],
            group.sampling_logprobs[i],
            group.completions[i],
        )
        spans = runs(mask)
        assistants = [m for m in conv if m["role"] == "assistant"]
        assert [v for v, _, _ in spans] == [1, 0] * (len(assistants) - 1) + [1]  # turns alternate with tool output
        held = list(group.prompt_ids)
        k = 0  # index into conv
        for value, start, end in spans:
            if value == 1:  # an assistant turn: exactly vLLM's tokens, ending in its stop token unless cut
                assert conv[k]["role"] == "assistant"
                k += 1
            else:  # tool output: exactly the chat template's tokens for the tool messages that follow the turn
                tools = []
                while k < len(conv) and conv[k]["role"] == "tool":
                    tools.append(conv[k])
                    k += 1
                expected = tool_suffix(tok, group.prompt + conv[: k - len(tools)], tools, schemas, held).ids
                assert ids[start:end] == expected
                assert all(lp == 0.0 for lp in lps[start:end])
            held += ids[start:end]
        if group.rollout_stats["env/template_drift"][i] == 0:  # the model wrote the template's own format
            rendered = render_ids(tok, group.prompt + conv, schemas, add_generation_prompt=False)
            assert group.prompt_ids + ids == rendered[: len(group.prompt_ids) + len(ids)]
        logps = trainer_logps(model, group.prompt_ids, ids)  # what the trainer sees is what vLLM sampled from
        trained = torch.tensor(mask, dtype=torch.bool)
        assert float((logps[trained] - torch.tensor(lps)[trained]).abs().max()) < 2e-3
        assert set(group.token_versions[i]) == {0}


def test_a_hanging_and_a_raising_tool_are_errors_the_model_reads(server, tool_model_dir, tok):
    for name, timeout_s, kind in (
        ("hanging", 2.0, "timeout"),
        ("raising", 10.0, "exception"),
    ):
        with ToolExecutor(load_tools([f"{TOOLS}:{name}"]), num_workers=1, timeout_s=timeout_s) as backend:
            t0 = time.monotonic()
            group = rollout_group(server, tool_model_dir, tok, backend, g=2, seed=3)
            elapsed = time.monotonic() - t0
        stats = group.rollout_stats
        calls = stats["tools/calls"]
        failures = {k: v for k, v in stats.items() if k.startswith("tools/failures/")}
        # the sampled model may also write a malformed call (its own failure, counted apart); every call that reached
        # the tool failed with `kind`
        model_side = [sum(stats[f"tools/failures/{k}"][i] for k in MODEL_FAILURES) for i in range(len(calls))]
        reached = [c - m for c, m in zip(calls, model_side, strict=True)]
        assert sum(reached) >= 1, (failures, group.completions)
        assert stats[f"tools/failures/{kind}"] == reached, (failures, group.completions)
        for conv, n in zip(group.completions, calls, strict=True):
            if n:
                tool_msgs = [m for m in conv if m["role"] == "tool"]
                assert all(m["content"].startswith("error: ") for m in tool_msgs)
                assert conv[-1]["role"] == "assistant"  # the model went on after reading the error
        assert group.rewards_per_func is not None and elapsed < 120


class PushBetweenTurns:
    """A tool backend that, on its first call, pushes new weights to vLLM (version 1) before running the call: the
    rollout's next turn is then sampled by the new weights."""

    def __init__(self, inner: ToolExecutor, pusher: WeightPusher, version: list[int]):
        self.inner, self.pusher, self.version, self.tools = inner, pusher, version, inner.tools

    async def call(self, name, arguments, *, allowed=None):
        if self.version[0] == 0:
            await asyncio.to_thread(self.pusher.push, 1)
            self.version[0] = 1
        return await self.inner.call(name, arguments, allowed=allowed)

    def close(self) -> None:
        self.inner.close()


def test_weights_pushed_between_turns_give_tokens_of_both_versions(server, tool_model_dir, tok):
    old = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    pusher = WeightPusher(new, server.url, backend="gloo", timeout_s=120)
    version = [0]
    try:
        with ToolExecutor(load_tools(["builtin:calculator"]), num_workers=1) as inner:
            group = rollout_group(
                server,
                tool_model_dir,
                tok,
                PushBetweenTurns(inner, pusher, version),
                g=1,
                seed=5,
                version=lambda: version[0],
            )
    finally:
        pusher.close()
    assert version == [1] and group.rollout_stats["env/turns"][0] >= 2, group.completions
    ids, mask, lps, versions = (
        group.completion_ids[0],
        group.loss_mask[0],
        group.sampling_logprobs[0],
        group.token_versions[0],
    )
    (v1, s1, e1), (v0, s0, e0), (v2, s2, e2) = runs(mask)[:3]
    assert (v1, v0, v2) == (1, 0, 1)
    assert set(versions[s1:e1]) == {0} and set(versions[s2:e2]) == {1}  # each turn: the version that sampled it
    assert group.policy_version == 0 and sorted(set(versions)) == [0, 1]  # staleness counts from the oldest token
    lps = torch.tensor(lps)
    first, second = torch.zeros(len(ids), dtype=torch.bool), torch.zeros(len(ids), dtype=torch.bool)
    first[s1:e1], second[s2:e2] = True, True
    old_lp, new_lp = trainer_logps(old, group.prompt_ids, ids), trainer_logps(new, group.prompt_ids, ids)
    assert float((old_lp[first] - lps[first]).abs().max()) < 2e-3  # turn 1: the old weights
    assert float((new_lp[second] - lps[second]).abs().max()) < 2e-3  # turn 2: the pushed weights
    assert float((old_lp[second] - lps[second]).abs().max()) > 1e-2  # ... which differ


@pytest.mark.parametrize(
    "shaping",
    [
        {
            "replay_buffer_size": 4,
            "reroll_start_fraction": 0.0,
            "off_policy_mask_threshold": 0.5,
            "vllm_importance_sampling_mode": "token_mask",
            "max_staleness": 1,
        },
        {
            "dynamic_sampling": True,
            "max_gen_batches": 20,
            "importance_sampling_level": "sequence",
            "vllm_importance_sampling_mode": "sequence_truncate",
            "streaming_min_groups": 1,
        },
    ],
    ids=["replay-reroll-opsm", "dynamic-sampling-streaming"],
)
def test_a_tool_run_with_async_staleness_is_opsm_and_batch_shaping(server, tool_model_dir, tmp_path, shaping):
    """A short real run (the recipe, reward workers, tool workers, MLflow) on the warm-started model with the async
    pipeline's features on: it finishes, logs the tool metrics for training and evaluation, and the final model's
    held-out reward without tools."""
    import mlflow

    from async_grpo.launch.local import run_local

    config = GRPOConfig(**{
        "model_name_or_path": str(tool_model_dir), "vllm_url": server.url, "dataset": "builtin:calc",
        "tools": ["builtin:calculator"], "tool_num_workers": 1, "max_tool_calling_iterations": 2,
        "reward_funcs": ["builtin:calc_exact_match", "builtin:calc_format", "builtin:calc_call_match"],
        "reward_num_workers": 1, "output_dir": str(tmp_path / "run"), "num_generations": 4,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_completion_length": 160,
        "temperature": TEMPERATURE, "max_inflight_groups": 4, "torch_num_threads": 1, "learning_rate": 1e-4,
        "save_model": False, "log_completions_steps": 2, "max_steps": 4, "eval_num_prompts": 4,
        "num_generations_eval": 2, "log_traces_steps": 2, "log_traces_per_step": 2, **shaping,
    })  # fmt: skip
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED" and summary.steps == 4
    metrics = run.data.metrics
    for key in (
        "tools/call_frequency",
        "tools/failure_frequency",
        "tools/turns_per_rollout/mean",
        "tools/seconds",
        "eval/tools/call_frequency",
        "eval_no_tools/reward",
        "eval_no_tools/tools/failures/unknown_tool",
    ):
        assert key in metrics, key
    assert metrics["tools/turns_per_rollout/max"] >= 2  # the warm-started model calls the calculator
    assert "eval_no_tools/reward" in summary.eval_after
    assert not {k for k in summary.dropped_groups if k not in ("zero_std", "shutdown", "stale", "unconsumed_at_end")}, (
        summary.dropped_groups
    )
    # issue 53: the episodes of steps 2 and 4 (up to 2 groups x 4 episodes each) as traces of the run, read back. A
    # streamed step may train fewer groups: a group that went stale on the queue is dropped there (`stale`, allowed
    # above), so each traced step's own `groups` metric says how many it had
    groups = {m.step: int(m.value) for m in client.get_metric_history(summary.run_id, "groups")}
    expected = sum(4 * min(2, groups[step]) for step in (2, 4))
    traces = mlflow.search_traces(run_id=summary.run_id, return_type="list")
    assert len(traces) == expected >= 8
    names = {"calc_exact_match", "calc_format", "calc_call_match"}
    tool_calls = []
    for trace in traces:
        root, spans = trace.data.spans[0], trace.data.spans[1:]
        assert root.name == "episode" and root.attributes["step"] in (2, 4)
        assert trace.info.tags["async_grpo.step"] == str(root.attributes["step"])
        by_name = {s.name: s for s in spans}
        turn = by_name["turn 1"]
        assert turn.span_type == "LLM" and turn.attributes["policy_version"] == root.attributes["policy_version"]
        assert turn.attributes["completion_tokens"] >= 1 and turn.outputs["text"]
        assert {f"reward {n}" for n in names} <= set(by_name)
        for n in names:  # each function's span holds the value the episode's reward was made of
            assert by_name[f"reward {n}"].outputs["value"] == root.outputs["rewards"][n]
            assert by_name[f"reward {n}"].span_type == "EVALUATOR"
        tool_calls += [(s, by_name) for s in spans if s.span_type == "TOOL"]
    assert tool_calls, "the warm-started model calls the calculator"
    for call, by_name in tool_calls:
        parent = next(s for s in by_name.values() if s.span_id == call.parent_id)
        assert parent.name.startswith("env step ") and parent.span_type == "TASK"  # the call ran inside its step
        assert "result" in call.outputs and "arguments" in call.inputs
