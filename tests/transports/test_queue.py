"""RolloutQueue: staleness drops on get, timeouts, stop handling, and thread-safe counters."""

from __future__ import annotations

import asyncio
import threading

import pytest

from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import RolloutGroup, TrainBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

JOIN_TIMEOUT_S = 10.0
GET_TIMEOUT_S = 10.0


def group(version: int, tag: str = "") -> RolloutGroup:
    return RolloutGroup(
        prompt_ids=[1, 2], completion_ids=[[3], [4, 5]], sampling_logprobs=[[-0.1], [-0.2, -0.3]],
        truncated=[False, False], completions=["a", "bb"], prompt=tag or "p", columns={}, policy_version=version,
    )  # fmt: skip


def batch(*versions: int, tag: str = "") -> TrainBatch:
    return TrainBatch(groups=[group(v, tag) for v in versions])


def make_queue(maxsize: int = 4, max_staleness: int = 1) -> RolloutQueue:
    return RolloutQueue(maxsize=maxsize, max_staleness=max_staleness, drops=DropCounter())


def test_fifo_and_depth():
    q = make_queue()
    stop = threading.Event()
    assert q.put(batch(0, tag="first"), stop) and q.put(batch(0, tag="second"), stop)
    assert q.depth == 2
    assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "first"
    assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "second"
    assert q.depth == 0
    assert q.drops.snapshot() == {}


def test_stale_groups_removed_on_get_and_counted():
    q = make_queue(max_staleness=1)
    q.put(batch(0, 1, 2, 3, 3), threading.Event())
    out = q.get(current_version=3, timeout_s=GET_TIMEOUT_S)
    assert [g.policy_version for g in out.groups] == [2, 3, 3]  # 3 - 2 = 1 <= max_staleness is kept
    assert q.drops.snapshot() == {"stale": 2}


def test_max_staleness_zero_keeps_only_current_version():
    q = make_queue(max_staleness=0)
    q.put(batch(4, 5), threading.Event())
    assert [g.policy_version for g in q.get(5, GET_TIMEOUT_S).groups] == [5]
    assert q.drops.snapshot() == {"stale": 1}


def test_replayed_groups_are_exempt_from_the_staleness_drop():
    q = make_queue(max_staleness=1)
    b = batch(0, 0, 5)
    b.groups[0].replayed = True  # drawn from the replay buffer: old on purpose
    q.put(b, threading.Event())
    out = q.get(current_version=5, timeout_s=GET_TIMEOUT_S)
    assert [(g.policy_version, g.replayed) for g in out.groups] == [(0, True), (5, False)]
    assert q.drops.snapshot() == {"stale": 1}  # only the non-replayed version-0 group


def test_batch_with_all_groups_stale_is_skipped():
    q = make_queue(max_staleness=1)
    stop = threading.Event()
    q.put(batch(0, 0, 1, tag="old"), stop)
    q.put(batch(5, 6, tag="new"), stop)
    out = q.get(current_version=6, timeout_s=GET_TIMEOUT_S)
    assert out.groups[0].prompt == "new"
    assert [g.policy_version for g in out.groups] == [5, 6]
    assert q.drops.snapshot() == {"stale": 3}
    assert q.depth == 0


def test_only_stale_batches_end_in_timeout():
    q = make_queue(max_staleness=0)
    q.put(batch(0, 0), threading.Event())
    with pytest.raises(TimeoutError):
        q.get(current_version=2, timeout_s=0.5)
    assert q.drops.snapshot() == {"stale": 2}


def test_get_times_out_on_empty_queue():
    q = make_queue()
    with pytest.raises(TimeoutError, match="rollout_timeout_s"):
        q.get(current_version=0, timeout_s=0.3)


def test_get_raises_interrupted_when_stop_already_set():
    q = make_queue()
    q.put(batch(0), threading.Event())
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        q.get(0, GET_TIMEOUT_S, stop)
    assert q.depth == 1  # nothing consumed


def test_get_raises_interrupted_when_stop_set_while_waiting():
    q = make_queue()
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    try:
        with pytest.raises(InterruptedError):
            q.get(0, timeout_s=30.0, stop=stop)  # would time out only after 30 s
    finally:
        timer.cancel()


def test_put_returns_false_and_counts_shutdown_when_stopped_while_full():
    q = make_queue(maxsize=1)
    stop = threading.Event()
    assert q.put(batch(0), stop)
    assert q.full()
    result: list[bool] = []
    producer = threading.Thread(target=lambda: result.append(q.put(batch(0, 0, 0), stop)))
    producer.start()
    stop.set()
    producer.join(JOIN_TIMEOUT_S)
    assert not producer.is_alive()
    assert result == [False]
    assert q.drops.snapshot() == {"shutdown": 3}
    assert q.depth == 1


def test_put_after_stop_is_refused_even_with_room():
    q = make_queue(maxsize=2)
    stop = threading.Event()
    stop.set()
    assert q.put(batch(0, 0), stop) is False
    assert q.depth == 0
    assert q.drops.snapshot() == {"shutdown": 2}


def test_put_times_out_on_full_queue():
    q = make_queue(maxsize=1)
    stop = threading.Event()
    assert q.put(batch(0), stop, timeout_s=1.0)
    assert q.put(batch(0, 0), stop, timeout_s=0.3) is False
    assert q.drops.snapshot() == {"queue_timeout": 2}
    assert q.depth == 1


def test_blocked_put_completes_when_consumer_makes_room():
    q = make_queue(maxsize=1)
    stop = threading.Event()
    q.put(batch(0, tag="first"), stop)
    result: list[bool] = []
    producer = threading.Thread(target=lambda: result.append(q.put(batch(0, tag="second"), stop, timeout_s=30)))
    producer.start()
    assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "first"
    producer.join(JOIN_TIMEOUT_S)
    assert result == [True]
    assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "second"


def test_put_async_waits_for_room_without_a_thread_and_enqueues_in_order():
    q = make_queue(maxsize=1)
    stop = threading.Event()
    q.put(batch(0, tag="first"), stop)

    async def go():
        waiting = asyncio.create_task(q.put_async(batch(0, tag="second"), stop))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # still waiting for room
        assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "first"
        return await asyncio.wait_for(waiting, JOIN_TIMEOUT_S)

    assert asyncio.run(go()) is True
    assert q.get(0, GET_TIMEOUT_S).groups[0].prompt == "second"
    assert q.drops.snapshot() == {}


def test_put_async_cancelled_while_waiting_counts_the_batch_as_shutdown_once():
    """The prompt ledger's flake: a chunk whose wait for room was cancelled at shutdown (formerly a thread's `put`
    cancelled before it ran) must be counted, not vanish."""
    q = make_queue(maxsize=1)
    stop = threading.Event()
    q.put(batch(0), stop)

    async def go():
        waiting = asyncio.create_task(q.put_async(batch(0, 0, 0), stop))
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(go())
    assert q.drops.snapshot() == {"shutdown": 3}
    assert q.depth == 1


def test_put_async_returns_false_and_counts_shutdown_when_stopped():
    q = make_queue(maxsize=1)
    stop = threading.Event()
    q.put(batch(0), stop)

    async def go():
        waiting = asyncio.create_task(q.put_async(batch(0, 0), stop))
        await asyncio.sleep(0.02)
        stop.set()
        return await asyncio.wait_for(waiting, JOIN_TIMEOUT_S)

    assert asyncio.run(go()) is False
    assert q.drops.snapshot() == {"shutdown": 2}
    assert q.depth == 1


def test_policy_version_bump_is_thread_safe():
    threads_n, bumps = 8, 2000
    version = PolicyVersion(10)
    seen: list[list[int]] = [[] for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n)

    def worker(out: list[int]) -> None:
        barrier.wait(timeout=JOIN_TIMEOUT_S)
        for _ in range(bumps):
            out.append(version.bump())

    threads = [threading.Thread(target=worker, args=(seen[i],)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert version.value == 10 + threads_n * bumps
    returned = sorted(v for out in seen for v in out)
    assert returned == list(range(11, 11 + threads_n * bumps))  # every bump returned a distinct new value
    assert all(out == sorted(out) for out in seen)  # each thread sees its own bumps increase


def test_drop_counter_counts_by_reason_across_threads():
    drops = DropCounter()
    threads = [threading.Thread(target=lambda: [drops.add("stale") for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    drops.add("reward_timeout", 3)
    snap = drops.snapshot()
    assert snap == {"stale": 800, "reward_timeout": 3}
    snap["stale"] = 0  # a copy: the counter is unchanged
    assert drops.snapshot()["stale"] == 800
