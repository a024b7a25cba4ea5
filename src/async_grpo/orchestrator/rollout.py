"""The rollout seam: one prompt in, one scored group out.

A `Rollout` turns a `PromptItem` into a `RolloutGroup` of `num_generations` completions, each with its sampled
token ids, vLLM's sampling logprobs, a per-token loss mask and per-token policy versions, scored by the run's
reward functions. The orchestrator (training) and `evaluation` (held-out reward) both call a `Rollout`, so what
is trained on and what is measured are produced by the same code. `SingleTurnRollout` is the builtin one: one
`/v1/completions` request for the whole group (token ids in, sampled ids and logprobs out), then one scoring
call. The multi-turn rollout is one more implementation of the same protocol: an environment the model acts in
(`env_rollout.EnvironmentRollout`), of which tool calling is one kind (`environments.tools.ToolEnvironment`).

Failures propagate as exceptions, and the caller counts them: `RolloutDropped` (its `reason`), a
`transports.scorer.RewardError` (its `reason`), `httpx.HTTPError` / `GenerationError` (vLLM unreachable or
erroring), anything else as a bug in a user rollout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from async_grpo.data import PromptItem
from async_grpo.inference.client import Completion, GenerationClient
from async_grpo.transports.drops import DropReason
from async_grpo.transports.messages import EpisodeSpan, RolloutGroup
from async_grpo.transports.scorer import ScoredGroup, Scorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """Per-request sampling settings (TRL names).

    Attributes:
        num_generations: completions per prompt, the group size G.
        max_completion_length: most tokens generated per completion.
        temperature: sampling temperature (> 0; 0 is greedy where the caller allows it).
        top_p: nucleus threshold in (0, 1].
        top_k: top-k cut-off; -1 (or 0) disables it.
        min_p, repetition_penalty: vLLM sampling parameters (TRL names); None / 1.0 leave vLLM's defaults.
        generation_kwargs: further vLLM sampling parameters added to each request (TRL name).
    """

    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None

    def extra_body(self) -> dict:
        """The request fields beyond the client's named ones: min_p, repetition_penalty (when set) and
        generation_kwargs; {} when there are none (the plain request)."""
        extra = dict(self.generation_kwargs or {})
        if self.min_p is not None:
            extra["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            extra["repetition_penalty"] = self.repetition_penalty
        return extra


class RolloutDropped(Exception):
    """A rollout produced no usable group; `reason` is the drop-counter key (`transports.drops.DropReason`, e.g.
    `aborted`), counted by the orchestrator.

    Args:
        reason: why the group is dropped (one of `DropReason`).
        message: the exception message; `reason` when empty.
    """

    def __init__(self, reason: DropReason, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


@runtime_checkable
class Rollout(Protocol):
    """One prompt in, one scored group out (see the module docstring).

    Attributes:
        tool_schemas: the JSON schemas of the tools offered to the model (empty for a single-turn rollout), as the
            chat template renders them; the tool-calling warm start renders its conversations with the same ones.
    """

    tool_schemas: list[dict]

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """Generate and score one group.

        Args:
            client: the inference client, bound to the caller's event loop.
            item: the prompt.
            sampling: sampling settings (G = sampling.num_generations).
            version: returns the policy version vLLM serves now; read when each generation request is sent,
                so every token is stamped with the version that sampled it.
            seed: per-request sampling seed (evaluation), or None.

        Returns:
            A `RolloutGroup` with `rewards_per_func` filled (advantages are the batcher's job).

        Raises:
            RolloutDropped, RewardError, httpx.HTTPError, GenerationError: see the module docstring.
        """

    def without_tools(self) -> Rollout | None:
        """The same rollout offering no tools (the final model's held-out reward without them: what the tools are
        worth), or None when this rollout offers none."""

    def close(self) -> None:
        """Release what the rollout holds (tool workers, connections); a no-op when it holds nothing."""

    async def aclose(self) -> None:
        """Release what the rollout built on the event loop that calls it (the teacher's client of
        `distillation.TeacherRollout`); the orchestrator awaits it, under a time-out, as its loop ends. A no-op for a
        rollout that builds nothing there."""


ROLLOUT_CLOSE_TIMEOUT_S = 10.0  # the longest a rollout's `aclose` may take when its loop ends


async def aclose_rollout(rollout: Rollout) -> None:
    """Await `rollout.aclose()` (what it built on this loop: the teacher's client of `distillation.TeacherRollout`,
    an agent rollout's endpoint) for at most ROLLOUT_CLOSE_TIMEOUT_S seconds; a failure is logged, not raised (the
    loop is ending: the orchestrator's, or a held-out evaluation's)."""
    try:
        await asyncio.wait_for(rollout.aclose(), ROLLOUT_CLOSE_TIMEOUT_S)
    except Exception as err:  # the loop is ending: what is left is dropped with it
        logger.warning("the rollout did not close cleanly within %.0f s: %r", ROLLOUT_CLOSE_TIMEOUT_S, err)


class SingleTurnRollout:
    """The builtin rollout: one `/v1/completions` call of `num_generations` samples, then one scoring call.

    Args:
        scorer: the run's reward backend.
        decode: completion token ids -> text (what reward functions receive).
        record_spans: record each episode's spans in `RolloutGroup.spans` (the run traces episodes,
            `log_traces_steps` > 0): one "generation" span (kind "LLM") per completion, then its reward spans
            (`score_group`). False (the default): `spans` stays empty and nothing is timed.
    """

    def __init__(self, scorer: Scorer, decode: Callable[[list[int]], str], *, record_spans: bool = False):
        self.scorer = scorer
        self.decode = decode
        self.record_spans = record_spans
        self.tool_schemas: list[dict] = []

    def without_tools(self) -> None:
        """None: a single-turn rollout offers no tools (`Rollout.without_tools`)."""
        return None

    def close(self) -> None:
        """Nothing to release (the scorer belongs to the run)."""

    async def aclose(self) -> None:
        """Nothing built on the calling loop (`Rollout.aclose`)."""

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """See `Rollout.__call__`. Raises `RolloutDropped("aborted")` when vLLM aborted a sample.

        With `record_spans`, `group.spans` holds G rows: a "generation" span (kind "LLM"; start_ns/end_ns the
        wall-clock nanoseconds around the one request of the group, the same for every row; attributes
        `prompt_tokens`, `completion_tokens`, `policy_version` (the version the request was sent at),
        `finish_reason`; outputs {"text": the decoded completion}), then one "reward <function>" span per reward
        function (`score_group`)."""
        sent_at = version()
        extra = sampling.extra_body()
        start_ns = time.time_ns() if self.record_spans else 0
        completions = await client.generate(
            item.prompt_ids, n=sampling.num_generations, max_tokens=sampling.max_completion_length,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
            **({"extra_body": extra} if extra else {}),
        )  # fmt: skip
        end_ns = time.time_ns() if self.record_spans else 0
        if any(c.finish_reason == "abort" for c in completions):
            raise RolloutDropped("aborted", "vLLM aborted a request of the group")
        texts = [self.decode(c.token_ids) for c in completions]
        group = RolloutGroup(
            prompt_ids=item.prompt_ids,
            completion_ids=[c.token_ids for c in completions],
            sampling_logprobs=[c.logprobs for c in completions],
            truncated=[c.finish_reason == "length" for c in completions],
            completions=texts,
            prompt=item.prompt,
            columns=item.columns,
            policy_version=sent_at,
        )
        if self.record_spans:
            group.spans = [
                [generation_span("generation", start_ns, end_ns, len(item.prompt_ids), c, sent_at, text)]
                for c, text in zip(completions, texts, strict=True)
            ]
        await score_group(self.scorer, group, record_spans=self.record_spans)
        return group


def generation_span(
    name: str, start_ns: int, end_ns: int, prompt_tokens: int, completion: Completion, version: int, text: str
) -> EpisodeSpan:
    """The `EpisodeSpan` of one sampled generation (kind "LLM"): `name` ("generation", or "turn <k>" in a
    multi-turn episode), the request's wall-clock start/end (`time.time_ns()`, ns), attributes `prompt_tokens`
    (token ids sent), `completion_tokens` (tokens sampled), `policy_version` (the version the request was sent at)
    and `finish_reason` (vLLM's: "stop", "length", ...); outputs {"text": `text`, the decoded completion}."""
    return EpisodeSpan(
        name=name,
        kind="LLM",
        start_ns=start_ns,
        end_ns=end_ns,
        outputs={"text": text},
        attributes={
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "policy_version": version,
            "finish_reason": completion.finish_reason,
        },
    )


async def score_group(
    scorer: Scorer,
    group: RolloutGroup,
    sample_columns: dict[str, list] | None = None,
    *,
    record_spans: bool = False,
) -> None:
    """Fill `group.rewards_per_func` ((G, F), NaN for None) with one scoring call, TRL's reward contract: the
    group's prompt repeated G times, its completions, completion ids, and each dataset column repeated G times,
    plus `sample_columns` (name -> G per-completion values, e.g. an environment's `env_reward`; JSON-safe values,
    as they may travel to the reward service).
    For a conversational prompt (a list of messages) each text completion reaches the reward functions as TRL
    passes it, `[{"role": "assistant", "content": text}]`. What the functions logged (`log_extra`,
    `log_metric`) lands in `group.reward_extra` / `group.reward_metrics`.

    With `record_spans` (the run traces episodes), one "reward <function>" span (kind "EVALUATOR") per reward
    function, in function order, is appended to every row of `group.spans` (G empty rows are made when it has
    none): outputs {"value": `rewards_per_func[i][f]`, None for NaN}, attributes {"seconds": the function's
    wall-clock seconds for the whole group, `ScoredGroup.seconds`}. The functions ran one after another inside the
    one scoring call, timed where they ran (a worker process, the reward service: not our clock), so the spans are
    laid out back to back from the call's start (`time.time_ns()` just before `submit`), each as long as its
    function took: the durations are exact, the placement approximate (queueing and transfer are not in them). A
    function the scorer did not time (a reward service older than `seconds`) gets a span covering the whole call
    and no "seconds" attribute.

    Raises:
        RewardError: the reward functions failed (its `reason` is the drop-counter key).
    """
    g = group.size
    columns = {k: [v] * g for k, v in group.columns.items()}
    columns.update(sample_columns or {})
    completions = group.completions
    if isinstance(group.prompt, list):  # conversational (TRL is_conversational)
        completions = [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions]
    start_ns = time.time_ns() if record_spans else 0
    future = scorer.submit([group.prompt] * g, completions, group.completion_ids, columns)
    scored: ScoredGroup = await asyncio.wrap_future(future)
    group.rewards_per_func = [list(row) for row in scored.rows]
    group.reward_extra = dict(scored.extra)
    group.reward_metrics = dict(scored.metrics)
    group.reward_seconds = dict(scored.seconds)
    if record_spans:
        _add_reward_spans(group, scorer.names, scored.seconds, start_ns, time.time_ns())


def _add_reward_spans(
    group: RolloutGroup, names: list[str], seconds: Mapping[str, float], start_ns: int, end_ns: int
) -> None:
    """Append the reward spans of one scoring call (`score_group`) to every episode of `group`: the call ran from
    `start_ns` to `end_ns` (ns), `seconds` says how long each function took (seconds, by name)."""
    timed: list[tuple[int, int, dict]] = []
    at = start_ns
    for name in names:
        if name in seconds:
            duration_ns = round(seconds[name] * 1e9)
            timed.append((at, at + duration_ns, {"seconds": seconds[name]}))
            at += duration_ns
        else:
            timed.append((start_ns, end_ns, {}))
    if not group.spans:
        group.spans = [[] for _ in range(group.size)]
    for row, spans in zip(group.rewards_per_func, group.spans, strict=True):
        for name, value, (start, end, attributes) in zip(names, row, timed, strict=True):
            outputs = {"value": None if math.isnan(value) else value}
            spans.append(
                EpisodeSpan(f"reward {name}", "EVALUATOR", start, end, outputs=outputs, attributes=dict(attributes))
            )


def completion_display(completion: object) -> str:
    """One completion as text for sample tables: a string as is; a conversational completion (TRL's message list,
    with tool calls and tool results) as one line per message, e.g.
    `assistant: [call calculator {"expression": "12*34"}]` / `tool calculator: 408` / `assistant: 408`."""
    if not isinstance(completion, list):
        return str(completion)
    lines = []
    for msg in completion:
        if not isinstance(msg, dict):
            lines.append(str(msg))
            continue
        role, content = msg.get("role", "?"), msg.get("content") or ""
        calls = [c.get("function", c) for c in msg.get("tool_calls") or [] if isinstance(c, dict)]
        parts = [content] if content else []
        parts += [f"[call {fn.get('name')} {json.dumps(fn.get('arguments'), ensure_ascii=False)}]" for fn in calls]
        label = f"{role} {msg['name']}" if role == "tool" and msg.get("name") else role
        lines.append(f"{label}: {' '.join(parts)}")
    return "\n".join(lines)
