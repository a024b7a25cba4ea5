"""Several vLLM replicas: least-in-flight balancing, failover of a request to a live replica, pushes that reach every
live replica, and a lost replica recovered in the background that rejoins at the next push (fakes; the real servers
are in tests/integration/test_replicas.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from async_grpo.inference.client import Completion, InferenceEndpoint
from async_grpo.inference.replicas import BalancedClient, ReplicaSet, attached_endpoints, replica_urls
from async_grpo.transports.weights.push import PushReport
from async_grpo.transports.weights.replicas import NoReplicaError, ReplicaPusher


def replica_set(n: int, **kw) -> ReplicaSet:
    return ReplicaSet([InferenceEndpoint(f"http://10.0.0.{i}:8000", **kw) for i in range(n)])


def test_pick_prefers_fewest_in_flight_then_lowest_index():
    rs = replica_set(3)
    picked = [rs.pick().index for _ in range(6)]
    assert picked == [0, 1, 2, 0, 1, 2]
    rs.done(rs.replicas[1], answered=True)
    assert rs.pick().index == 1 and rs.replicas[1].requests == 1


def test_pick_skips_lost_and_uses_syncing_only_as_a_last_resort():
    rs = replica_set(3)
    rs.mark_lost(rs.replicas[0], "gone")
    rs.set_state(rs.replicas[1], "syncing")
    assert [rs.pick().index for _ in range(3)] == [2, 2, 2]
    rs.mark_lost(rs.replicas[2], "gone")
    assert rs.pick().index == 1
    rs.mark_lost(rs.replicas[1], "gone")
    assert rs.pick() is None
    assert rs.metrics()["inference/live_replicas"] == 0.0


class FakeServer:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = 0

    async def generate(self, prompt_ids, **kw):
        self.calls += 1
        await asyncio.sleep(0.01)
        if self.fail:
            raise httpx.ConnectError("connection refused")
        return [Completion([1, 2], [-0.1, -0.2], "ab", "stop")]

    async def aclose(self):
        pass


def balanced(rs: ReplicaSet, servers: dict[int, FakeServer]) -> BalancedClient:
    client = BalancedClient(rs, "m")
    client._client = lambda replica: servers[replica.index]
    return client


def test_a_dead_replica_costs_no_request():
    rs = replica_set(2)
    servers = {0: FakeServer(fail=True), 1: FakeServer()}
    client = balanced(rs, servers)

    async def many():
        return await asyncio.gather(*[client.generate([5], n=1, max_tokens=2, temperature=1.0) for _ in range(8)])

    results = asyncio.run(many())
    assert len(results) == 8 and all(r[0].token_ids == [1, 2] for r in results)
    assert rs.replicas[0].state == "lost" and rs.replicas[1].state == "available"
    assert servers[1].calls == 8 and rs.replicas[1].requests == 8
    assert rs.rerouted >= 1 and all(r.in_flight == 0 for r in rs.replicas)
    assert rs.metrics()["inference/replica_0/available"] == 0.0


def test_balancing_spreads_concurrent_requests_evenly():
    rs = replica_set(2)
    servers = {0: FakeServer(), 1: FakeServer()}
    client = balanced(rs, servers)

    async def many():
        await asyncio.gather(*[client.generate([5], n=1, max_tokens=2, temperature=1.0) for _ in range(10)])

    asyncio.run(many())
    assert servers[0].calls == 5 and servers[1].calls == 5


def test_no_live_replica_raises_the_transport_error_for_the_orchestrator():
    rs = replica_set(2)
    client = balanced(rs, {0: FakeServer(fail=True), 1: FakeServer(fail=True)})
    with pytest.raises(httpx.ConnectError):
        asyncio.run(client.generate([5], n=1, max_tokens=2, temperature=1.0))
    with pytest.raises(httpx.ConnectError, match="no live vLLM replica"):
        asyncio.run(client.generate([5], n=1, max_tokens=2, temperature=1.0))


def fake_resolver(addresses: list[str]):
    def resolve(host, port, type=None):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    return resolve


def test_replica_urls_from_a_list_or_from_dns():
    assert replica_urls("http://a:1/, http://b:2", 2, 1.0) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="vllm_replicas=3"):
        replica_urls("http://a:1,http://b:2", 3, 1.0)
    urls = replica_urls("http://run-vllm.ns.svc:8000", 2, 1.0, fake_resolver(["10.1.0.9", "10.1.0.4", "10.1.0.7"]))
    assert urls == ["http://10.1.0.4:8000", "http://10.1.0.7:8000"]
    with pytest.raises(TimeoutError, match="resolves to 1 address"):
        replica_urls("http://run-vllm.ns.svc:8000", 2, 0.0, fake_resolver(["10.1.0.9"]))


def test_a_replaced_pod_is_rediscovered_at_its_new_address():
    addresses = ["10.1.0.4", "10.1.0.7"]
    endpoints = attached_endpoints(
        "http://run-vllm:8000", 2, 1.0, lambda h, p, type=None: fake_resolver(addresses)(h, p)
    )
    assert [e.url for e in endpoints] == ["http://10.1.0.4:8000", "http://10.1.0.7:8000"]
    addresses[:] = ["10.1.0.7", "10.1.0.12"]  # pod .4 died; its replacement came up at .12
    assert endpoints[0].rediscover() == "http://10.1.0.12:8000"
    endpoints[0].url = "http://10.1.0.12:8000"  # replica 0 moved there: each replica now finds only its own address
    assert [e.rediscover() for e in endpoints] == ["http://10.1.0.12:8000", "http://10.1.0.7:8000"]
    addresses[:] = ["10.1.0.12"]  # pod .7 died too, with no replacement yet
    assert endpoints[1].rediscover() is None


class FakePusher:
    made: list[FakePusher] = []

    def __init__(self, url: str, fail_urls: set[str]):
        self.url, self.fail_urls, self.versions, self.setups, self.closed = url, fail_urls, [], 0, False
        self.last_report = PushReport(wire_bytes=1000, dense_bytes=1200)
        FakePusher.made.append(self)

    def setup(self):
        self.setups += 1

    def push(self, version: int) -> float:
        if self.url in self.fail_urls:
            raise RuntimeError(f"{self.url} is gone")
        self.versions.append(version)
        return 0.01

    def close(self):
        self.closed = True


def test_push_reaches_every_live_replica_and_survives_one_failure():
    FakePusher.made = []
    rs, fail = replica_set(2), set()
    pusher = ReplicaPusher(rs, lambda url: FakePusher(url, fail))
    pusher.setup()
    pusher.push(1)
    assert [p.versions for p in FakePusher.made] == [[1], [1]] and pusher.last_report.wire_bytes == 1000
    fail.add(rs.replicas[0].url)
    pusher.push(2)  # replica 0 fails: lost, the push still counts
    assert rs.replicas[0].state == "lost" and FakePusher.made[1].versions == [1, 2]
    assert set(pusher.last_seconds) == {1}
    metrics = pusher.last_report.metrics()  # what the step logs: bytes per server and the one replica that took it
    assert metrics["weight_sync/bytes"] == 1000 and metrics["weight_sync/dense_bytes"] == 1200
    assert set(metrics) == {"weight_sync/bytes", "weight_sync/dense_bytes", "weight_sync/replica_1/seconds"}


def test_one_replica_reports_no_per_replica_seconds_and_unknown_bytes_are_not_logged():
    FakePusher.made = []
    pusher = ReplicaPusher(replica_set(1), lambda url: FakePusher(url, set()))
    pusher.setup()
    seconds = pusher.push(1)
    assert pusher.last_report.seconds == seconds and pusher.last_report.replica_seconds == {}
    assert PushReport(seconds=1.0).metrics() == {}  # no transport count: nothing claimed


def test_a_lost_replica_recovers_in_the_background_and_rejoins_with_the_current_weights():
    FakePusher.made = []
    rs, fail = replica_set(2), set()
    recovered, release = threading.Event(), threading.Event()

    def recover(timeout_s):
        assert release.wait(5)  # the restart takes a while: the push that started it does not wait for it
        fail.clear()  # the restarted server accepts pushes again
        recovered.set()

    rs.replicas[0].endpoint.restart = lambda: recover(1.0)
    pusher = ReplicaPusher(rs, lambda url: FakePusher(url, fail), max_restarts=2)
    pusher.setup()
    fail.add(rs.replicas[0].url)
    pusher.push(1)
    assert rs.replicas[0].state == "lost"
    pusher.push(2)  # starts the background recovery of replica 0; replica 1 gets version 2
    assert rs.replicas[0].state == "recovering" and FakePusher.made[1].versions == [1, 2]
    release.set()
    assert recovered.wait(5)
    deadline = time.monotonic() + 5
    while rs.replicas[0].state != "ready" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rs.replicas[0].state == "ready" and rs.replicas[0].restarts == 1
    assert rs.pick().index == 1  # behind: no requests until it holds the current weights
    pusher.push(3)
    fresh = FakePusher.made[-1]
    assert fresh.url == rs.replicas[0].url and fresh.setups == 1 and fresh.versions == [3]
    assert FakePusher.made[0].closed  # the old transfer group was torn down
    assert rs.replicas[0].state == "available"
    pusher.close()


def test_no_replica_taking_the_push_raises_and_recover_all_brings_them_back():
    FakePusher.made = []
    rs, fail = replica_set(2), set()
    for r in rs.replicas:
        r.endpoint.restart = fail.clear
    pusher = ReplicaPusher(rs, lambda url: FakePusher(url, fail))
    pusher.setup()
    fail.update(r.url for r in rs.replicas)
    with pytest.raises(NoReplicaError, match="no vLLM replica accepted policy version 1"):
        pusher.push(1)
    assert rs.live() == []
    pusher.recover_all(5.0)
    assert [r.state for r in rs.replicas] == ["available", "available"]
    pusher.push(1)
    assert [p.versions for p in FakePusher.made[-2:]] == [[1], [1]]


def test_each_replica_client_coalesces_with_the_runs_window():
    async def clients(window_s):
        client = BalancedClient(replica_set(2), "m", coalesce_window_s=window_s)
        try:
            return [client._client(r).coalescer for r in client.replicas.replicas]
        finally:
            await client.aclose()

    assert [c.window_s for c in asyncio.run(clients(0.01))] == [0.01, 0.01]
    assert asyncio.run(clients(0.0)) == [None, None]
