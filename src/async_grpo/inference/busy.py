"""How busy the run keeps its vLLM server(s): the share of wall time with at least one generation request in flight,
measured around the orchestrator's client (issue 53's generation side: `generation/vllm_busy_fraction`).

A busy fraction well below 1 on a run whose trainer waits (`time/wait_s`) says generation is not limited by vLLM's
speed but by what feeds it: too few groups in flight (`max_inflight_groups`), the staleness bound, slow rewards or
tools. One number per step; a server shared with evaluation counts its requests only when they go through this client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from async_grpo.inference.client import Completion, GenerationClient


class BusyMeter:
    """The share of wall time with at least one generation request in flight at vLLM, read between two reads
    (issue 53's generation side: `generation/vllm_busy_fraction`). Used from the orchestrator's event loop only.

    Args:
        now: the clock, in seconds (`time.monotonic`; a test passes its own).
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._inflight = 0
        self._busy_s = 0.0
        self._since = now()  # when the current busy stretch began (while requests are in flight)
        self._last_read = now()

    def begin(self) -> None:
        """A request was sent."""
        if self._inflight == 0:
            self._since = self._now()
        self._inflight += 1

    def end(self) -> None:
        """A request came back (or failed)."""
        self._inflight -= 1
        if self._inflight == 0:
            self._busy_s += self._now() - self._since

    def fraction(self) -> float:
        """Busy seconds / wall seconds since the previous call, in [0, 1]."""
        now = self._now()
        busy = self._busy_s + (now - self._since if self._inflight else 0.0)
        if self._inflight:
            self._since = now
        wall = now - self._last_read
        self._busy_s, self._last_read = 0.0, now
        return min(busy / wall, 1.0) if wall > 0 else 0.0


class BusyClient:
    """A `GenerationClient` that reports each `generate` call to a `BusyMeter` around the wrapped client's.

    Args:
        client: the inference client.
        meter: where the calls are counted.
    """

    def __init__(self, client: GenerationClient, meter: BusyMeter) -> None:
        self.client = client
        self.meter = meter

    async def generate(self, prompt_ids: list[int], **kwargs: Any) -> list[Completion]:
        """`client.generate(prompt_ids, **kwargs)`, counted busy while it runs."""
        self.meter.begin()
        try:
            return await self.client.generate(prompt_ids, **kwargs)
        finally:
            self.meter.end()

    async def aclose(self) -> None:
        """Close the wrapped client."""
        await self.client.aclose()
