"""The deterministic schedule of `full_determinism` (issue 28): the orchestrator's bookkeeping by launch index.

Under `full_determinism` a group is known by its launch index i: the i-th prompt drawn, sampled with the seed of i
at the policy version the pacing gives i (`Orchestrator.required_version`). `ScheduleState` keeps what that needs
across the orchestrator's event loop (which draws, settles and hands groups over) and the trainer's thread (which
waits on the generation watermark, marks groups trained and snapshots the state into checkpoints):

- the in-order hand-over: a settled group waits in `in_order` until every earlier launch index has settled, so
  step batches hold groups in launch order whatever order they finished in (a dropped group is a gap, skipped);
- the generation watermark `generated_through`: every launch index below it finished generating (or failed); the
  trainer pushes the next policy version only once it passed the groups scheduled for the current one;
- what a checkpoint keeps (`snapshot` / `restore`): the groups sampled at policy versions older than the trainer's,
  which a resumed run cannot sample again (its vLLM serves only the checkpoint's weights), as plain values; the
  prompts of the later launch indices drawn so far, which it samples again with the same seeds and weights; and
  the sampler's position after them. A resumed run then continues the schedule exactly.

Thread-safety: one lock guards every method; the event loop holds it only for short synchronous updates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any

from async_grpo.data import PromptItem
from async_grpo.transports.messages import RolloutGroup


def group_to_state(group: RolloutGroup) -> dict[str, Any]:
    """A `RolloutGroup` as plain values (lists, dicts, numbers, strings), which a checkpoint loads with
    `torch.load(weights_only=True)`; `group_from_state` inverts it."""
    state = {f.name: getattr(group, f.name) for f in fields(group)}
    state["nonfinite_logprob_tokens"] = group.nonfinite_logprob_tokens
    return state


def group_from_state(state: dict[str, Any]) -> RolloutGroup:
    """The `RolloutGroup` of `group_to_state(...)`; its NaN count is the one counted when it was sampled."""
    values = dict(state)
    nonfinite = int(values.pop("nonfinite_logprob_tokens", 0))
    group = RolloutGroup(**values)
    group.nonfinite_logprob_tokens = nonfinite
    return group


def item_to_state(item: PromptItem) -> dict[str, Any]:
    """A `PromptItem` as plain values (see `group_to_state`)."""
    return {"prompt": item.prompt, "prompt_ids": list(item.prompt_ids), "columns": item.columns}


class ScheduleState:
    """The launch-index bookkeeping of `full_determinism` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.next_index = 0  # launch index of the next draw
        self.generated_through = 0  # every launch index below it finished generating (or failed)
        self._generated: set[int] = set()  # finished indices at or above the watermark
        self._in_order: dict[int, RolloutGroup | None] = {}  # settled, waiting for earlier indices (None: dropped)
        self._next_in_order = 0  # launch index of the next group to hand over
        self._unconsumed: dict[int, RolloutGroup | None] = {}  # settled and not yet trained (None: dropped)
        self._drawn: dict[int, PromptItem] = {}  # prompts of the launch indices not yet trained
        self._relaunch: dict[int, PromptItem] = {}  # a resumed run's prompts to sample again, by launch index

    def draw(self, sampler: Iterator[PromptItem]) -> tuple[int, PromptItem]:
        """The next launch index and its prompt: the one a restored checkpoint left to sample again, else the
        sampler's next."""
        with self._lock:
            index = self.next_index
            item = self._relaunch.pop(index) if index in self._relaunch else next(sampler)
            self._drawn[index] = item
            self.next_index += 1
            return index, item

    def mark_generated(self, index: int) -> None:
        """Launch index `index` finished generating (or failed): move the watermark past every finished index."""
        with self._lock:
            self._generated.add(index)
            while self.generated_through in self._generated:
                self._generated.remove(self.generated_through)
                self.generated_through += 1

    def settle(self, index: int, group: RolloutGroup | None) -> list[RolloutGroup]:
        """Launch index `index` settled with `group` (None: dropped); it counts as generated. Returns the groups
        that are now handed over, in launch order (gaps skipped)."""
        if group is not None:
            group.launch_index = index
        with self._lock:
            self._in_order[index] = group
            self._unconsumed[index] = group
            released = []
            while self._next_in_order in self._in_order:
                ready = self._in_order.pop(self._next_in_order)
                self._next_in_order += 1
                if ready is not None:
                    released.append(ready)
        self.mark_generated(index)
        return released

    def waiting(self) -> int:
        """Settled groups still waiting for an earlier launch index (counted as `shutdown` when the run stops)."""
        with self._lock:
            return sum(group is not None for group in self._in_order.values())

    def mark_trained(self, groups: Iterable[RolloutGroup]) -> None:
        """The trainer finished the steps on `groups`: forget them, and the gaps and prompts before the oldest
        group not yet trained."""
        with self._lock:
            for group in groups:
                if group.launch_index is not None:
                    self._unconsumed.pop(group.launch_index, None)
                    self._drawn.pop(group.launch_index, None)
            first = self._first_untrained()
            for index in [i for i in self._unconsumed if i < first]:
                del self._unconsumed[index]
            for index in [i for i in self._drawn if i < first]:
                del self._drawn[index]

    def _first_untrained(self) -> int:
        """The lowest launch index not yet trained and not dropped (the next to hand over when every settled group
        was trained). Call with the lock held."""
        return min((i for i, g in self._unconsumed.items() if g is not None), default=self._next_in_order)

    def unsettled_before(self, keep_before: int) -> list[int]:
        """Launch indices below `keep_before` that are neither trained nor settled yet: generated (the trainer's
        push waited for that) but still being scored, or still on their way to the in-order hand-over. A checkpoint
        waits until none is left (`Orchestrator.schedule_state`)."""
        with self._lock:
            return [i for i in range(self._first_untrained(), keep_before) if i not in self._unconsumed]

    def snapshot(self, keep_before: int, sampler_state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The state a checkpoint keeps (plain values; see the module docstring).

        Args:
            keep_before: launch indices below it were sampled at a policy version older than the trainer's: their
                groups are kept (every one of them must have settled: the caller waits for `unsettled_before` to be
                empty; the trainer's push waited only for their generation, not for their rewards).
            sampler_state: returns the prompt sampler's live position, read under the same lock as the draws.

        Raises:
            RuntimeError: a launch index below `keep_before` has not settled (the caller did not wait for it).
        """
        with self._lock:
            first = self._first_untrained()
            kept = {}
            for index in range(first, keep_before):
                if index not in self._unconsumed:
                    raise RuntimeError(
                        f"full_determinism: launch index {index} (sampled before the trainer's policy version) has "
                        "not settled at the checkpoint"
                    )
                group = self._unconsumed[index]
                kept[index] = None if group is None else group_to_state(group)
            again = {i: item_to_state(self._drawn[i]) for i in range(max(first, keep_before), self.next_index)}
            return {"first": first, "keep_before": keep_before, "groups": kept, "sample_again": again,
                    "next_index": self.next_index, "sampler": sampler_state()}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Continue from a `snapshot()`: the kept groups are handed over again from the oldest untrained one, the
        later launch indices are sampled again from their saved prompts. Returns the sampler position to load and
        the number of kept groups (launched before this process: the prompt ledger counts them)."""
        keep_before = int(state["keep_before"])
        with self._lock:
            kept = {int(i): None if g is None else group_from_state(g) for i, g in state["groups"].items()}
            for index, group in kept.items():
                if group is not None:
                    group.launch_index = index
            self._in_order = dict(kept)
            self._unconsumed = dict(kept)
            self._next_in_order = int(state["first"])
            self._relaunch = {int(i): PromptItem(**item) for i, item in state["sample_again"].items()}
            self._drawn = {}
            self._generated = set()
            self.next_index = self.generated_through = max(keep_before, self._next_in_order)
        return state["sampler"], sum(g is not None for g in kept.values())
