"""The `Scorer` protocol, the record it returns (`ScoredGroup`) and the errors it fails with (`RewardError` and its
kinds): what the orchestrator and evaluation need from a reward backend.

Two implementations meet it: `rewards.pool.RewardPool` (spawned worker processes on this machine) and
`rewards.remote.RemoteRewardPool` (the reward HTTP service). Callers type against this protocol, so the
orchestrator never imports either, and a third backend needs no change outside `rewards/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from async_grpo.transports.drops import DropReason


@dataclass(frozen=True)
class ScoredGroup:
    """One group's rewards and what its reward functions logged; it crosses the worker-process boundary (pickled)
    and the reward service's JSON (`rewards.wire.encode_scored` / `decode_scored`).

    Attributes:
        rows: (G, F) rewards, one row of F floats per completion, NaN where a function returned None.
        extra: column -> G values, from `log_extra` (TRL: extra columns of the completions table).
        metrics: name -> the values passed to `log_metric` for this group (TRL averages them over the step).
        seconds: reward-function name -> wall-clock seconds its one call for the whole group took, measured where
            the functions ran (the worker process, `rewards.pool`); empty when not measured (a test scorer, a
            reward service older than the field). Read by `orchestrator.rollout.score_group` for the episode
            traces' reward spans.
    """

    rows: list[list[float]]
    extra: Mapping[str, list] = field(default_factory=dict)
    metrics: Mapping[str, list[float]] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)


class RewardError(RuntimeError):
    """A group could not be scored; the caller drops the group and counts it under `reason`.

    Attributes:
        reason: the drop-counter key (`transports.drops.DropReason`, one per class): "reward_error" (the function
            raised, or its worker died); the wire format's error ``reason`` too (`rewards.wire`).
        function: the reward function's name, or None when the whole set is concerned.
    """

    reason: ClassVar[DropReason] = "reward_error"

    def __init__(self, message: str, function: str | None = None):
        super().__init__(message)
        self.function = function

    def __reduce__(self) -> tuple[Any, ...]:  # keep `function` across the process boundary
        return type(self), (str(self), self.function)


class RewardBadOutput(RewardError):
    """A reward function returned something other than a list of G numbers or None (reason "reward_bad_output")."""

    reason: ClassVar[DropReason] = "reward_bad_output"


class RewardTimeout(RewardError):
    """The reward functions did not finish within the timeout; the worker was killed (reason "reward_timeout")."""

    reason: ClassVar[DropReason] = "reward_timeout"


@runtime_checkable
class Scorer(Protocol):
    """Scores one group of G completions with F reward functions.

    Attributes:
        names: (F,) reward-function names, in order (metric names `rewards/<name>/mean`).
        weights: (F,) reward weights (applying them is the caller's job, TRL `reward_weights`).
    """

    names: list[str]
    weights: list[float]

    def submit(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Future:
        """Score one group; the future resolves to a `ScoredGroup` ((G, F) float rows, NaN where a function
        returned None, and what the functions logged), or fails with a `RewardError` (its `reason` is the
        drop-counter key).

        Args:
            prompts: G prompts (the group's prompt repeated, as TRL passes it).
            completions: G completions (strings, or message lists for conversational prompts).
            completion_ids: G lists of completion token ids.
            columns: the dataset's other columns, each a list of G values (reward keyword arguments).
        """

    def set_trainer_state(self, **fields: int) -> None:
        """Update the `trainer_state` later groups' reward functions receive (TRL's `trainer_state` argument:
        `global_step`, `max_steps`), after each optimizer step."""

    def close(self) -> None:
        """Release the backend (worker processes, connections)."""
