"""A weight push that runs beside the trainer's next optimizer step (`weight_sync_overlap`).

Without it the trainer waits for every push: vLLM's pause, the wire, vLLM's load and its resume (on the demo, about
0.09 s of a 0.29 s step on 2 CPU cores). With it, the step that is due to push freezes a copy of its weights
(`transports.weights.frozen.FrozenSource`), starts the push on one background thread and goes on to the next step;
the push is waited for (settled) before the next one starts and before anything that needs vLLM to serve the
trainer's newest weights or a consistent version: a held-out evaluation, a checkpoint, the end of the run. This is
PipelineRL's in-flight weight update and prime-rl's asynchronous checkpoint broadcast, in-process.

What changes for the run: the policy version still moves only once vLLM serves the new weights, so every group is
stamped with the weights that really sampled it and the importance sampling ratio and OPSM see the true behaviour
policy. The trainer may be one more step ahead of the served version than without overlap (it trains step k + 1
while step k's weights travel), so `staleness/*` counts that step as it happens. A push's seconds and bytes are
logged at the step that settles it, not the step that started it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from async_grpo.transports.weights.frozen import FrozenSource

logger = logging.getLogger(__name__)


class OverlappedPush:
    """At most one weight push in flight on a background thread, reading a frozen copy of the weights.

    Args:
        source: the pushers' source (frozen by `start`, thawed when the push ends, however it ends).
        push: pushes the source's weights and bumps the policy version once vLLM serves them
            (`GRPORecipe.push_weights`); returns the push's seconds; raises when the push failed.
        timeout_s: the longest `settle` waits for a push (seconds): the push's own timeouts bound it first
            (`weight_sync_timeout_s` per control call and broadcast), this is the last resort.
    """

    def __init__(self, source: FrozenSource, push: Callable[[], float], timeout_s: float):
        self.source = source
        self.push = push
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlapped-push")
        self._future: Future[float] | None = None

    @property
    def in_flight(self) -> bool:
        """True from `start` until `settle` returned or raised."""
        return self._future is not None

    def start(self) -> None:
        """Freeze the weights as they are now (on the caller's thread, between optimizer steps) and push them on
        the background thread.

        Raises:
            RuntimeError: a push is still in flight (`settle` it first).
        """
        if self._future is not None:
            raise RuntimeError("OverlappedPush.start(): the previous push is still in flight; settle() it first")
        self.source.freeze()
        try:
            self._future = self._pool.submit(self._run)
        except BaseException:
            self.source.thaw()
            raise

    def _run(self) -> float:
        try:
            return self.push()
        finally:
            self.source.thaw()

    def settle(self) -> float | None:
        """Wait for the push in flight; returns its seconds, or None when none was in flight.

        Raises:
            TimeoutError: it did not end within `timeout_s` (it is abandoned: the source stays frozen until it ends).
            whatever the push raised (the caller recovers the server, as after a failed push in the step).
        """
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout as err:
            raise TimeoutError(f"a background weight push did not end within {self.timeout_s:.0f} s") from err

    def drain(self) -> None:
        """Settle a push still in flight, logging its failure instead of raising it (before a recovery that
        pushes again, and at shutdown). Never raises."""
        try:
            self.settle()
        except Exception as err:
            logger.warning("a background weight push failed: %r", err)

    def close(self) -> None:
        """`drain`, then stop the thread. Never raises."""
        self.drain()
        self._pool.shutdown(wait=False, cancel_futures=True)
