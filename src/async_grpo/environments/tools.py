"""Tool calling as an environment: the model calls tools, the environment runs them and answers with their results.

`ToolEnvironment` implements the `Environment` protocol (`environments.base`), so the tool-calling rollout is the
environment rollout (`orchestrator.env_rollout.EnvironmentRollout`) driving this environment, not a second
mechanism. It follows verifiers' `ToolEnv` (before 0.4): the episode goes on while the model calls tools, and a turn
without a tool call ends it (verifiers' `is_completed`). Given the run's `environment` as `inner`, it is that
environment with tools (verifiers' `StatefulToolEnv`): a turn that calls tools is answered by the tools, a turn
without a call is the environment's action (its `step` answers, rewards and ends the episode), and the episode opens
with the environment's `reset`. The inner environment's failures keep their kinds (`EnvironmentCallFailed`).

What the rollout does for an environment that offers tools (it recognises this class): it renders the prompt with
the offered tools' JSON schemas (`tool_schemas_for(row)`), parses each turn with the tokenizer's own response parsing
(`tools.parsing.parse_turn`) into TRL's assistant message with `tool_calls`, and before `step` puts that turn's
calls in the episode's state:

    state["tool_calls"]           the well-formed calls of the last turn, in order, as (name, arguments)
    state["malformed_tool_calls"] one description per call that could not be used (unparseable JSON, no name, ...)

`step` then runs the well-formed calls concurrently in the tool backend (`tools.ToolBackend`: local worker
processes or the reward service, each call under `tool_timeout_s` and resource limits). Every failing call (a
malformed call, an unknown tool, bad arguments, a raising, hanging or crashing tool) becomes an `error: ...` tool
message the model reads, counted by kind (`tools.FAILURE_KINDS`); the run never sees an exception from a tool. A
tool service that cannot be reached is not the model's fault: the call raises `GroupDropped("tool_service_error")`
and the rollout drops the group, counted. Each result is cut to `max_tool_response_length` characters (verl's
rule). After `max_tool_calling_iterations` rounds (TRL's name) a turn that still calls tools ends the episode,
counted as `tools/loop_exhausted`.

The per-episode counters live in the state (`state["tool_counts"]`) and come back through `episode_stats` as the
`tools/*` rollout stats (`orchestrator.batching.tool_metrics`). A turn that called tools is answered with a
`ToolObservation`: the tool messages plus how each call ran (`ToolCallRecord`: name, arguments, result, failure kind,
wall-clock start and end), which the rollout turns into the "tool <name>" spans of the episode traces (issue 53).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from async_grpo.environments.base import EnvironmentCallFailed, GroupDropped, Observation
from async_grpo.environments.calls import CallOutcome, EnvironmentCaller
from async_grpo.tools.executor import FAILURE_KINDS, ToolBackend, ToolOutcome, failed
from async_grpo.tools.remote import ToolServiceError

TRUNCATION_MARK = "...(truncated)"


@dataclass(frozen=True)
class ToolCallingSettings:
    """Tool-calling limits (TRL / verl names).

    Attributes:
        max_tool_calling_iterations: most tool-calling rounds per episode (TRL's `max_tool_calling_iterations`);
            None: bounded only by the length budget.
        max_tool_response_length: a tool result longer than this many characters is cut to it, with
            TRUNCATION_MARK appended (verl's `max_tool_response_length`, right-side truncation).
    """

    max_tool_calling_iterations: int | None = None
    max_tool_response_length: int = 256


@dataclass(frozen=True)
class ToolCallRecord:
    """How one tool call of a step ran (the rollout's "tool <name>" span of the episode trace).

    Attributes:
        name: the tool's name as the model called it; "error" for a malformed call (the `name` of its tool
            message: a call that could not be parsed has no tool name).
        arguments: the call's arguments as parsed from the turn (JSON values); None for a malformed call.
        content: the text the model reads as the tool's answer (the result, or `error: ...` on failure), cut to
            `max_tool_response_length` characters as in the tool message.
        failure: None on success, else one of `tools.FAILURE_KINDS` ("malformed", "unknown_tool", "bad_arguments",
            "exception", "timeout", "crashed", "output_limit", "sandbox").
        start_ns, end_ns: wall-clock times (`time.time_ns()`, nanoseconds since the epoch) around the call as
            awaited by the environment (a wait for a free tool worker included); equal for a malformed call (never
            run).
    """

    name: str
    arguments: Any
    content: str
    failure: str | None
    start_ns: int
    end_ns: int


@dataclass
class ToolObservation(Observation):
    """`ToolEnvironment.step`'s answer to a turn that called tools: the tool messages (an `Observation`) and how
    each call ran.

    Attributes:
        calls: one `ToolCallRecord` per tool message, in the same order (well-formed calls in the turn's order,
            then the malformed ones).
    """

    calls: list[ToolCallRecord] = field(default_factory=list)


def truncate_response(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with TRUNCATION_MARK appended when longer (verl's right-side truncation)."""
    return text if len(text) <= limit else text[:limit] + TRUNCATION_MARK


class ToolEnvironment:
    """Tools as an environment (see the module docstring).

    One object serves every episode of the run, concurrently; per-episode counters live in the episode's state.

    Args:
        backend: where the calls run (`tools.ToolExecutor` or `tools.remote.RemoteToolExecutor`); closed by `close`.
        settings: the tool-calling limits.
        offer_tools: False renders prompts without tools and answers every call with `error: no tools are
            available` (counted as `unknown_tool`): the same model "without tools", for comparison.
        inner: the run's `environment` (wrapped with its own timeout), or None for tool calling alone.
    """

    def __init__(
        self,
        backend: ToolBackend,
        settings: ToolCallingSettings = ToolCallingSettings(),
        *,
        offer_tools: bool = True,
        inner: EnvironmentCaller | None = None,
    ):
        self.backend, self.settings, self.offer_tools, self.inner = backend, settings, offer_tools, inner
        self.schemas: dict[str, dict] = {t.name: t.schema for t in backend.tools}

    def without_tools(self) -> ToolEnvironment:
        """The same environment offering no tools (`offer_tools=False`), on the same backend and inner environment
        (close this one, not it)."""
        return ToolEnvironment(self.backend, self.settings, offer_tools=False, inner=self.inner)

    def offered(self, row: Mapping[str, Any]) -> list[str]:
        """The tool names offered to a dataset row: its `tools` column when present (a list of names), else all
        declared tools; [] when tools are not offered.

        Raises:
            ValueError: the column names a tool that is not declared.
        """
        if not self.offer_tools:
            return []
        names = row.get("tools")
        if names is None:
            return list(self.schemas)
        unknown = [n for n in names if n not in self.schemas]
        if unknown:
            raise ValueError(
                f"dataset column 'tools' names {unknown}, which are not declared in `tools` "
                f"({sorted(self.schemas)}). Fix: declare them, or fix the column."
            )
        return list(names)

    def tool_schemas_for(self, row: Mapping[str, Any]) -> list[dict]:
        """The JSON schemas the prompt of `row` is rendered with (those of `offered(row)`, in order).

        Raises:
            ValueError: see `offered`.
        """
        return [self.schemas[n] for n in self.offered(row)]

    async def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> Observation:
        """Open an episode: the offered names and zeroed counters in `state`; then the inner environment's `reset`
        (its observation), or no messages after the prompt.

        Raises:
            ValueError: see `offered` (the caller counts it as `reset_exception`).
            EnvironmentCallFailed: the inner environment's reset failed (counted as its kind).
        """
        state["tools_offered"] = self.offered(row)
        state["tool_rounds"] = 0
        state["tool_counts"] = _new_counts()
        if self.inner is None:
            return Observation([])
        return _observation(await self.inner.reset(row, state))

    async def step(self, action: str, state: dict[str, Any]) -> Observation:
        """Answer one turn: done when it called no tool (or the round limit is reached), else the tool messages as
        a `ToolObservation` (with how each call ran, `ToolCallRecord`).

        Args:
            action: the turn's text (unused: the calls come from state["tool_calls"] / ["malformed_tool_calls"],
                which the rollout parsed from the sampled tokens).
            state: the episode's state.

        Raises:
            GroupDropped: the tool service failed (not a tool): the rollout drops the group as tool_service_error.
            EnvironmentCallFailed: the inner environment's step failed (counted as its kind).
        """
        calls: list[tuple[str, Any]] = list(state.get("tool_calls") or [])
        malformed: list[str] = list(state.get("malformed_tool_calls") or [])
        if not calls and not malformed:  # not a tool turn: the end of tool calling, or the environment's action
            if self.inner is None:
                return Observation([], done=True)
            return _observation(await self.inner.step(action, state))
        limit = self.settings.max_tool_calling_iterations
        if limit is not None and state["tool_rounds"] >= limit:
            state["tool_counts"]["exhausted"] = 1
            return Observation([], done=True)
        state["tool_rounds"] += 1
        return await self._run_calls(calls, malformed, state)

    async def _run_calls(
        self, calls: list[tuple[str, Any]], malformed: list[str], state: dict[str, Any]
    ) -> ToolObservation:
        """Run one turn's calls concurrently; returns their tool messages (well-formed calls first, in order, then
        one error message per malformed call) with a `ToolCallRecord` each, and counts calls, failures and seconds
        in the state."""
        allowed = state["tools_offered"]

        async def one(name: str, arguments: Any) -> tuple[ToolOutcome, int, int]:
            start_ns = time.time_ns()
            if not self.offer_tools:
                return failed("unknown_tool", "no tools are available"), start_ns, time.time_ns()
            try:
                outcome = await self.backend.call(name, arguments, allowed=allowed)
            except ToolServiceError as err:  # the service, not the tool, failed: drop the group, tell no model
                raise GroupDropped("tool_service_error", str(err)) from err
            return outcome, start_ns, time.time_ns()

        ran = list(await asyncio.gather(*(one(n, a) for n, a in calls)))
        labelled: list[tuple[str, Any]] = list(calls)
        for reason in malformed:
            now = time.time_ns()
            ran.append((failed("malformed", reason), now, now))
            labelled.append(("error", None))
        counts = state["tool_counts"]
        messages, records = [], []
        for (label, arguments), (outcome, start_ns, end_ns) in zip(labelled, ran, strict=True):
            counts["calls"] += 1
            counts["seconds"] += outcome.seconds
            if outcome.failure is not None:
                counts["failures"][outcome.failure] += 1
            content = truncate_response(outcome.content, self.settings.max_tool_response_length)
            messages.append({"role": "tool", "name": label, "content": content})
            records.append(ToolCallRecord(label, arguments, content, outcome.failure, start_ns, end_ns))
        return ToolObservation(messages, calls=records)

    @staticmethod
    def episode_stats(state: Mapping[str, Any]) -> dict[str, float]:
        """The episode's `tools/*` counters (the same keys for every episode; zeros when the episode never reset):
        `tools/calls`, `tools/failures`, `tools/failures/<kind>` for each of `tools.FAILURE_KINDS`, `tools/seconds`
        (wall-clock seconds of the calls) and `tools/loop_exhausted` (1 when max_tool_calling_iterations ended it).
        """
        counts = state.get("tool_counts") or _new_counts()
        failures: Counter = counts["failures"]
        out = {
            "tools/calls": float(counts["calls"]),
            "tools/failures": float(sum(failures.values())),
            "tools/seconds": float(counts["seconds"]),
            "tools/loop_exhausted": float(counts["exhausted"]),
        }
        out.update({f"tools/failures/{kind}": float(failures[kind]) for kind in FAILURE_KINDS})
        return out

    async def close_episode(self, state: dict[str, Any]) -> None:
        """The episode stopped: the inner environment's `close_episode` (when there is one; see
        `Environment.close_episode`)."""
        if self.inner is not None:
            await self.inner.close_episode(state)

    def close(self) -> None:
        """Close the inner environment (when there is one), then stop the tool backend (workers or connections)."""
        if self.inner is not None:
            self.inner.close()
        self.backend.close()


def _new_counts() -> dict[str, Any]:
    """An episode's zeroed tool counters: calls, seconds of the calls, exhausted (0/1), failures by kind."""
    return {"calls": 0, "seconds": 0.0, "exhausted": 0, "failures": Counter()}


def _observation(outcome: CallOutcome) -> Observation:
    """The inner environment's observation, or its failure raised with its kind (`EnvironmentCallFailed`)."""
    if outcome.observation is None:
        raise EnvironmentCallFailed(outcome.failure or "bad_observation", outcome.error)
    return outcome.observation
