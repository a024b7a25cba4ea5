"""How busy the run keeps vLLM (`inference.busy`): the share of wall time with a request in flight."""

from __future__ import annotations

import asyncio

import pytest

from async_grpo.inference.busy import BusyClient, BusyMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_requests_count_once_and_a_request_in_flight_counts_up_to_the_read():
    t = FakeClock()
    meter = BusyMeter(now=t)
    t.now += 1.0  # idle
    meter.begin()
    t.now += 2.0
    meter.begin()  # a second request while the first runs: still one busy stretch
    t.now += 1.0
    meter.end()
    t.now += 1.0
    meter.end()  # busy 4 s of 5
    assert meter.fraction() == pytest.approx(0.8)
    meter.begin()
    t.now += 3.0  # in flight at the read: counted up to it, the rest goes to the next read
    assert meter.fraction() == pytest.approx(1.0)
    t.now += 1.0
    meter.end()
    t.now += 3.0
    assert meter.fraction() == pytest.approx(0.25)
    assert meter.fraction() == 0.0  # no time passed


def test_the_client_counts_each_call_busy_even_when_it_fails():
    t = FakeClock()
    meter = BusyMeter(now=t)

    class Server:
        closed = False

        async def generate(self, prompt_ids, **kwargs):
            t.now += 2.0
            if kwargs.get("fail"):
                raise ConnectionError("vLLM went away")
            return [prompt_ids]

        async def aclose(self):
            self.closed = True

    server = Server()
    client = BusyClient(server, meter)

    async def calls():
        assert await client.generate([1, 2], n=1) == [[1, 2]]
        with pytest.raises(ConnectionError):
            await client.generate([3], fail=True)
        t.now += 4.0
        await client.aclose()

    asyncio.run(calls())
    assert meter.fraction() == pytest.approx(0.5) and server.closed
