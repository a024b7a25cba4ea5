"""The tool-calling rollout (the environment rollout driving `ToolEnvironment`) against a scripted generation client (no vLLM here; tests/integration/test_tools.py runs
it on a real server): token ids, loss mask, logprobs and versions turn by turn against the chat template's rendering
of the same conversation; the stop rules; errors the model reads; the metrics."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Future

import pytest

from async_grpo.data import PromptItem
from async_grpo.environments import Environment, EnvironmentCaller, Observation, check_protocol
from async_grpo.environments.tools import TRUNCATION_MARK, ToolCallingSettings, ToolEnvironment
from async_grpo.inference.client import Completion
from async_grpo.orchestrator.batching import make_train_batch, tool_metrics
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import (
    RolloutDropped,
    SamplingSettings,
    SingleTurnRollout,
    completion_display,
    score_group,
)
from async_grpo.tasks.calc import calc_exact_match
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.executor import ToolExecutor
from async_grpo.tools.loading import load_tools
from async_grpo.tools.remote import ToolServiceError
from async_grpo.tools.render import render_ids
from async_grpo.transports.messages import RolloutGroup
from async_grpo.transports.scorer import ScoredGroup

IM_END = 258
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def backend():
    with ToolExecutor(load_tools(["builtin:calculator"]), num_workers=1, timeout_s=20.0) as ex:
        yield ex


class ExactScorer:
    """Scores with the calc task's exact-match reward, in-process (a `Scorer`)."""

    names, weights = ["calc_exact_match"], [1.0]

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        out: Future = Future()
        out.set_result(
            ScoredGroup([[r] for r in calc_exact_match(prompts, completions, completion_ids, **(columns or {}))])
        )
        return out

    def close(self) -> None:
        pass


class Scripted:
    """A `GenerationClient` whose replies come from `reply(prompt_text, call_index, sample_index)`; each reply gets
    <|im_end|> appended, is cut at max_tokens ("length"), and carries logprob -(k+1)/100 at its k-th token."""

    def __init__(self, tok, reply, finish: str = "stop"):
        self.tok, self.reply, self.finish, self.requests = tok, reply, finish, []

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.requests.append((list(prompt_ids), n, max_tokens))
        out = []
        for i in range(n):
            ids = self.tok.encode(self.reply(self.tok.decode(prompt_ids), len(self.requests) - 1, i)) + [IM_END]
            finish = self.finish
            if len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "length"
            out.append(Completion(ids, [-(k + 1) / 100 for k in range(len(ids))], "", finish))
        return out

    async def aclose(self) -> None:
        pass


def calculator_agent(prompt: str, call: int, sample: int) -> str:
    """Calls the calculator on the user's expression, then answers with the tool's result (sample 1 answers at once)."""
    if sample == 1 and call == 0:
        return "7"
    if "<|im_start|>tool\n" in prompt:
        return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    return CALL % prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]


def item(expr: str = "12*34", **columns) -> PromptItem:
    return PromptItem([{"role": "user", "content": expr}], [], {"answer": str(eval(expr)), **columns})


def run(rollout, client, it, g=2, max_len=200, versions=None, seed=None):
    counter = iter(versions or range(100))
    return asyncio.run(rollout(client, it, SamplingSettings(g, max_len, 1.0), version=lambda: next(counter), seed=seed))


def test_tokens_mask_logprobs_and_versions_turn_by_turn(tok, backend):
    rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, backend)
    client = Scripted(tok, calculator_agent)
    group = run(rollout, client, item("12*34"), versions=[5, 6, 7])
    schemas = [rollout.tools.schemas["calculator"]]
    conv = group.prompt + group.completions[0]
    assert [m["role"] for m in group.completions[0]] == ["assistant", "tool", "assistant"]
    assert group.completions[0][0]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "12*34"},
    }
    assert group.completions[0][1] == {"role": "tool", "name": "calculator", "content": "408"}
    assert group.completions[0][2] == {"role": "assistant", "content": "408"}
    rendered = render_ids(tok, conv, schemas, add_generation_prompt=False)
    assert group.prompt_ids == render_ids(tok, group.prompt, schemas, add_generation_prompt=True)
    assert group.prompt_ids + group.completion_ids[0] == rendered[:-1]  # the template's trailing "\n" is not sampled
    turn1 = tok.encode(CALL % "12*34") + [IM_END]
    tool = tok.encode("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    turn2 = tok.encode("408") + [IM_END]
    assert group.completion_ids[0] == turn1 + tool + turn2
    assert group.loss_mask[0] == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    lp = lambda ids: [-(k + 1) / 100 for k in range(len(ids))]  # noqa: E731
    assert group.sampling_logprobs[0] == lp(turn1) + [0.0] * len(tool) + lp(turn2)
    assert group.token_versions[0] == [5] * (len(turn1) + len(tool)) + [6] * len(turn2)  # read at each request
    assert group.policy_version == 5 and group.truncated == [False, False]
    assert client.requests[1][0] == group.prompt_ids + turn1 + tool  # turn 2 generated from the held ids
    assert client.requests[1][2] == 200 - len(turn1) - len(tool)  # with the remaining budget
    # sample 1 answered without a tool: one turn, all trained
    assert group.completions[1] == [{"role": "assistant", "content": "7"}] and group.loss_mask[1] == [1, 1]
    assert group.rewards_per_func == [[1.0], [0.0]]  # rewards saw the conversation's final answer
    assert group.rollout_stats["tools/calls"] == [1.0, 0.0] and group.rollout_stats["env/turns"] == [2.0, 1.0]
    assert group.rollout_stats["tools/failures"] == [0.0, 0.0] and group.rollout_stats["env/template_drift"] == [0, 0]
    assert "tool calculator: 408" in completion_display(group.completions[0])


def test_without_a_tool_call_it_equals_the_single_turn_rollout(tok, backend):
    answer = lambda prompt, call, sample: str(sample)  # noqa: E731
    multi = run(
        EnvironmentRollout.for_tools(ExactScorer(), tok, backend), Scripted(tok, answer), item("0*9"), g=3, seed=3
    )
    it = item("0*9")
    it.prompt_ids = multi.prompt_ids
    single = asyncio.run(
        SingleTurnRollout(ExactScorer(), lambda ids: tok.decode(ids, skip_special_tokens=True))(
            Scripted(tok, answer), it, SamplingSettings(3, 200, 1.0), version=lambda: 0, seed=3
        )
    )
    for name in (
        "completion_ids",
        "sampling_logprobs",
        "loss_mask",
        "token_versions",
        "truncated",
        "rewards_per_func",
        "policy_version",
    ):
        assert getattr(multi, name) == getattr(single, name), name
    assert [completion_display(c) for c in multi.completions] == [f"assistant: {i}" for i in range(3)]


def test_malformed_calls_unknown_tools_and_long_results_become_counted_error_messages(tok, backend):
    replies = {
        0: '<tool_call>{"name": "calculator", "arguments": {"expression": "1*2"</tool_call>',
        1: '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>',
        2: CALL % "(10**60)*(10**60)*(10**50)",
        3: "done",
    }
    rollout = EnvironmentRollout.for_tools(
        ExactScorer(), tok, backend, settings=ToolCallingSettings(max_tool_response_length=40)
    )
    group = run(rollout, Scripted(tok, lambda p, c, s: replies[c]), item(), g=1, max_len=1000)
    tools = [m for m in group.completions[0] if m["role"] == "tool"]
    assert tools[0]["name"] == "error" and tools[0]["content"].startswith("error: could not parse the tool call")
    assert tools[1]["content"].startswith("error: there is no tool 'abacus'")
    assert tools[2]["content"] == "1" + "0" * 39 + TRUNCATION_MARK  # verl: cut to max_tool_response_length chars
    assert group.completions[0][0]["content"].startswith("<tool_call>")  # the unparsed turn is kept as text
    stats = {k: v[0] for k, v in group.rollout_stats.items()}
    assert stats["tools/calls"] == 3 and stats["tools/failures"] == 2 and stats["env/turns"] == 4
    assert stats["tools/failures/malformed"] == 1 and stats["tools/failures/unknown_tool"] == 1
    assert stats["env/template_drift"] == 0  # the unparsed turn is kept as text, so it re-renders as sampled
    metrics = tool_metrics([group])
    assert metrics["tools/call_frequency"] == 3 and metrics["tools/failure_frequency"] == pytest.approx(2 / 3)
    assert metrics["tools/success_frequency"] == 1 and metrics["tools/turns_per_rollout/max"] == 4
    assert metrics["tools/failures/malformed"] == pytest.approx(1 / 3) and metrics["tools/seconds"] > 0


def test_stops_at_max_iterations_and_at_the_length_budget(tok, backend):
    always = lambda p, c, s: CALL % "2*2"  # noqa: E731
    rollout = EnvironmentRollout.for_tools(
        ExactScorer(), tok, backend, settings=ToolCallingSettings(max_tool_calling_iterations=2)
    )
    group = run(rollout, Scripted(tok, always), item(), g=1, max_len=400)
    assert group.rollout_stats["tools/calls"] == [2.0] and group.rollout_stats["env/turns"] == [3.0]
    assert group.rollout_stats["tools/loop_exhausted"] == [1.0] and group.truncated == [False]
    assert tool_metrics([group])["tools/loop_exhausted_frac"] == 1.0
    # budget: the first call fits, its result does not -> stop before appending it, truncated
    call_len = len(tok.encode(CALL % "2*2")) + 1
    group = run(
        EnvironmentRollout.for_tools(ExactScorer(), tok, backend),
        Scripted(tok, always),
        item(),
        g=1,
        max_len=call_len + 5,
    )
    assert group.completion_ids[0] == tok.encode(CALL % "2*2") + [IM_END] and group.truncated == [True]
    assert [m["role"] for m in group.completions[0]] == ["assistant"]
    # a turn cut by the budget: its call is not run
    group = run(
        EnvironmentRollout.for_tools(ExactScorer(), tok, backend), Scripted(tok, always), item(), g=1, max_len=20
    )
    assert len(group.completion_ids[0]) == 20 and group.truncated == [True]
    assert group.rollout_stats["tools/calls"] == [0.0]
    assert sum(m for m in group.loss_mask[0]) == 20


def test_without_tools_offers_none_and_answers_every_call_with_an_error(tok, backend):
    rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, backend).without_tools()
    client = Scripted(tok, calculator_agent)
    group = run(rollout, client, item(), g=1)
    assert "tools:" not in tok.decode(group.prompt_ids)
    assert group.completions[0][1]["content"] == "error: no tools are available"
    assert group.rollout_stats["tools/failures/unknown_tool"] == [1.0]


def test_a_row_offers_the_tools_its_tools_column_names(tok):
    with ToolExecutor(load_tools(["builtin:calculator", "tests/tools/tool_fns.py:add"]), num_workers=1) as ex:
        rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, ex)
        assert rollout.tools.offered(item().columns) == ["calculator", "add"]
        group = run(rollout, Scripted(tok, calculator_agent), item(tools=["add"]), g=1)
        assert "calculator(" not in tok.decode(group.prompt_ids) and "add(a, b)" in tok.decode(group.prompt_ids)
        assert group.completions[0][1]["content"].startswith("error: there is no tool 'calculator'")
        with pytest.raises(ValueError, match="not declared"):
            rollout.tools.offered(item(tools=["abacus"]).columns)


def test_an_aborted_turn_drops_the_group_and_string_prompts_are_refused(tok, backend):
    rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, backend)
    with pytest.raises(RolloutDropped) as err:
        run(rollout, Scripted(tok, calculator_agent, finish="abort"), item())
    assert err.value.reason == "aborted"
    with pytest.raises(ValueError, match="conversational prompts"):
        run(rollout, Scripted(tok, calculator_agent), PromptItem("12*34", [], {"answer": "408"}))


def test_batch_metrics_count_the_models_tokens_only(tok, backend):
    group = run(EnvironmentRollout.for_tools(ExactScorer(), tok, backend), Scripted(tok, calculator_agent), item())
    batch = make_train_batch([group], ["calc_exact_match"], [1.0], "group")
    generated = [sum(m) for m in group.loss_mask]
    assert batch.metrics["completions/mean_length"] == sum(generated) / 2 < sum(map(len, group.completion_ids)) / 2
    assert batch.metrics["completions/max_length"] == max(generated)
    assert batch.metrics["tools/call_frequency"] == 0.5 and batch.metrics["tools/failure_frequency"] == 0.0
    assert batch.metrics["tools/turns_per_rollout/mean"] == 1.5 and batch.metrics["tools/calls_per_rollout/max"] == 1
    assert not math.isnan(batch.metrics["tools/seconds"])


class _UnreachableService:
    """A tool backend whose service cannot be reached (`RemoteToolExecutor` raising `ToolServiceError`)."""

    tools = load_tools(["builtin:calculator"])

    async def call(self, name, arguments, *, allowed=None):
        raise ToolServiceError("the reward service at http://rewards:8000 refused the connection")

    def close(self) -> None:
        pass


def test_tools_are_an_environment_and_an_unreachable_tool_service_drops_the_group(tok):
    rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, _UnreachableService())
    assert isinstance(rollout.tools, Environment)
    check_protocol(rollout.tools, "tools")
    with pytest.raises(RolloutDropped) as err:
        run(rollout, Scripted(tok, calculator_agent), item())
    assert err.value.reason == "tool_service_error" and "refused the connection" in str(err.value)
    group = run(rollout, Scripted(tok, lambda p, c, s: "408"), item())  # no call: the service is never needed
    assert group.rollout_stats["env/done"] == [1.0, 1.0] and group.rewards_per_func == [[1.0], [1.0]]


class _AnswerEnv:
    """An environment that wants the row's answer: reward 1 and done when the turn is the answer, else `wrong`."""

    async def reset(self, row, state):
        state["target"] = row["answer"]
        return Observation([])

    async def step(self, action, state):
        if action.strip() == state["target"]:
            return Observation([], reward=1.0, done=True)
        return Observation([{"role": "user", "content": "wrong"}])


class _EnvRewardScorer(ExactScorer):
    """Scores each completion with the environment's reward (`env_reward`, 0 when None)."""

    names = ["env_reward"]

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        out: Future = Future()
        out.set_result(ScoredGroup([[float(r or 0.0)] for r in columns["env_reward"]]))
        return out


def _with_tools(backend, inner_env, max_turns=3) -> EnvironmentRollout:
    inner = EnvironmentCaller(inner_env, timeout_s=5.0, num_threads=1)
    env = ToolEnvironment(backend, ToolCallingSettings(), inner=inner)
    return EnvironmentRollout(_EnvRewardScorer(), build_tiny_tokenizer(), EnvironmentCaller(env, timeout_s=None),
                              max_turns=max_turns)  # fmt: skip


def test_an_environment_with_tools_answers_tool_turns_with_tools_and_other_turns_with_the_environment(tok, backend):
    def agent(prompt: str, call: int, sample: int) -> str:  # sample 0 calls the calculator, then answers
        return "7" if "wrong" in prompt or (call, sample) == (0, 1) else calculator_agent(prompt, call, sample)

    group = run(_with_tools(backend, _AnswerEnv()), Scripted(tok, agent), item("12*34"), g=2)
    solved, guessed = group.completions  # sample 1 guesses "7" three times
    assert [m["role"] for m in solved] == ["assistant", "tool", "assistant"] and solved[1]["content"] == "408"
    assert [m["role"] for m in guessed] == ["assistant", "user", "assistant", "user", "assistant"]
    assert guessed[1]["content"] == "wrong" and "calculator(" in tok.decode(group.prompt_ids)
    assert group.rewards_per_func == [[1.0], [0.0]]
    stats = group.rollout_stats
    assert stats["tools/calls"] == [1.0, 0.0] and stats["env/turns"] == [2.0, 3.0]
    assert stats["env/done"] == [1.0, 0.0] and stats["env/max_turns_reached"] == [0.0, 1.0]
    assert stats["env/reward"] == [1.0, 0.0] and stats["env/template_drift"] == [0.0, 0.0]
    masked = [tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
              for ids, mask in zip(group.completion_ids, group.loss_mask, strict=True)]  # fmt: skip
    assert masked[0] == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"  # observations: never trained
    assert masked[1] == "\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n" * 2


def test_the_inner_environments_failures_keep_their_kind(tok, backend):
    class _RaisingReset(_AnswerEnv):
        async def reset(self, row, state):
            raise RuntimeError("no episode today")

    group = run(_with_tools(backend, _RaisingReset()), Scripted(tok, calculator_agent), item(), g=2)
    assert group.rollout_stats["env/failures/reset_exception"] == [1.0, 1.0]
    assert group.rollout_stats["env/turns"] == [1.0, 1.0] and group.rollout_stats["tools/calls"] == [0.0, 0.0]


def test_the_single_turn_rollout_records_one_generation_span_per_completion_only_when_asked(tok):
    answer = lambda p, c, s: "408" if s == 0 else "seven"  # noqa: E731
    it = item("12*34")
    it.prompt_ids = tok.encode("12*34 =")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    settings = SamplingSettings(2, 200, 1.0)
    traced = asyncio.run(
        SingleTurnRollout(ExactScorer(), decode, record_spans=True)(
            Scripted(tok, answer), it, settings, version=lambda: 4
        )
    )
    assert [[(s.name, s.kind) for s in row] for row in traced.spans] == [
        [("generation", "LLM"), ("reward calc_exact_match", "EVALUATOR")]
    ] * 2
    for (generation, reward), ids, text in zip(traced.spans, traced.completion_ids, ["408", "seven"], strict=True):
        assert generation.attributes == {
            "prompt_tokens": len(it.prompt_ids),
            "completion_tokens": len(ids),
            "policy_version": 4,
            "finish_reason": "stop",
        }
        assert generation.outputs == {"text": text} and 0 < generation.start_ns <= generation.end_ns <= reward.start_ns
        assert reward.attributes == {}  # this scorer does not time its functions: the span covers the whole call
    assert traced.spans[0][0].start_ns == traced.spans[1][0].start_ns  # one request for the group
    assert [row[1].outputs for row in traced.spans] == [{"value": 1.0}, {"value": 0.0}]
    plain = asyncio.run(
        SingleTurnRollout(ExactScorer(), decode)(Scripted(tok, answer), it, settings, version=lambda: 4)
    )
    assert plain.spans == [] and plain.completion_ids == traced.completion_ids


class _TimedScorer:
    """Two reward functions the scorer timed (`ScoredGroup.seconds`): `first` took 0.25 s, `second` 0.5 s."""

    names, weights = ["first", "second"], [1.0, 1.0]

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        out: Future = Future()
        out.set_result(ScoredGroup([[1.0, math.nan], [0.0, 2.0]], seconds={"first": 0.25, "second": 0.5}))
        return out


def test_score_group_lays_the_timed_reward_functions_out_one_after_another():
    group = RolloutGroup([1], [[2], [3]], [[-0.1], [-0.2]], [False, False], ["a", "b"], "p", {}, policy_version=0)
    asyncio.run(score_group(_TimedScorer(), group))
    assert group.spans == []  # not asked
    asyncio.run(score_group(_TimedScorer(), group, record_spans=True))
    assert [[(s.name, s.kind) for s in row] for row in group.spans] == [
        [("reward first", "EVALUATOR"), ("reward second", "EVALUATOR")]
    ] * 2
    assert [[s.outputs["value"] for s in row] for row in group.spans] == [[1.0, None], [0.0, 2.0]]  # NaN -> None
    for first, second in group.spans:
        assert (first.attributes, second.attributes) == ({"seconds": 0.25}, {"seconds": 0.5})
        assert first.end_ns - first.start_ns == 250_000_000 and second.end_ns - second.start_ns == 500_000_000
        assert second.start_ns == first.end_ns
    assert group.spans[0][0].start_ns == group.spans[1][0].start_ns  # one call for the group


def test_a_tool_rollout_records_turns_tool_calls_and_steps_in_order_with_failure_kinds(tok, backend):
    def agent(prompt: str, call: int, sample: int) -> str:
        """Sample 0 calls the calculator, 1 an unknown tool, 2 malformed; each then answers."""
        if "<|im_start|>tool\n" in prompt:
            return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0][:5]
        malformed = '<tool_call>{"name": "calculator", "arguments": {"expression": "1*2"</tool_call>'
        return [CALL % "12*34", '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', malformed][sample]

    rollout = EnvironmentRollout.for_tools(ExactScorer(), tok, backend, record_spans=True)
    group = run(rollout, Scripted(tok, agent), item("12*34"), g=3, versions=[5, 6, 6, 6])
    names = ["turn 1", "tool {}", "env step 1", "turn 2", "env step 2", "reward calc_exact_match"]
    kinds = ["LLM", "TOOL", "TASK", "LLM", "TASK", "EVALUATOR"]
    for spans, tool in zip(group.spans, ["calculator", "abacus", "error"], strict=True):
        assert [(s.name, s.kind) for s in spans] == [(n.format(tool), k) for n, k in zip(names, kinds, strict=True)]
        turn1, call, step1, turn2, step2, reward = spans
        assert turn1.start_ns <= turn1.end_ns <= step1.start_ns <= call.start_ns <= call.end_ns <= step1.end_ns
        assert step1.end_ns <= turn2.start_ns <= turn2.end_ns <= step2.start_ns <= step2.end_ns <= reward.start_ns
        assert step1.inputs == {"action": turn1.outputs["text"]} and step2.inputs == {"action": turn2.outputs["text"]}
        assert step1.outputs == {"observation": call.outputs["result"], "reward": None, "done": False}
        assert step2.outputs == {"observation": "", "reward": None, "done": True}  # a turn without a call ends it
        assert (turn1.attributes["policy_version"], turn2.attributes["policy_version"]) == (5, 6)
        assert turn1.attributes["prompt_tokens"] == len(group.prompt_ids)
    for spans, ids, answer in zip(group.spans, group.completion_ids, ["408", "error", "error"], strict=True):
        turn2 = len(tok.encode(answer)) + 1  # with <|im_end|>
        assert spans[3].outputs == {"text": answer} and spans[3].attributes["completion_tokens"] == turn2
        assert spans[3].attributes["prompt_tokens"] == len(group.prompt_ids) + len(ids) - turn2  # turn 1 + result
    calculator, abacus, malformed = (spans[1] for spans in group.spans)
    assert calculator.inputs == {"arguments": {"expression": "12*34"}} and calculator.outputs == {"result": "408"}
    assert calculator.attributes == {}
    assert abacus.attributes == {"error": "unknown_tool"} and abacus.outputs["result"].startswith("error: there is")
    assert malformed.attributes == {"error": "malformed"} and malformed.inputs == {"arguments": None}
    assert [spans[-1].outputs for spans in group.spans] == [{"value": 1.0}, {"value": 0.0}, {"value": 0.0}]
    plain = run(EnvironmentRollout.for_tools(ExactScorer(), tok, backend), Scripted(tok, agent), item("12*34"), g=3)
    assert plain.spans == [] and plain.completion_ids == group.completion_ids
    assert rollout.without_tools().record_spans
