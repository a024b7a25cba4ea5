"""The `Scorer` protocol: what the orchestrator and evaluation need from a reward backend.

Two implementations meet it: `rewards.pool.RewardPool` (spawned worker processes on this machine) and
`rewards.remote.RemoteRewardPool` (the reward HTTP service). Callers type against this protocol, so the
orchestrator never imports either, and a third backend needs no change outside `rewards/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable


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
        """Score one group; the future resolves to a (G, F) list of float rows, NaN where a function returned
        None, or fails with a `rewards.pool.RewardError` (its `reason` is the drop-counter key).

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
