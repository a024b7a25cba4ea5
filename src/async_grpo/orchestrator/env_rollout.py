"""The environment rollout: the model acts in an environment over several turns, token in and token out.

The multi-turn implementation of the `Rollout` seam (`orchestrator.rollout`), driving an `environments.Environment`
(docs/environments.md). Tool calling is one such environment (`environments.tools.ToolEnvironment`, docs/tools.md),
so every multi-turn rollout is this one. For one prompt and its G samples:

1. Each sample's episode is opened with `reset(row, state)` (one state dict per sample). The group shares one
   prompt: the dataset prompt plus the first successful reset's messages (re-rendered by the chat template only
   when there are any, or when the environment offers tools: then with the offered tools' JSON schemas,
   `apply_chat_template(..., tools=schemas)`). A sample whose reset failed, or opened with other messages, is still
   generated once (the group keeps G completions) and then ends, counted (`reset_*`).
2. The first turn of all G samples is one `/v1/completions` request (n = G), as `SingleTurnRollout`'s.
3. Each turn's text (its sampled ids decoded, special tokens skipped) is the action; `step(action, state)` answers
   with observation messages (role user or tool), a reward (summed into state["env_reward"]) and done. For an
   environment that offers tools the turn is first parsed by the tokenizer's own response parsing
   (`tools.parsing`) into TRL's assistant message with `tool_calls`, and its calls are put in
   state["tool_calls"] / state["malformed_tool_calls"] for `step` to run.
4. The observation messages are rendered by the chat template and exactly their tokens are appended to the held
   ids (`tools.render.tool_suffix`): the held ids, every token vLLM sampled and every observation token, in order,
   are never re-tokenized. Where a re-render of the conversation so far differs from them (a tokenizer that would
   merge the sampled tokens otherwise, a template that rewrites content) they are kept and the mismatch is
   counted (`env/template_drift`).
5. The next turn is generated from the held ids with the remaining budget. A sample stops when the environment
   says done, after `max_turns` model turns (verifiers' name; the last turn is still stepped, so its reward
   counts), when a turn or the next observation does not fit in `max_completion_length` (truncated; a turn cut by
   the budget is not stepped), or when an environment call fails (`env/failures/<kind>`). An environment call
   that raises `GroupDropped` (the tool service unreachable) drops the group with its reason. Every episode
   opened is then closed with the environment's optional `close_episode(state)`, however it stopped.

Observation tokens get `loss_mask` 0 and sampling logprob 0.0, and the policy version of the turn before them; so a
rollout straddling a weight push carries both versions and its group's staleness is its oldest token's. Reward
functions receive each completion in TRL's conversational form (the assistant turns, with `tool_calls`, and the
observations, in order) and, per completion, `env_reward` (state["env_reward"]: the sum of the rewards given, None
when none was) and `env_state` (the state's JSON-safe entries, without "messages"); a tool-calling run passes
neither (TRL's tool calling has no such columns). Per-sample counters travel in `RolloutGroup.rollout_stats` and
become the `env/*` metrics (`orchestrator.batching.env_metrics`) and, with tools, the `tools/*` ones (`tool_metrics`).

With `record_spans` (the run traces episodes, issue 53) each episode's spans go to `RolloutGroup.spans`, in the order
things happened: per model turn k (from 1) a "turn <k>" span (kind "LLM"; the first turn's request is shared by the G
samples, so they share its times), then, when the turn was stepped, one "tool <name>" span (kind "TOOL") per tool
call it made (with tools) followed by the "env step <k>" span (kind "TASK") the calls ran inside, and last the reward
spans (`rollout.score_group`). `EnvironmentRollout.__call__` lists their fields.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_grpo.data import PromptItem
from async_grpo.environments import FAILURE_KINDS, CallOutcome, EnvironmentCaller, GroupDropped
from async_grpo.environments.tools import ToolCallingSettings, ToolEnvironment, ToolObservation
from async_grpo.inference.client import Completion, GenerationClient
from async_grpo.orchestrator.rollout import RolloutDropped, SamplingSettings, generation_span, score_group
from async_grpo.tools.executor import ToolBackend
from async_grpo.tools.parsing import parse_turn, response_template
from async_grpo.tools.render import check_chat_template, render_ids, tool_suffix
from async_grpo.transports.messages import EpisodeSpan, RolloutGroup
from async_grpo.transports.scorer import Scorer

_SEED_STRIDE = 7919  # per-sample seed offset for later turns when the caller seeds (evaluation)
_PREFIX_TOKENS = 32  # held tokens decoded as the tool-call parser's prefix (enough for the assistant header)


@dataclass
class _Episode:
    """One sample being built, turn by turn, and its episode's state."""

    state: dict[str, Any]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    drift: int = 0
    step_s: float = 0.0  # seconds in the environment's `step` calls (its tools included)
    done: bool = False
    max_turns_reached: bool = False
    failures: Counter = field(default_factory=Counter)
    spans: list[EpisodeSpan] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, trained: int, version: int) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([trained] * len(ids))
        self.versions.extend([version] * len(ids))

    def fail(self, kind: str, error: str) -> None:
        self.failures[kind] += 1
        self.state["env_failure"] = kind
        self.state["env_error"] = error

    def stats(self) -> dict[str, float]:
        reward = self.state.get("env_reward")
        out = {
            "env/turns": float(self.turns),
            "env/failures": float(sum(self.failures.values())),
            "env/template_drift": float(self.drift),
            "env/done": float(self.done),
            "env/max_turns_reached": float(self.max_turns_reached),
            "env/reward": 0.0 if reward is None else float(reward),
            "env/seconds": self.step_s,
        }
        out.update({f"env/failures/{kind}": float(self.failures[kind]) for kind in FAILURE_KINDS})
        return out


async def all_or_none(coros: list) -> list:
    """Run `coros` concurrently and return their results in order; if one fails (or this is cancelled), cancel the
    others before re-raising, so no sample of a dropped group keeps generating."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _call(call: Any) -> CallOutcome:
    """Await one `EnvironmentCaller` call; an environment's `GroupDropped` drops the group (`RolloutDropped`)."""
    try:
        return await call
    except GroupDropped as err:
        raise RolloutDropped(err.reason, str(err)) from err  # type: ignore[arg-type]


def json_safe_state(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of an episode's state that survive JSON (what reward functions receive as `env_state`; the
    reward service gets them as JSON), without "messages" (the completion already carries the conversation)."""
    out = {}
    for key, value in state.items():
        if key == "messages":
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = value
    return out


class EnvironmentRollout:
    """The environment rollout (see the module docstring).

    Args:
        scorer: the run's reward backend.
        tokenizer: the policy's tokenizer (chat template, decoding, and for tools the response parsing).
        caller: the environment, wrapped with its timeout (`environments.EnvironmentCaller`); a
            `environments.tools.ToolEnvironment` makes this the tool-calling rollout.
        max_turns: most model turns per episode (verifiers' name), >= 1; None: bounded only by the environment
            and the length budget (tool calling: `max_tool_calling_iterations`).
        env_columns: pass `env_reward` and `env_state` to the reward functions (False for tool calling, whose
            reward functions get TRL's columns only).
        record_spans: record each episode's spans in `RolloutGroup.spans` (the run traces episodes,
            `log_traces_steps` > 0; see `__call__`). False (the default): `spans` stays empty and nothing is timed.

    Raises:
        ValueError: max_turns < 1, or the tokenizer has no chat template (observations are chat messages).
        ToolFormatError: (tools) the tokenizer's tool-call format is unknown (no response template).
        ChatTemplateError: (tools) the chat template cannot carry tool calls or is not prefix-preserving.
    """

    def __init__(
        self,
        scorer: Scorer,
        tokenizer: Any,
        caller: EnvironmentCaller,
        *,
        max_turns: int | None,
        env_columns: bool = True,
        record_spans: bool = False,
    ):
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1. Fix: allow the model at least one turn.")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "an environment's observations are chat messages rendered by the chat template, but the tokenizer "
                "has none. Fix: use a chat model's tokenizer."
            )
        self.scorer, self.tokenizer, self.caller, self.max_turns = scorer, tokenizer, caller, max_turns
        self.env_columns, self.record_spans = env_columns, record_spans
        self.tools: ToolEnvironment | None = caller.env if isinstance(caller.env, ToolEnvironment) else None
        # the `Rollout` seam's view of the offered tools (the tool-calling warm start renders with the same ones)
        self.tool_schemas: list[dict] = [] if self.tools is None else list(self.tools.schemas.values())
        if self.tools is not None:
            self.template = response_template(tokenizer)
            check_chat_template(tokenizer, self.tool_schemas)

    @classmethod
    def for_tools(
        cls,
        scorer: Scorer,
        tokenizer: Any,
        backend: ToolBackend,
        *,
        settings: ToolCallingSettings | None = None,
        offer_tools: bool = True,
        record_spans: bool = False,
    ) -> EnvironmentRollout:
        """The tool-calling rollout: this rollout driving a `ToolEnvironment` on `backend` (no turn limit but
        `settings.max_tool_calling_iterations` and the budget; no call timeout here, each tool call has its own;
        settings None: `ToolCallingSettings()`; `record_spans`: see the class).

        Raises:
            ToolFormatError, ChatTemplateError: see the class.
        """
        env = ToolEnvironment(backend, settings or ToolCallingSettings(), offer_tools=offer_tools)
        caller = EnvironmentCaller(env, timeout_s=None, num_threads=1)
        return cls(scorer, tokenizer, caller, max_turns=None, env_columns=False, record_spans=record_spans)

    def without_tools(self) -> EnvironmentRollout | None:
        """The same rollout offering no tools (prompts rendered without them, every call answered `error: no tools
        are available`, counted as `unknown_tool`), or None when the environment offers none
        (`Rollout.without_tools`). It shares this rollout's tool backend: close this one, not it, and records spans
        when this one does."""
        if self.tools is None:
            return None
        caller = EnvironmentCaller(self.tools.without_tools(), timeout_s=None, num_threads=1)
        return EnvironmentRollout(
            self.scorer, self.tokenizer, caller, max_turns=self.max_turns, env_columns=self.env_columns,
            record_spans=self.record_spans,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the environment's worker threads and close it (`EnvironmentCaller.close`; tools: their backend)."""
        self.caller.close()

    async def aclose(self) -> None:
        """Nothing is built on the calling loop (`Rollout.aclose`): the environment's threads are `close`'s."""

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """See `Rollout.__call__`. Raises `RolloutDropped("aborted")` when vLLM aborted a turn of any sample,
        `RolloutDropped(reason)` when an environment call raised `GroupDropped`, and ValueError for a string prompt
        (observations need conversational prompts) or a row whose `tools` column names an undeclared tool.

        With `record_spans`, `group.spans` holds G rows, each in the order things happened (start_ns/end_ns:
        wall-clock `time.time_ns()`, nanoseconds since the epoch):

            "turn <k>"    kind "LLM", one per model turn k = 1, 2, ...: the times of the request that sampled it (the
                          first turn's n=G request is shared by the G samples); attributes `prompt_tokens` (the held
                          ids sent), `completion_tokens` (sampled this turn), `policy_version` (read when the request
                          was sent), `finish_reason`; outputs {"text": the turn's text, special tokens skipped}.
            "tool <name>" kind "TOOL", one per tool call of the step after turn k (tools only; "tool error" for a
                          malformed call), in the order of its tool messages, each with its own times; inputs
                          {"arguments": the parsed arguments (None when malformed)}, outputs {"result": the text the
                          model reads, cut to max_tool_response_length}; attributes {"error": its
                          `tools.FAILURE_KINDS` kind} when it failed, else {}.
            "env step <k>" kind "TASK", the environment's `step` after turn k (a turn that is not stepped, cut by
                          the budget or after a failed reset, has none), after the tool spans that ran inside it;
                          inputs {"action": the turn's text}, outputs {"observation": the observation messages'
                          contents joined by newlines, "reward": the step's reward or None, "done": bool}; when the
                          step failed, outputs {"observation": None, "reward": None, "done": False, "error": what went
                          wrong} and attributes {"error": its `environments.FAILURE_KINDS` kind}, else {}.
            "reward <function>" kind "EVALUATOR", last, one per reward function (`rollout.score_group`)."""
        if not isinstance(item.prompt, list):
            what = "tools need" if self.tools is not None else "an environment needs"
            raise ValueError(
                f"{what} conversational prompts (a list of {{'role', 'content'}} messages), as TRL. "
                "Fix: turn each prompt into [{'role': 'user', 'content': prompt}]."
            )
        g = sampling.num_generations
        row = {"prompt": item.prompt, **item.columns}
        schemas = None if self.tools is None else self.tools.tool_schemas_for(row)
        episodes = [_Episode(self._new_state(item)) for _ in range(g)]
        try:
            return await self._run_group(client, item, sampling, row, schemas, episodes, version, seed)
        finally:  # every episode opened is closed, however the group ended (Environment.close_episode)
            await asyncio.gather(*(self.caller.close_episode(ep.state) for ep in episodes), return_exceptions=True)

    async def _run_group(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        row: dict[str, Any],
        schemas: list[dict] | None,
        episodes: list[_Episode],
        version: Callable[[], int],
        seed: int | None,
    ) -> RolloutGroup:
        """Reset, generate and step the group's episodes (see the module docstring), then score the group."""
        g = sampling.num_generations
        resets = await all_or_none([_call(self.caller.reset(row, ep.state)) for ep in episodes])
        opening = next((r.observation.messages for r in resets if r.observation is not None), [])
        for ep, outcome in zip(episodes, resets, strict=True):
            if outcome.observation is None:
                ep.fail(outcome.failure or "bad_observation", outcome.error)
            elif outcome.observation.messages != opening:
                ep.fail("reset_mismatch", "reset opened this episode with other messages than the group's first")
            else:
                self._add_reward(ep, outcome.observation.reward)
        prompt = list(item.prompt) + list(opening)
        if opening or schemas is not None:
            prompt_ids = render_ids(self.tokenizer, prompt, schemas, add_generation_prompt=True)
        else:
            prompt_ids = item.prompt_ids
        for ep in episodes:
            ep.state["messages"] = list(prompt)
        sent_at = version()
        extra = sampling.extra_body()
        start_ns = self._now()
        first = await client.generate(
            prompt_ids, n=g, max_tokens=sampling.max_completion_length, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=seed, **({"extra_body": extra} if extra else {}),
        )  # fmt: skip
        times = (start_ns, self._now())
        await all_or_none([
            self._run_episode(client, ep, prompt, prompt_ids, schemas, turn, sent_at, times, sampling, version,
                              None if seed is None else seed + _SEED_STRIDE * (i + 1))
            for i, (ep, turn) in enumerate(zip(episodes, first, strict=True))])  # fmt: skip
        stats = [self._stats(ep) for ep in episodes]
        group = RolloutGroup(
            prompt_ids=prompt_ids, completion_ids=[ep.ids for ep in episodes],
            sampling_logprobs=[ep.logprobs for ep in episodes], truncated=[ep.truncated for ep in episodes],
            completions=[ep.messages for ep in episodes], prompt=prompt, columns=item.columns,
            policy_version=sent_at, loss_mask=[ep.mask for ep in episodes],
            token_versions=[ep.versions for ep in episodes],
            rollout_stats={k: [st[k] for st in stats] for k in stats[0]},
            spans=[ep.spans for ep in episodes] if self.record_spans else [],
        )  # fmt: skip
        columns = None
        if self.env_columns:
            columns = {
                "env_reward": [ep.state.get("env_reward") for ep in episodes],
                "env_state": [json_safe_state(ep.state) for ep in episodes],
            }
        await score_group(self.scorer, group, columns, record_spans=self.record_spans)
        return group

    def _now(self) -> int:
        """`time.time_ns()` when this rollout records spans, else 0 (no clock read)."""
        return time.time_ns() if self.record_spans else 0

    def _step_spans(self, ep: _Episode, action: str, outcome: CallOutcome, start_ns: int, end_ns: int) -> None:
        """Append the spans of the step after turn `ep.turns`: its tool calls (a `ToolObservation`'s), then the step
        itself (see `__call__`)."""
        obs = outcome.observation
        for call in obs.calls if isinstance(obs, ToolObservation) else []:
            failure = {} if call.failure is None else {"error": call.failure}
            tool_span = EpisodeSpan(
                f"tool {call.name}", "TOOL", call.start_ns, call.end_ns, inputs={"arguments": call.arguments},
                outputs={"result": call.content}, attributes=failure,
            )  # fmt: skip
            ep.spans.append(tool_span)
        if obs is None:
            outputs = {"observation": None, "reward": None, "done": False, "error": outcome.error}
            attributes = {"error": outcome.failure or "bad_observation"}
        else:
            text = "\n".join(m["content"] for m in obs.messages)
            outputs, attributes = {"observation": text, "reward": obs.reward, "done": obs.done}, {}
        step_span = EpisodeSpan(
            f"env step {ep.turns}", "TASK", start_ns, end_ns, inputs={"action": action}, outputs=outputs,
            attributes=attributes,
        )  # fmt: skip
        ep.spans.append(step_span)

    def _new_state(self, item: PromptItem) -> dict[str, Any]:
        return {"prompt": item.prompt, "messages": [], "turn": 0, "max_turns": self.max_turns, "env_reward": None}

    def _stats(self, ep: _Episode) -> dict[str, float]:
        stats = ep.stats()
        if self.tools is not None:
            stats.update(self.tools.episode_stats(ep.state))
        return stats

    @staticmethod
    def _add_reward(ep: _Episode, reward: float | None) -> None:
        if reward is not None:
            ep.state["env_reward"] = (ep.state.get("env_reward") or 0.0) + float(reward)

    def _assistant_message(
        self, ep: _Episode, turn_ids: list[int], held_before: list[int], action: str, schemas: list[dict] | None
    ) -> dict:
        """The turn as an assistant message; with tools, parsed (TRL's `tool_calls`), its calls put in the state."""
        if self.tools is None:
            return {"role": "assistant", "content": action}
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        prefix = self.tokenizer.decode(held_before[-_PREFIX_TOKENS:], skip_special_tokens=False)
        parsed = parse_turn(self.tokenizer, self.template, text, prefix, schemas or None)
        ep.state["tool_calls"] = parsed.calls
        ep.state["malformed_tool_calls"] = parsed.malformed
        return parsed.message

    async def _run_episode(
        self,
        client: GenerationClient,
        ep: _Episode,
        prompt: list[dict],
        prompt_ids: list[int],
        schemas: list[dict] | None,
        turn: Completion,
        turn_version: int,
        turn_times: tuple[int, int],
        sampling: SamplingSettings,
        version: Callable[[], int],
        seed: int | None,
    ) -> None:
        """Continue one episode from its first turn until it stops (see the module docstring); `turn_times`: the
        wall-clock (start_ns, end_ns) of the first turn's request ((0, 0) when not recording spans)."""
        budget = sampling.max_completion_length
        extra = sampling.extra_body()
        while True:
            if turn.finish_reason == "abort":
                raise RolloutDropped("aborted", "vLLM aborted a turn of an environment rollout")
            held_before = prompt_ids + ep.ids
            ep.append(turn.token_ids, turn.logprobs, 1, turn_version)
            ep.turns += 1
            action = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            if self.record_spans:
                ep.spans.append(
                    generation_span(f"turn {ep.turns}", *turn_times, len(held_before), turn, turn_version, action)
                )
            ep.messages.append(self._assistant_message(ep, turn.token_ids, held_before, action, schemas))
            ep.state["turn"] = ep.turns
            ep.state["messages"] = prompt + ep.messages
            if ep.failures:  # its reset failed: one turn, not stepped
                return
            if turn.finish_reason == "length" or len(ep.ids) >= budget:
                ep.truncated = True  # an action cut off by the budget is not stepped (a cut tool call is not run)
                return
            step_start, started = self._now(), time.perf_counter()
            outcome = await _call(self.caller.step(action, ep.state))
            ep.step_s += time.perf_counter() - started
            if self.record_spans:
                self._step_spans(ep, action, outcome, step_start, time.time_ns())
            if outcome.observation is None:
                ep.fail(outcome.failure or "bad_observation", outcome.error)
                return
            obs = outcome.observation
            self._add_reward(ep, obs.reward)
            if obs.done:
                ep.done = True
                return
            if self.max_turns is not None and ep.turns >= self.max_turns:
                ep.max_turns_reached = True
                return
            if not obs.messages:
                ep.fail("bad_observation", "step returned no messages and done=False (nothing for the model to read)")
                return
            suffix = tool_suffix(self.tokenizer, prompt + ep.messages, obs.messages, schemas, prompt_ids + ep.ids)
            ep.drift += int(suffix.drift)
            if len(ep.ids) + len(suffix.ids) >= budget:  # no room for the observation and one more token
                ep.truncated = True
                return
            ep.append(suffix.ids, None, 0, turn_version)
            ep.messages.extend(dict(m) for m in obs.messages)
            ep.state["messages"] = prompt + ep.messages
            turn_version = version()
            start_ns = self._now()
            (turn,) = await client.generate(
                prompt_ids + ep.ids, n=1, max_tokens=budget - len(ep.ids), temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, seed=None if seed is None else seed + ep.turns,
                **({"extra_body": extra} if extra else {}),
            )  # fmt: skip
            turn_times = (start_ns, self._now())
