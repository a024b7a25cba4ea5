"""Whether the inference server is serving the trainer's weights right now: one gate shared by the orchestrator and
the runner.

A generation request that fails at the transport level (connection refused or reset: the server process is gone)
or a weight push that cannot reach the server marks the server *lost*. While it is lost the orchestrator launches
nothing new and parks each failed group until the server is back (the group is then generated again: nothing in
flight is lost); the runner notices at its next wait or push, restarts the server (or waits for Kubernetes to),
re-initialises the weight transfer, pushes the current weights and marks it *restored*.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

logger = logging.getLogger(__name__)

POLL_S = 0.2


class InferenceLost(RuntimeError):
    """Raised in the trainer's waits when the inference server was marked lost (the runner recovers it)."""


class InferenceHealth:
    """The lost / available gate (thread-safe; the orchestrator's event loop polls it without blocking).

    Attributes:
        reason: why the server was last marked lost ("" while it never was).
        restarts: recoveries completed so far (logged as `inference/restarts`).
        parked_groups: groups whose generation failed because the server was gone and were generated again once it
            was back (cumulative; logged as `inference/regenerated_groups`).
    """

    def __init__(self) -> None:
        self._available = threading.Event()
        self._available.set()
        self._lock = threading.Lock()
        self.reason = ""
        self.restarts = 0
        self.parked_groups = 0

    @property
    def lost(self) -> bool:
        """True from `mark_lost` until `restored`."""
        return not self._available.is_set()

    def mark_lost(self, reason: str) -> None:
        """Close the gate (idempotent while lost); `reason` is logged once and kept for the recovery message."""
        with self._lock:
            if self._available.is_set():
                self.reason = reason
                self._available.clear()
                logger.warning("inference server lost: %s", reason)

    def restored(self) -> None:
        """Open the gate again after a recovery; counts it."""
        with self._lock:
            self.restarts += 1
            self._available.set()

    def check(self) -> None:
        """Raise `InferenceLost` while the server is lost (the trainer's waits poll this).

        Raises:
            InferenceLost: the gate is closed.
        """
        if self.lost:
            raise InferenceLost(self.reason)

    async def wait_available(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait (without blocking the event loop) until the gate opens; False after `timeout_s` seconds or on `stop`."""
        deadline = time.monotonic() + timeout_s
        while self.lost:
            if stop.is_set() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
