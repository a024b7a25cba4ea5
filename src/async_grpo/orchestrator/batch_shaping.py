"""Batch-shaping state of the orchestrator: the replay buffer and the deferred re-roll FIFO.

Both are small pure-Python classes owned by the orchestrator's event-loop thread (no locks, no torch, no
I/O), so they are unit-tested with hand-computed cases and no threads. The orchestrator decides when to
call them; they decide what goes in and what comes out.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import math
import random
from collections.abc import Sequence
from typing import Generic, TypeVar

from async_grpo.transports.messages import RolloutGroup

logger = logging.getLogger(__name__)

ZERO_STD_ATOL = 1e-8  # a group's reward std at or below this is "zero" (TRL: torch.isclose(std, 0), atol 1e-8)
ZERO_REWARD_ATOL = 1e-6  # a weighted reward within this of 0 counts as "scored ~0" for deferred re-roll
REROLL_FIFO_CAPACITY = 4096  # prompts waiting for a re-roll at most; further candidates are counted, not kept

T = TypeVar("T")


# ------------------------------------------------------------------ reward statistics
def weighted_rewards(rewards_per_func: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Per-row weighted reward nansum, sum_f w_f r_f with NaN (a None reward) counted as 0, and NaN for an
    unscorable row (every function returned None), exactly as `algorithms.compute_advantages` (TRL) scores rows.

    Args:
        rewards_per_func: G rows of F rewards.
        weights: (F,) reward weights.

    Returns:
        (G,) floats, NaN on unscorable rows.
    """
    return [
        sum(w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r))
        if not all(math.isnan(r) for r in row)
        else math.nan
        for row in rewards_per_func
    ]


def sample_std(values: Sequence[float]) -> float:
    """Std with Bessel's correction (torch.std convention) over the finite values; 0.0 for fewer than 2."""
    values = [v for v in values if not math.isnan(v)]
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def weighted_reward_std(rewards_per_func: list[list[float]], weights: list[float]) -> float:
    """Std (torch.std convention, Bessel) of the weighted reward nansum over a group's scorable rows (the rows
    its advantages are computed from); 0.0 when they all tie or fewer than two were scored.

    Args:
        rewards_per_func: G rows of F rewards (NaN for None).
        weights: (F,) reward weights.
    """
    return sample_std(weighted_rewards(rewards_per_func, weights))


def is_zero_std(std: float) -> bool:
    """True when a group's reward std carries no learning signal (<= ZERO_STD_ATOL, TRL's isclose)."""
    return std <= ZERO_STD_ATOL


def all_rewards_near_zero(
    rewards_per_func: list[list[float]], weights: list[float], atol: float = ZERO_REWARD_ATOL
) -> bool:
    """True when the group was scored and every scorable row's weighted reward is within `atol` of 0 (the group
    "scored ~0"); a group no function could score is not.

    Args:
        rewards_per_func: G rows of F rewards (NaN for None, counted as 0 within a scorable row).
        weights: (F,) reward weights.
        atol: absolute tolerance (default 1e-6).
    """
    scored = [r for r in weighted_rewards(rewards_per_func, weights) if not math.isnan(r)]
    return bool(scored) and all(abs(r) <= atol for r in scored)


def replay_score(group: RolloutGroup) -> float:
    """Replay priority of a scored group: sum_i |A_i| x std(r), std over its finite weighted rewards (Bessel).

    Source: TRL experimental `GRPOWithReplayBufferTrainer` (`(advantages.abs() * std_rewards).sum(-1)`).
    Needs `group.advantages` and `group.rewards` filled (see `make_train_batch`).
    """
    return sum(abs(a) for a in group.advantages) * group.reward_std


def _draw_index(weights: Sequence[float], u: float) -> int:
    """Index i with probability weights[i] / sum(weights), from one uniform draw u in [0, 1).

    The first i whose cumulative weight exceeds u x total (inverse CDF over the given order).
    """
    target = u * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if target < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)  # u x total rounded onto the top edge


# ------------------------------------------------------------------ replay buffer
class ReplayBuffer:
    """The `capacity` highest-scoring groups with reward std > 0 seen so far, in a min-heap.

    A group enters when there is room or its `replay_score` beats the current minimum, which it then
    evicts (TRL experimental `GRPOWithReplayBufferTrainer.ReplayBuffer`). `fill` puts a batch's zero-std
    groups back to work: each is replaced by a copy of a buffered group (marked `replayed=True`, with its
    stored advantages), drawn in proportion to score. Unlike TRL, the draw happens before the batch's own
    groups enter, so a fresh group is never replayed in its own batch.

    Args:
        capacity: groups kept at most (>= 1).
        rng: source of the uniform draws (seed it for reproducible runs and tests).

    Raises:
        ValueError: capacity < 1.
    """

    def __init__(self, capacity: int, rng: random.Random):
        if capacity < 1:
            raise ValueError(
                f"replay buffer capacity must be >= 1, got {capacity}. Fix: set replay_buffer_size=0 "
                "to disable replay instead."
            )
        self.capacity = capacity
        self.rng = rng
        self.replayed_total = 0  # groups handed out by `fill` so far (cumulative metric `replayed_groups`)
        self._heap: list[tuple[float, int, RolloutGroup]] = []  # (score, insertion seq, group); seq breaks ties
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def state_dict(self) -> dict:
        """Everything a resumed run needs: the held groups with their scores and order, the RNG state and
        `replayed_total` (picklable; the groups are copied by reference)."""
        seq = max((entry[1] for entry in self._heap), default=-1) + 1
        return {
            "heap": list(self._heap),
            "next_seq": seq,
            "rng": self.rng.getstate(),
            "replayed_total": self.replayed_total,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`."""
        self._heap = list(state["heap"])
        heapq.heapify(self._heap)
        self._seq = itertools.count(int(state["next_seq"]))
        self.rng.setstate(state["rng"])
        self.replayed_total = int(state["replayed_total"])

    def add(self, group: RolloutGroup) -> bool:
        """Offer one scored group; returns True if it was kept.

        Refused: replayed copies, zero-std groups (`is_zero_std`), and groups whose score is not above
        the minimum of a full buffer.
        """
        if group.replayed or is_zero_std(group.reward_std):
            return False
        score = replay_score(group)
        if not (math.isfinite(score) and score > 0.0):
            return False
        entry = (score, next(self._seq), group)
        if len(self._heap) < self.capacity:
            heapq.heappush(self._heap, entry)
            return True
        if score > self._heap[0][0]:
            heapq.heapreplace(self._heap, entry)
            return True
        return False

    def sample(self, k: int) -> list[RolloutGroup]:
        """`k` groups drawn with probability proportional to score, as `replayed=True` copies.

        Without replacement when k <= len(self), with replacement otherwise (TRL); entries are visited in
        ascending (score, insertion) order, one `rng.random()` per draw (see `_draw_index`). The copies
        share the stored lists (nothing downstream mutates them). Empty buffer or k <= 0: [].
        """
        if k <= 0 or not self._heap:
            return []
        entries = sorted(self._heap)  # (score, seq) are unique, so groups are never compared
        weights = [entry[0] for entry in entries]
        picked: list[tuple[float, int, RolloutGroup]] = []
        if k > len(entries):
            picked = [entries[_draw_index(weights, self.rng.random())] for _ in range(k)]
        else:
            for _ in range(k):
                i = _draw_index(weights, self.rng.random())
                picked.append(entries.pop(i))
                weights.pop(i)
        return [dataclasses.replace(entry[2], replayed=True) for entry in picked]

    def fill(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        """Replace the zero-std groups of one batch by buffered groups, then offer the batch's groups.

        Args:
            groups: the batch's groups with `rewards` and `advantages` filled (`make_train_batch`).

        Returns:
            A new list of the same length: zero-std groups replaced (as many as the buffer can give,
            leftmost first); everything else unchanged. `replayed_total` grows by the replacements.
        """
        zero = [i for i, grp in enumerate(groups) if not grp.replayed and is_zero_std(grp.reward_std)]
        drawn = self.sample(len(zero))
        out = list(groups)
        for i, grp in zip(zero, drawn, strict=False):
            out[i] = grp
        self.replayed_total += len(drawn)
        if drawn:
            logger.debug("replayed %d group(s) in place of zero-std groups (total %d)", len(drawn), self.replayed_total)
        for grp in groups:
            self.add(grp)
        return out


# ------------------------------------------------------------------ deferred re-roll
class RerollQueue(Generic[T]):
    """FIFO of prompts whose whole group scored ~0, generated again later with a newer policy.

    `offer` queues a prompt when every weighted reward of its group is within ZERO_REWARD_ATOL of 0.
    From trainer step `start_step` on, `take` hands queued prompts back (oldest first) so that they are
    generated before fresh prompts, at most `max_per_batch` for each batch's worth of launches. The
    caller never offers a re-rolled group's prompt again, so each prompt is re-rolled at most once per
    time it scores ~0 as a fresh prompt.

    Args:
        start_step: first trainer step at which re-rolls are launched, ceil(reroll_start_fraction x max_steps).
        max_per_batch: re-rolls per batch index at most (`reroll_max_groups`, >= 1).
        capacity: prompts waiting at most; a candidate beyond it is not kept and is counted in `overflowed`.

    Raises:
        ValueError: start_step < 0, max_per_batch < 1 or capacity < 1.
    """

    def __init__(self, *, start_step: int, max_per_batch: int, capacity: int = REROLL_FIFO_CAPACITY):
        if start_step < 0 or max_per_batch < 1 or capacity < 1:
            raise ValueError(
                f"RerollQueue needs start_step >= 0, max_per_batch >= 1 and capacity >= 1; got "
                f"{start_step}, {max_per_batch}, {capacity}"
            )
        self.start_step = start_step
        self.max_per_batch = max_per_batch
        self.capacity = capacity
        self.rerolled_total = 0  # re-rolled groups that reached a batch (cumulative metric `rerolled_groups`)
        self.overflowed = 0  # candidates refused because the FIFO was full
        self._fifo: collections.deque[T] = collections.deque()
        self._taken: dict[int, int] = {}  # batch index -> re-rolls launched for it

    def __len__(self) -> int:
        return len(self._fifo)

    def offer(self, item: T, rewards_per_func: list[list[float]], weights: list[float]) -> bool:
        """Queue `item` if its group scored ~0 (`all_rewards_near_zero`); returns True if queued."""
        if not all_rewards_near_zero(rewards_per_func, weights):
            return False
        if len(self._fifo) >= self.capacity:
            self.overflowed += 1
            if self.overflowed == 1 or self.overflowed % 100 == 0:
                logger.warning(
                    "re-roll FIFO full (%d prompts): %d candidate(s) not kept", self.capacity, self.overflowed
                )
            return False
        self._fifo.append(item)
        return True

    def take(self, step: int, batch_index: int) -> T | None:
        """The oldest queued prompt to launch now for batch `batch_index`, or None.

        None before `start_step`, when the FIFO is empty, or when `max_per_batch` re-rolls were already
        launched for this batch index.

        Args:
            step: the trainer's current step (the orchestrator uses policy version x vllm_sync_interval).
            batch_index: which batch the launch is for (launches so far // groups_per_step).
        """
        if step < self.start_step or not self._fifo or self._taken.get(batch_index, 0) >= self.max_per_batch:
            return None
        self._taken[batch_index] = self._taken.get(batch_index, 0) + 1
        for old in [b for b in self._taken if b < batch_index - 1]:  # launches only move forward (+-1)
            del self._taken[old]
        return self._fifo.popleft()

    def state_dict(self) -> dict:
        """The waiting prompts, the per-batch launch counts and the counters (picklable)."""
        return {
            "fifo": list(self._fifo),
            "taken": dict(self._taken),
            "rerolled_total": self.rerolled_total,
            "overflowed": self.overflowed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`."""
        self._fifo = collections.deque(state["fifo"])
        self._taken = {int(k): int(v) for k, v in state["taken"].items()}
        self.rerolled_total = int(state["rerolled_total"])
        self.overflowed = int(state["overflowed"])

    def count_batched(self, groups: list[RolloutGroup]) -> int:
        """Add the re-rolled groups among `groups` (a batch being emitted) to `rerolled_total`; returns it."""
        self.rerolled_total += sum(grp.rerolled for grp in groups)
        return self.rerolled_total
