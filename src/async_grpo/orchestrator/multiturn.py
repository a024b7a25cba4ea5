"""The multi-turn rollout: the model calls tools, reads their results, and is trained on its own tokens only.

A second implementation of the `Rollout` seam (`orchestrator.rollout`), token in and token out, so the sampled ids
and logprobs stay exactly those vLLM produced across turns:

1. The prompt is rendered by the chat template with the offered tools' JSON schemas (`apply_chat_template(...,
   tools=schemas)`), and the first turn of all G samples is one `/v1/completions` request (n = G).
2. Each sample's turn is decoded and parsed (`tools.parsing`: the tokenizer's own response parsing). A turn with no
   tool call ends the sample. Otherwise its calls run in tool workers (`tools.ToolBackend`, under timeouts and
   resource limits); malformed calls, unknown tools, bad arguments and failing tools become `error: ...` tool
   results the model reads, and are counted.
3. The tool messages (each cut to `max_tool_response_length` characters, verl's rule) are rendered by the chat
   template and exactly their tokens are appended to the held ones (`tools.render.tool_suffix`); the held tokens
   are never re-tokenized. Where a re-render of the conversation drifts from them, they are kept and the drift is
   counted (`tools/template_drift`); the training row stays exactly what vLLM saw.
4. The next turn is generated from the held token ids with the remaining budget. A sample stops on a turn without
   tool calls, after `max_tool_calling_iterations` rounds (TRL), or when generated plus tool tokens reach
   `max_completion_length` (a tool result that does not fit is not appended, and the sample counts as truncated).

Tool tokens get `loss_mask` 0 and sampling logprob 0.0; every token carries the policy version read when its turn's
request was sent (tool tokens that of the turn before them), so a rollout straddling a weight push carries both and
its group's staleness is its oldest token's. Reward functions receive each completion in TRL's conversational form:
the assistant messages (with `tool_calls`) and tool messages, in order. Per-sample tool counters travel in
`RolloutGroup.rollout_stats` and become the `tools/*` metrics (`orchestrator.batching.tool_metrics`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_grpo.data import PromptItem
from async_grpo.inference.client import Completion, GenerationClient
from async_grpo.orchestrator.rollout import RolloutDropped, SamplingSettings, score_group
from async_grpo.tools.executor import FAILURE_KINDS, ToolBackend, ToolOutcome, failed
from async_grpo.tools.parsing import ParsedTurn, parse_turn, response_template
from async_grpo.tools.remote import ToolServiceError
from async_grpo.tools.render import check_chat_template, render_ids, tool_suffix
from async_grpo.transports.messages import RolloutGroup
from async_grpo.transports.scorer import Scorer

TRUNCATION_MARK = "...(truncated)"
_PREFIX_TOKENS = 32  # held tokens decoded as the parser's prefix (enough for the assistant header)
_SEED_STRIDE = 7919  # per-sample seed offset for later turns when the caller seeds (evaluation)


@dataclass(frozen=True)
class ToolCallingSettings:
    """Multi-turn limits (TRL / verl names).

    Attributes:
        max_tool_calling_iterations: most tool-calling rounds per sample; None: bounded only by the length budget.
        max_tool_response_length: a tool result longer than this many characters is cut to it (+ TRUNCATION_MARK).
    """

    max_tool_calling_iterations: int | None = None
    max_tool_response_length: int = 256


@dataclass
class _Sample:
    """One completion being built, turn by turn."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    calls: int = 0
    seconds: float = 0.0
    drift: int = 0
    exhausted: int = 0
    failures: Counter = field(default_factory=Counter)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, trained: int, version: int) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([trained] * len(ids))
        self.versions.extend([version] * len(ids))

    def stats(self) -> dict[str, float]:
        out = {
            "tools/calls": float(self.calls),
            "tools/failures": float(sum(self.failures.values())),
            "tools/turns": float(self.turns),
            "tools/seconds": self.seconds,
            "tools/template_drift": float(self.drift),
            "tools/loop_exhausted": float(self.exhausted),
        }
        out.update({f"tools/failures/{kind}": float(self.failures[kind]) for kind in FAILURE_KINDS})
        return out


async def all_or_none(coros: list) -> list:
    """Run `coros` concurrently and return their results in order; if one fails (or this is cancelled), cancel the
    others before re-raising, so no sample of a dropped group keeps generating (also used by
    `orchestrator.env_rollout`)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def truncate_response(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with TRUNCATION_MARK appended when longer (verl's right-side truncation)."""
    return text if len(text) <= limit else text[:limit] + TRUNCATION_MARK


class MultiTurnRollout:
    """The tool-calling rollout (see the module docstring).

    Args:
        scorer: the run's reward backend.
        tokenizer: the policy's tokenizer (chat template, response parsing, decoding).
        backend: where tool calls run (local worker processes or the reward service).
        settings: multi-turn limits.
        offer_tools: False renders prompts without tools and answers every call with an error (no tool runs): the
            same model "without tools", for comparison (`without_tools`).

    Raises:
        ToolFormatError: the tokenizer's tool-call format is unknown (no response template).
        ChatTemplateError: the chat template cannot carry tool calls or is not prefix-preserving.
    """

    def __init__(
        self,
        scorer: Scorer,
        tokenizer: Any,
        backend: ToolBackend,
        *,
        settings: ToolCallingSettings = ToolCallingSettings(),
        offer_tools: bool = True,
    ):
        self.scorer, self.tokenizer, self.backend, self.settings = scorer, tokenizer, backend, settings
        self.offer_tools = offer_tools
        self.template = response_template(tokenizer)
        self.schemas = {t.name: t.schema for t in backend.tools}
        self.tool_schemas = list(self.schemas.values())  # the `Rollout` seam's view of the offered tools
        check_chat_template(tokenizer, self.tool_schemas)

    def without_tools(self) -> MultiTurnRollout:
        """The same rollout with no tools offered: prompts rendered without them, every call answered
        `error: no tools are available` (counted as `unknown_tool`)."""
        return MultiTurnRollout(self.scorer, self.tokenizer, self.backend, settings=self.settings, offer_tools=False)

    def offered(self, item: PromptItem) -> list[str]:
        """The tool names offered to `item`: its row's `tools` column when present (a list of names), else all.

        Raises:
            ValueError: the column names a tool that is not declared.
        """
        if not self.offer_tools:
            return []
        names = item.columns.get("tools")
        if names is None:
            return list(self.schemas)
        unknown = [n for n in names if n not in self.schemas]
        if unknown:
            raise ValueError(
                f"dataset column 'tools' names {unknown}, which are not declared in `tools` "
                f"({sorted(self.schemas)}). Fix: declare them, or fix the column."
            )
        return list(names)

    def prompt_ids(self, item: PromptItem, names: Sequence[str]) -> list[int]:
        """The prompt's token ids rendered with the offered tools' schemas (and the generation prompt).

        Raises:
            ValueError: the prompt is a string (tools need conversational prompts).
        """
        if not isinstance(item.prompt, list):
            raise ValueError(
                "tools need conversational prompts (a list of {'role', 'content'} messages), as TRL. "
                "Fix: turn each prompt into [{'role': 'user', 'content': prompt}]."
            )
        return render_ids(self.tokenizer, item.prompt, [self.schemas[n] for n in names], add_generation_prompt=True)

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """See `Rollout.__call__`. Raises `RolloutDropped("aborted")` when vLLM aborted a turn of any sample."""
        names = self.offered(item)
        prompt_ids = self.prompt_ids(item, names)
        sent_at = version()
        first = await client.generate(
            prompt_ids, n=sampling.num_generations, max_tokens=sampling.max_completion_length,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
        )  # fmt: skip
        samples = await all_or_none([
            self._run_sample(client, item, prompt_ids, names, turn, sent_at, sampling, version,
                             None if seed is None else seed + _SEED_STRIDE * (i + 1))
            for i, turn in enumerate(first)])  # fmt: skip
        stats = [s.stats() for s in samples]
        group = RolloutGroup(
            prompt_ids=prompt_ids, completion_ids=[s.ids for s in samples],
            sampling_logprobs=[s.logprobs for s in samples], truncated=[s.truncated for s in samples],
            completions=[s.messages for s in samples], prompt=item.prompt, columns=item.columns,
            policy_version=sent_at, loss_mask=[s.mask for s in samples], token_versions=[s.versions for s in samples],
            rollout_stats={k: [st[k] for st in stats] for k in stats[0]},
        )  # fmt: skip
        await score_group(self.scorer, group)
        return group

    async def _run_sample(
        self,
        client: GenerationClient,
        item: PromptItem,
        prompt_ids: list[int],
        names: list[str],
        turn: Completion,
        turn_version: int,
        sampling: SamplingSettings,
        version: Callable[[], int],
        seed: int | None,
    ) -> _Sample:
        """Continue one sample from its first turn until it stops (see the module docstring)."""
        sample = _Sample()
        schemas = [self.schemas[n] for n in names]
        budget = sampling.max_completion_length
        rounds = 0
        while True:
            if turn.finish_reason == "abort":
                raise RolloutDropped("aborted", "vLLM aborted a turn of a multi-turn rollout")
            held_before = prompt_ids + sample.ids
            sample.append(turn.token_ids, turn.logprobs, 1, turn_version)
            sample.turns += 1
            parsed = self._parse(turn.token_ids, held_before, schemas)
            sample.messages.append(parsed.message)
            if turn.finish_reason == "length" or len(sample.ids) >= budget:
                sample.truncated = True  # a call cut off by the budget is not run
                return sample
            if not parsed.wants_tools:
                return sample
            limit = self.settings.max_tool_calling_iterations
            if limit is not None and rounds >= limit:
                sample.exhausted = 1
                return sample
            tool_messages = await self._run_calls(parsed, names, sample)
            suffix = tool_suffix(
                self.tokenizer, list(item.prompt) + sample.messages, tool_messages, schemas, prompt_ids + sample.ids
            )
            sample.drift += int(suffix.drift)
            if len(sample.ids) + len(suffix.ids) >= budget:  # no room for the results and one more token
                sample.truncated = True
                return sample
            sample.append(suffix.ids, None, 0, turn_version)
            sample.messages.extend(tool_messages)
            rounds += 1
            turn_version = version()
            (turn,) = await client.generate(
                prompt_ids + sample.ids, n=1, max_tokens=budget - len(sample.ids), temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, seed=None if seed is None else seed + rounds,
            )  # fmt: skip

    def _parse(self, turn_ids: list[int], held_before: list[int], schemas: list[dict]) -> ParsedTurn:
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        prefix = self.tokenizer.decode(held_before[-_PREFIX_TOKENS:], skip_special_tokens=False)
        return parse_turn(self.tokenizer, self.template, text, prefix, schemas or None)

    async def _run_calls(self, parsed: ParsedTurn, names: list[str], sample: _Sample) -> list[dict]:
        """Run one turn's calls concurrently; returns their tool messages (well-formed calls first, in order, then
        one error message per malformed call) and counts calls, failures and seconds on `sample`."""

        async def one(name: str, arguments: Any) -> ToolOutcome:
            if not self.offer_tools:
                return failed("unknown_tool", "no tools are available")
            try:
                return await self.backend.call(name, arguments, allowed=names)
            except ToolServiceError as err:  # the service, not the tool, failed: drop the group, tell no model
                raise RolloutDropped("tool_service_error", str(err)) from err

        outcomes = list(await asyncio.gather(*(one(n, a) for n, a in parsed.calls)))
        labels = [n for n, _ in parsed.calls]
        for reason in parsed.malformed:
            outcomes.append(failed("malformed", reason))
            labels.append("error")
        messages = []
        for label, outcome in zip(labels, outcomes, strict=True):
            sample.calls += 1
            sample.seconds += outcome.seconds
            if outcome.failure is not None:
                sample.failures[outcome.failure] += 1
            content = truncate_response(outcome.content, self.settings.max_tool_response_length)
            messages.append({"role": "tool", "name": label, "content": content})
        return messages

    def close(self) -> None:
        """Stop the tool backend (its workers or connections)."""
        self.backend.close()
