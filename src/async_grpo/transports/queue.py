"""The bounded rollout queue between the orchestrator (producer) and the trainer (consumer).

It is the only shared state between the two roles besides the policy-version counter
(`transports.policy_version`). Bounding it
gives backpressure; dropping groups older than `max_staleness` on the way out keeps the trainer
near on-policy, and every drop is counted by reason (`transports.drops.DropReason`) so nothing disappears
silently.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from async_grpo.transports.drops import DropCounter, DropReason
from async_grpo.transports.messages import TrainBatch

logger = logging.getLogger(__name__)

POLL_S = 0.1
ASYNC_PUT_POLL_S = 0.005  # `put_async`'s poll of a full queue (a non-blocking try: cheap, and room is taken at once)


class RolloutQueue:
    """Bounded FIFO of `TrainBatch`es.

    Args:
        maxsize: batches held at most; `put` blocks beyond it.
        max_staleness: on `get`, groups whose policy version is more than this many versions behind
            the current one are removed from the batch and counted as `stale`; replayed groups
            (`RolloutGroup.replayed`) are exempt, since the replay buffer serves old groups on purpose.
        drops: shared drop counter.
    """

    def __init__(self, maxsize: int, max_staleness: int, drops: DropCounter):
        self._q: queue.Queue[TrainBatch] = queue.Queue(maxsize=maxsize)
        self.maxsize = maxsize
        self.max_staleness = max_staleness
        self.drops = drops
        self._skipped_steps = 0
        self._lock = threading.Lock()

    @property
    def skipped_steps(self) -> int:
        """Whole step batches (`final` ones) that `get` skipped because every group was stale: steps the
        producer's pacing must not count as consumed (the trainer trained on the next batch instead)."""
        with self._lock:
            return self._skipped_steps

    @property
    def depth(self) -> int:
        """Batches waiting."""
        return self._q.qsize()

    def full(self) -> bool:
        """True when a `put` would block."""
        return self._q.full()

    def drain(self, reason: DropReason = "unconsumed_at_end") -> int:
        """Empty the queue (once its producer stopped), counting every group left in it as dropped with `reason`;
        returns how many."""
        n = 0
        while True:
            try:
                n += len(self._q.get_nowait().groups)
            except queue.Empty:
                break
        if n:
            self.drops.add(reason, n)
        return n

    def put(self, batch: TrainBatch, stop: threading.Event, timeout_s: float | None = None) -> bool:
        """Enqueue, waiting for room until `stop` is set or `timeout_s` passes.

        Returns:
            True if enqueued; False if stopped or timed out (the batch's groups are then counted as
            dropped with reason `shutdown` or `queue_timeout`).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not stop.is_set():
            try:
                self._q.put(batch, timeout=POLL_S)
                return True
            except queue.Full:
                if deadline is not None and time.monotonic() > deadline:
                    self.drops.add("queue_timeout", len(batch.groups))
                    return False
        self.drops.add("shutdown", len(batch.groups))
        return False

    async def put_async(self, batch: TrainBatch, stop: threading.Event) -> bool:
        """`put` for an event loop (the orchestrator's): enqueue, waiting for room without a thread until `stop` is
        set. The batch is counted exactly once whatever happens: enqueued, or dropped as `shutdown` when `stop` was
        set first or the awaiting task was cancelled (a thread's `put` cancelled before it ran would do neither,
        and its groups would leave the prompt ledger unaccounted).

        Returns:
            True if enqueued; False if stopped (the batch's groups counted as `shutdown`).

        Raises:
            asyncio.CancelledError: the task was cancelled while waiting (the groups are counted first).
        """
        try:
            while not stop.is_set():
                try:
                    self._q.put_nowait(batch)
                    return True
                except queue.Full:
                    await asyncio.sleep(ASYNC_PUT_POLL_S)
        except asyncio.CancelledError:
            self.drops.add("shutdown", len(batch.groups))
            raise
        self.drops.add("shutdown", len(batch.groups))
        return False

    def get(
        self,
        current_version: int,
        timeout_s: float,
        stop: threading.Event | None = None,
        keep_empty_final: bool = False,
    ) -> TrainBatch:
        """Next batch with stale groups (other than replayed ones) removed and counted; skips batches left empty,
        except, with `keep_empty_final`, a step's final chunk (its `final` flag ends the step for the reader). A
        skipped final batch is counted in `skipped_steps`.

        Raises:
            TimeoutError: no usable batch within `timeout_s` seconds.
            InterruptedError: `stop` was set while waiting.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if stop is not None and stop.is_set():
                raise InterruptedError("rollout queue: stop requested")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no rollout batch arrived within {timeout_s:.0f} s; check the vLLM server log and reward "
                    "workers, or raise rollout_timeout_s"
                )
            try:
                batch = self._q.get(timeout=min(POLL_S, remaining))
            except queue.Empty:
                continue
            fresh = [g for g in batch.groups if g.replayed or current_version - g.policy_version <= self.max_staleness]
            if len(fresh) < len(batch.groups):
                self.drops.add("stale", len(batch.groups) - len(fresh))
            if fresh or (keep_empty_final and batch.final):
                batch.groups = fresh
                return batch
            if batch.final:
                with self._lock:
                    self._skipped_steps += 1
