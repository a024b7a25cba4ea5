"""Trajectories from an agent's model calls: the token rows GRPO trains on, built from exact ids, never from text.

An agent (`agents.execution`) talks to the run through the OpenAI-compatible endpoint (`agents.endpoint`), which
records every model call as a `ModelCall`: the prompt ids sent to vLLM, the completion ids and sampling logprobs vLLM
reported, and the policy version that served it. This module joins the calls of one episode into `Segment`s:

    call k extends the segment when its prompt ids start with the segment's held ids
    (the segment's first prompt, then every completion and observation token since, in order):
        the tokens between the held ids and call k's prompt are the observation (tool results, the user's next
        message, the chat template's turn markers): loss_mask 0, logprob 0.0, the previous call's version;
        call k's completion follows: loss_mask 1, vLLM's logprobs, call k's version.
    otherwise call k starts a new segment: the agent rewrote its history (dropped or edited a message, summarized
    the context), or the chat template re-rendered a past turn into other tokens than the ones sampled (a
    reasoning template that strips `<think>`, a tokenizer that merges sampled tokens differently).

This is the rule of AReaL's OpenAI proxy ("concat" trajectories by token prefix) and of slime's agent harness. A
segment is trained as its own sample with the episode's advantage (`RolloutGroup.episode_index`). Comparing ids,
not text, is what makes the trained tokens the sampled ones: text is never re-tokenized here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelCall:
    """One model call of an episode, as vLLM served it.

    Attributes:
        prompt_ids: (P,) the token ids sent to vLLM (the request rendered by the policy's chat template, or a
            completion prompt tokenized as vLLM would).
        completion_ids: (C,) the token ids vLLM sampled, EOS included when it was sampled.
        logprobs: (C,) vLLM's sampling logprob of each sampled token (nats, `processed_logprobs`).
        version: the policy version vLLM served when the request was sent (a lower bound of the version that
            sampled it: a push during the request makes the stamp older, never newer).
        finish_reason: vLLM's: "stop", "length" or "abort".
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str


@dataclass
class Segment:
    """Consecutive calls of one episode joined into one token sequence (see the module docstring).

    Attributes:
        prompt_ids: (P,) the first call's prompt ids.
        ids: (T,) every token after them, in order: completions and the observations between them.
        logprobs: (T,) vLLM's sampling logprob for a completion token, 0.0 for an observation token.
        mask: (T,) 1 for a token the policy sampled (trained), 0 for an observation token.
        versions: (T,) the policy version of each token (an observation token carries the call before it's).
        calls: how many calls it joins (>= 1).
        finish_reason: its last call's finish reason.
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    finish_reason: str = "stop"

    @property
    def held(self) -> list[int]:
        """(P + T,) the whole sequence so far: what the next call's prompt must start with to extend it."""
        return self.prompt_ids + self.ids

    @property
    def generated_tokens(self) -> int:
        """Tokens after the first prompt (completions and observations): what counts against
        max_completion_length."""
        return len(self.ids)

    def add(self, call: ModelCall) -> None:
        """Append `call`: the observation tokens between the held ids and its prompt (mask 0), then its completion
        (mask 1).

        Raises:
            ValueError: `call` does not extend this segment (`extends`).
        """
        if self.calls and not extends(self.held, call.prompt_ids):
            raise ValueError("the call's prompt does not start with the segment's held ids; start a new segment")
        observation = call.prompt_ids[len(self.held) :] if self.calls else []
        previous = self.versions[-1] if self.versions else call.version
        self._extend(observation, [0.0] * len(observation), 0, previous)
        self._extend(call.completion_ids, call.logprobs, 1, call.version)
        self.calls += 1
        self.finish_reason = call.finish_reason

    def _extend(self, ids: Sequence[int], logprobs: Sequence[float], trained: int, version: int) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([trained] * len(ids))
        self.versions.extend([version] * len(ids))


def extends(held: Sequence[int], prompt_ids: Sequence[int]) -> bool:
    """Whether `prompt_ids` (P,) starts with `held` (H,), token for token (P >= H; equal counts: the agent called
    again with nothing appended)."""
    return len(prompt_ids) >= len(held) and list(prompt_ids[: len(held)]) == list(held)


def build_segments(calls: Sequence[ModelCall]) -> list[Segment]:
    """Join an episode's calls, in the order they were sent, into segments (see the module docstring).

    Args:
        calls: the episode's calls, oldest first.

    Returns:
        One `Segment` per run of calls each extending the one before; [] for no calls. The number of history
        rewrites is `len(segments) - 1`.
    """
    segments: list[Segment] = []
    for call in calls:
        add_call(segments, call)
    return segments


def add_call(segments: list[Segment], call: ModelCall) -> None:
    """Add the episode's next call to its `segments` (in place): to the last one when it extends it, else as a new
    one (`build_segments`, one call at a time, as the calls arrive)."""
    if not segments or not extends(segments[-1].held, call.prompt_ids):
        segments.append(Segment(list(call.prompt_ids)))
    segments[-1].add(call)


def common_prefix(rows: Sequence[Sequence[int]]) -> list[int]:
    """The longest token prefix every row shares ([] for no rows)."""
    if not rows:
        return []
    first = rows[0]
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows[1:]):
            return list(first[:i])
    return list(first[:n])
