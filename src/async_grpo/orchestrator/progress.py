"""The producer's progress: which prompts were trained (`PromptLedger`) and what a checkpoint keeps of it
(`ProducerState`).

The orchestrator draws prompts ahead of the trainer (groups in flight, in the rollout queue, half-built batches).
Those groups are not in a checkpoint, so the sampler position a checkpoint saves is not the live sampler's (which is
ahead) but the position before the oldest prompt drawn and not yet trained, and a resumed run draws those prompts
again. With groups batched in launch order (one group in flight, or requests that finish in order) the prompts of
every later step equal an uninterrupted run's. The orchestrator owns its ledger: it draws from it, and the trainer
tells it (`Orchestrator.mark_trained`, once per step) which groups it trained.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.transports.messages import RolloutGroup


def draw_window(*, max_inflight_groups: int, queued_groups: int, groups_per_step: int) -> int:
    """Prompts the orchestrator can have drawn ahead of the trainer at most (in flight, pending, queued), with
    room to spare: `PromptLedger`'s window.

    Args:
        max_inflight_groups: generation requests in flight at most.
        queued_groups: groups the rollout queue holds at most (its batches x groups per batch).
        groups_per_step: groups per optimizer step over every trainer rank (a half-built batch).
    """
    return 2 * (max_inflight_groups + queued_groups + groups_per_step) + 16


class PromptLedger(Iterator):
    """The orchestrator's prompt source: a prompt sampler that remembers, for every prompt drawn and not yet
    trained, the sampler's position before it, so a checkpoint saves the position of the prompts *trained* rather
    than the live one.

    Args:
        sampler: the seeded `data.PromptSampler`.
        window: draws kept at most; an older untrained draw is taken as dropped (a failed or filtered group), so
            one lost group never pins the position (`draw_window`).

    Thread-safety: `__next__` runs in the orchestrator's thread, the rest in the trainer's; a lock guards both.
    """

    def __init__(self, sampler: PromptSampler, window: int):
        self.sampler = sampler
        self.window = max(1, window)
        self._drawn: deque[tuple[tuple[int, ...], dict[str, Any]]] = deque()
        self._lock = threading.Lock()

    def __next__(self) -> PromptItem:
        with self._lock:
            before = self.sampler.state_dict()
            item = next(self.sampler)
            self._drawn.append((tuple(item.prompt_ids), before))
            while len(self._drawn) > self.window:
                self._drawn.popleft()
            return item

    def mark_trained(self, groups: Iterable[RolloutGroup]) -> None:
        """Forget the draws of `groups` just trained: fresh groups only (replayed and re-rolled ones were not
        drawn from the sampler), each matched to its oldest outstanding draw of the same prompt."""
        with self._lock:
            for group in groups:
                if group.replayed or group.rerolled:
                    continue
                key = tuple(group.prompt_ids)
                for index, (ids, _state) in enumerate(self._drawn):
                    if ids == key:
                        del self._drawn[index]
                        break

    def state_dict(self) -> dict[str, Any]:
        """The sampler position before the oldest drawn-but-untrained prompt (the live one if none)."""
        with self._lock:
            return self._drawn[0][1] if self._drawn else self.sampler.state_dict()

    def live_state_dict(self) -> dict[str, Any]:
        """The sampler's live position, after every draw so far (what `full_determinism`'s checkpoint keeps: it
        saves the drawn prompts itself, `orchestrator.determinism`)."""
        with self._lock:
            return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` position (forgets the outstanding draws).

        Raises:
            ValueError: as `PromptSampler.load_state_dict` (another dataset).
        """
        with self._lock:
            self.sampler.load_state_dict(state)
            self._drawn.clear()


@dataclass(frozen=True)
class ProducerState:
    """What a checkpoint keeps of the producer (plain values; `TrainState` stores each field under its name).

    Attributes:
        sampler: the prompt ledger's position (`PromptLedger.state_dict`); None: the producer draws no prompts
            (a user `data_producer`).
        replay: the replay buffer's state (`replay_buffer_size`); None without one.
        reroll: the deferred re-roll FIFO's state (`reroll_start_fraction`); None without one.
        schedule: under `full_determinism`, the schedule (`ScheduleState.snapshot`: the untrained groups sampled at
            older policy versions, the prompts drawn since, the sampler's live position); None otherwise.
    """

    sampler: dict[str, Any] | None = None
    replay: dict[str, Any] | None = None
    reroll: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
