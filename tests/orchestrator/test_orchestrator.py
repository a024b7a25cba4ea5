"""Orchestrator: batch assembly math, prompt cycling, and background runs against a fake vLLM client.

The fake clients stand in for `AsyncVLLMClient` only (same `generate`/`aclose` interface); the reward
pool is the real one, with spawned workers running the functions in `orch_reward_fns.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from pathlib import Path

import httpx
import pytest

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.inference.client import Completion
from async_grpo.orchestrator.batching import make_train_batch
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.progress import ProducerState
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.rewards.pool import RewardPool
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import RolloutGroup
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue
from async_grpo.transports.scorer import RewardError

FNS = Path(__file__).with_name("orch_reward_fns.py")
G = 4  # completions per group in the orchestrator runs
MARKER = 100  # first completion token = MARKER + policy version the fake client saw at request time
STD_EPS = 1e-4
WAIT_S = 30.0  # upper bound of every wait on the background thread / workers
STOP_TIMEOUT_S = 15.0
PACED_GET_TIMEOUT_S = 5.0  # a batch per trainer step should arrive well within this with the fake client


def spec(name: str) -> str:
    return f"{FNS}:{name}"


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def wait_until(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def expected_advantages(rewards: list[float]) -> list[float]:
    """Group-mean baseline over the finite rewards, divided by (sample std + 1e-4); 0 for NaN rows."""
    finite = [r for r in rewards if not math.isnan(r)]
    mean, std = statistics.fmean(finite), statistics.stdev(finite)
    return [0.0 if math.isnan(r) else (r - mean) / (std + STD_EPS) for r in rewards]


# ------------------------------------------------------------------ make_train_batch
def hand_group(rewards_per_func, lengths, truncated, version=0) -> RolloutGroup:
    return RolloutGroup(
        prompt_ids=[1, 2, 3],
        completion_ids=[[65] * n for n in lengths],
        sampling_logprobs=[[-1.0] * n for n in lengths],
        truncated=list(truncated),
        completions=["A" * n for n in lengths],
        prompt="p",
        columns={},
        policy_version=version,
        rewards_per_func=[list(r) for r in rewards_per_func],
    )


def test_make_train_batch_advantages_and_metrics():
    g1 = hand_group([[1, 0], [0, 1], [1, 1], [0, 0]], lengths=[1, 2, 3, 4], truncated=[False, False, False, True])
    g2 = hand_group([[1, 0]] * 4, lengths=[2, 2, 2, 2], truncated=[True, False, False, False], version=3)
    batch = make_train_batch([g1, g2], ["length", "format"], [1.0, 0.5], "group")

    assert batch.groups == [g1, g2]
    r1 = [1.0, 0.5, 1.5, 0.0]  # f1 + 0.5 f2
    r2 = [1.0] * 4
    assert g1.rewards == pytest.approx(r1)
    assert g2.rewards == pytest.approx(r2)
    assert g1.advantages == pytest.approx(expected_advantages(r1), abs=1e-6)
    assert g1.advantages == pytest.approx([0.25 / (math.sqrt(1.25 / 3) + STD_EPS) * k for k in (1, -1, 3, -3)])
    assert g2.advantages == [0.0] * 4  # zero-std group: no signal

    m = batch.metrics
    assert m["reward"] == pytest.approx(statistics.fmean(r1 + r2))
    assert m["reward_std"] == pytest.approx(statistics.stdev(r1 + r2))
    assert m["frac_reward_zero_std"] == pytest.approx(0.5)
    assert m["rewards/length/mean"] == pytest.approx(6 / 8)
    assert m["rewards/format/mean"] == pytest.approx(2 / 8)
    assert m["rewards/length/std"] == pytest.approx(statistics.stdev([1, 0, 1, 0, 1, 1, 1, 1]))
    assert m["completions/mean_length"] == pytest.approx((1 + 2 + 3 + 4 + 2 * 4) / 8)
    assert m["completions/max_length"] == 4.0
    assert m["completions/clipped_ratio"] == pytest.approx(2 / 8)
    assert not any(k.startswith("rewards/0/") or k.startswith("rewards/1/") for k in m)  # renamed to func names


def test_make_train_batch_none_rewards_and_no_scaling():
    nan = math.nan
    grp = hand_group([[1, nan], [nan, nan], [0, 0], [1, 1]], lengths=[1, 1, 1, 1], truncated=[False] * 4)
    batch = make_train_batch([grp], ["a", "b"], [1.0, 0.5], "none")
    assert grp.rewards[0] == pytest.approx(1.0)  # a None (NaN) reward counts as 0 beside a scored one
    assert math.isnan(grp.rewards[1])  # every function abstained: unscorable
    assert grp.rewards[2:] == pytest.approx([0.0, 1.5])
    mean = (1.0 + 0.0 + 1.5) / 3
    assert grp.advantages == pytest.approx([1.0 - mean, 0.0, -mean, 1.5 - mean])  # "none": no std division
    assert batch.metrics["reward"] == pytest.approx(mean)
    assert all(not math.isnan(v) for v in batch.metrics.values())


# ------------------------------------------------------------------ fake vLLM clients
class FakeClient:
    """Records each request; `aclose` marks it closed. Subclasses decide how `generate` answers."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class ScriptedClient(FakeClient):
    """Answers every request with n completions of lengths 1..n; the last one hits max_tokens.

    Completion tokens start with MARKER + the policy version seen at request time; then (if `bump`) the
    version is bumped, as if the trainer pushed new weights while the request was in flight.
    """

    def __init__(self, version: PolicyVersion, answer_first_only: bool = False, bump: bool = True) -> None:
        super().__init__()
        self.version = version
        self.answer_first_only = answer_first_only
        self.bump = bump

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        seen = self.version.value
        self.calls.append({"prompt_ids": list(prompt_ids), "n": n, "version": seen})
        if self.answer_first_only and len(self.calls) > 1:
            await asyncio.sleep(3600)  # vLLM stopped answering
        if self.bump:
            self.version.bump()
        await asyncio.sleep(0.01)
        out = []
        for i in range(n):
            ids = [MARKER + seen] + [97] * i
            out.append(Completion(ids, [-0.5] * len(ids), decode(ids), "length" if len(ids) >= max_tokens else "stop"))
        return out


class RefusingClient(FakeClient):
    """vLLM is down: every request fails to connect."""

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids)})
        await asyncio.sleep(0.01)
        raise httpx.ConnectError("connection refused")


class BrokenClient(FakeClient):
    """A client with a bug (or an answer it cannot parse): every request raises something unexpected."""

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids)})
        await asyncio.sleep(0.01)
        raise KeyError("token_logprobs")


class SilentClient(FakeClient):
    """vLLM accepts requests but never answers."""

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids)})
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


# ------------------------------------------------------------------ orchestrator runs
@pytest.fixture(scope="module")
def pool():
    """Real reward workers scoring [length_reward, constant_reward]."""
    with RewardPool([spec("length_reward"), spec("constant_reward")], num_workers=2, timeout_s=20) as p:
        assert p.submit(["p"], ["ab"], [[97, 98]], {"answer": ["ok"]}).result(timeout=WAIT_S).rows == [[2.0, 1.0]]
        yield p


@pytest.fixture(scope="module")
def idle_pool():
    """A reward pool that is never asked to score, so it never starts a worker process."""
    with RewardPool([spec("length_reward"), spec("constant_reward")], num_workers=1) as p:
        yield p


@pytest.fixture
def started():
    """Collects orchestrators a test starts and stops them at teardown, even when the test fails."""
    running: list[Orchestrator] = []
    yield running
    for orch in running:
        orch.stop(timeout_s=STOP_TIMEOUT_S)


def make_orchestrator(
    client,
    reward_pool,
    answers,
    *,
    version=None,
    groups_per_step=2,
    max_inflight=4,
    queue_size=4,
    max_staleness=10**6,
    vllm_sync_interval=1,
    **kwargs,
) -> Orchestrator:
    version = PolicyVersion() if version is None else version
    drops = DropCounter()
    prompts = [
        PromptItem(prompt=f"prompt {i}", prompt_ids=[10 + i, 20 + i], columns={"answer": a})
        for i, a in enumerate(answers)
    ]
    return Orchestrator(
        client_factory=lambda: client,
        prompts=PromptSampler(prompts, seed=0),
        rollout=SingleTurnRollout(reward_pool, decode),
        sampling=SamplingSettings(num_generations=G, max_completion_length=G, temperature=1.0),
        reward_names=reward_pool.names,
        reward_weights=reward_pool.weights,
        scale_rewards="group",
        groups_per_step=groups_per_step,
        max_staleness=max_staleness,
        vllm_sync_interval=vllm_sync_interval,
        max_inflight_groups=max_inflight,
        queue=RolloutQueue(maxsize=queue_size, max_staleness=max_staleness, drops=drops),
        version=version,
        drops=drops,
        **kwargs,
    )


def stop_and_check(orch: Orchestrator, client: FakeClient) -> None:
    orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert not orch.alive, "orchestrator thread still running after stop()"
    assert orch.error is None
    assert client.closed


@pytest.mark.integration
def test_run_fills_queue_with_scored_versioned_batches(pool, started):
    version = PolicyVersion(5)
    client = ScriptedClient(version)
    orch = make_orchestrator(client, pool, ["ok"] * 3, version=version)
    started.append(orch)
    orch.start()
    batches = [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(3)]
    stop_and_check(orch, client)

    versions = []
    for batch in batches:
        assert len(batch.groups) == 2
        for grp in batch.groups:
            assert grp.size == G
            # stamped with the version current when the request was sent (the client bumped it right after)
            assert {ids[0] - MARKER for ids in grp.completion_ids} == {grp.policy_version}
            versions.append(grp.policy_version)
            assert grp.prompt_ids in ([10, 20], [11, 21], [12, 22])
            assert grp.columns == {"answer": "ok"}
            assert grp.completions == [decode(ids) for ids in grp.completion_ids]
            assert grp.truncated == [False, False, False, True]
            assert grp.sampling_logprobs == [[-0.5] * (i + 1) for i in range(G)]
            assert grp.rewards_per_func == [[float(i + 1), 1.0] for i in range(G)]
            assert grp.rewards == pytest.approx([i + 2.0 for i in range(G)])
            assert grp.advantages == pytest.approx(expected_advantages([i + 2.0 for i in range(G)]), abs=1e-6)
        assert batch.metrics["reward"] == pytest.approx(3.5)
        assert batch.metrics["rewards/length_reward/mean"] == pytest.approx(2.5)
        assert batch.metrics["rewards/constant_reward/mean"] == pytest.approx(1.0)
        assert batch.metrics["completions/clipped_ratio"] == pytest.approx(0.25)
        assert batch.metrics["generation/tokens_per_s"] >= 0
    assert len(set(versions)) == len(versions) and min(versions) >= 5
    assert sum(b.metrics["generation/tokens_per_s"] for b in batches) > 0  # a rate since the previous batch
    assert all(c["n"] == G for c in client.calls)
    assert set(orch.drops.snapshot()) <= {"shutdown"}  # nothing failed; only in-flight work at stop


@pytest.mark.integration
def test_hanging_reward_groups_dropped_and_counted(child_pids, started):
    before = child_pids()
    hang_pool = RewardPool([spec("length_reward")], num_workers=2, timeout_s=2)
    try:
        version = PolicyVersion()
        client = ScriptedClient(version)
        orch = make_orchestrator(client, hang_pool, ["hang", "ok", "ok", "ok"], version=version)
        started.append(orch)
        orch.start()
        got = [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(2)]
        wait_until(lambda: orch.drops.snapshot().get("reward_timeout", 0) >= 1, "a reward_timeout drop")
        stop_and_check(orch, client)
    finally:
        hang_pool.close()
    assert all(grp.columns == {"answer": "ok"} for b in got for grp in b.groups)
    assert set(orch.drops.snapshot()) <= {"reward_timeout", "shutdown"}
    wait_until(lambda: not (child_pids() - before), "the reward workers to exit", timeout_s=15)


@pytest.mark.integration
def test_raising_reward_groups_counted_as_reward_error(pool, started):
    version = PolicyVersion()
    client = ScriptedClient(version)
    orch = make_orchestrator(client, pool, ["raise", "ok"], version=version)
    started.append(orch)
    orch.start()
    got = [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(2)]
    wait_until(lambda: orch.drops.snapshot().get("reward_error", 0) >= 1, "a reward_error drop")
    stop_and_check(orch, client)
    assert all(grp.columns == {"answer": "ok"} for b in got for grp in b.groups)
    assert set(orch.drops.snapshot()) <= {"reward_error", "shutdown"}


def test_connection_errors_counted_and_stop_returns(idle_pool, started):
    client = RefusingClient()
    orch = make_orchestrator(client, idle_pool, ["ok"])
    started.append(orch)
    orch.start()
    wait_until(lambda: orch.drops.snapshot().get("generation_error", 0) >= 3, "generation_error drops")
    stop_and_check(orch, client)
    assert orch.queue.depth == 0
    assert set(orch.drops.snapshot()) <= {"generation_error", "shutdown"}


def test_unexpected_rollout_exceptions_are_counted_and_the_run_goes_on(idle_pool, started, caplog):
    client = BrokenClient()
    orch = make_orchestrator(client, idle_pool, ["ok"])
    started.append(orch)
    orch.start()
    wait_until(lambda: orch.drops.snapshot().get("rollout_error", 0) >= 3, "rollout_error drops")
    assert orch.alive and orch.error is None  # a failing group never ends the orchestrator
    stop_and_check(orch, client)
    assert set(orch.drops.snapshot()) <= {"rollout_error", "shutdown"}
    assert "KeyError('token_logprobs')" in caplog.text  # the cause is logged, not swallowed


def test_stop_returns_when_vllm_never_answers(idle_pool, started):
    client = SilentClient()
    orch = make_orchestrator(client, idle_pool, ["ok"], max_inflight=3)
    started.append(orch)
    orch.start()
    wait_until(lambda: len(client.calls) == 3, "max_inflight_groups requests")
    time.sleep(0.3)
    assert len(client.calls) == 3  # backpressure: no request beyond max_inflight_groups
    stop_and_check(orch, client)
    assert orch.queue.depth == 0


def test_inflight_groups_counted_as_shutdown_on_stop(idle_pool, started):
    client = SilentClient()
    orch = make_orchestrator(client, idle_pool, ["ok"], max_inflight=3)
    started.append(orch)
    orch.start()
    wait_until(lambda: len(client.calls) == 3, "max_inflight_groups requests")
    stop_and_check(orch, client)
    assert orch.drops.snapshot().get("shutdown", 0) == 3


class FailingOnStopClient(FakeClient):
    """vLLM answers nothing until the orchestrator stops; then every pending request fails at the transport level
    at once (as when the server goes away during shutdown), before the orchestrator gets to cancel them."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = None  # the orchestrator's stop event, set by the test

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids)})
        while not self.stop.is_set():
            await asyncio.sleep(0.002)
        raise httpx.ReadError("server gone")


def ledger_gap(orch: Orchestrator) -> int:
    """Launched groups neither enqueued nor counted as dropped (0 when the prompt ledger balances)."""
    orch.queue.drain(reason="unconsumed_at_end")  # what the runner does once the orchestrator stopped
    return orch.launched_total - sum(orch.drops.snapshot().values())


def test_requests_failing_while_the_orchestrator_stops_are_counted_as_shutdown(idle_pool, started):
    """A request that fails after stop was requested is not a generation error (and is not retried), but its group
    must still reach the ledger: `shutdown`, never silently gone (the CI flake of `test_kill_9_of_vllm...`)."""
    client = FailingOnStopClient()
    orch = make_orchestrator(client, idle_pool, ["ok"], max_inflight=3)
    client.stop = orch.stop_event
    started.append(orch)
    orch.start()
    wait_until(lambda: len(client.calls) == 3, "max_inflight_groups requests")
    stop_and_check(orch, client)
    assert ledger_gap(orch) == 0
    assert orch.launched_total == 3  # nothing launched once stop was requested
    assert orch.drops.snapshot() == {"shutdown": 3}


def test_groups_parked_for_a_lost_server_are_counted_as_shutdown_when_the_run_stops(pool, started):
    """Groups waiting for a recovery that never comes before the run ends give up on the stop event by
    themselves; each is counted once, as `shutdown`, however that races with the orchestrator's own cancel."""
    from async_grpo.inference.health import InferenceHealth

    for _ in range(3):  # the race between the parked tasks' poll and the main loop's differs run to run
        version = PolicyVersion(0)
        client = DyingClient(version, answers=2)
        health = InferenceHealth()
        orch = make_orchestrator(client, pool, ["ok"] * 8, version=version, max_inflight=2, queue_size=8)
        orch.health, orch.recovery_timeout_s = health, WAIT_S
        started.append(orch)
        orch.start()
        # one or both of the groups in flight fail, depending on whether the second was launched before the first
        # failure closed the health gate (a slow machine finishes the first answered group early); each is parked
        wait_until(
            lambda h=health, c=client: (
                h.lost and 1 <= h.parked_groups == sum(1 for call in c.calls if call.get("refused"))
            ),
            "every refused group parked",
        )
        parked = health.parked_groups
        stop_and_check(orch, client)
        drops = orch.drops.snapshot()
        assert drops.get("shutdown", 0) >= parked and set(drops) <= {"shutdown", "unconsumed_at_end"}, drops
        assert ledger_gap(orch) == 0


@pytest.mark.integration
def test_every_requested_group_is_enqueued_or_counted_after_stop(pool, started):
    version = PolicyVersion()
    client = ScriptedClient(version, answer_first_only=True)  # first group scored, then vLLM goes silent
    orch = make_orchestrator(client, pool, ["ok"], version=version, groups_per_step=2, max_inflight=1)
    started.append(orch)
    orch.start()
    # with one slot, the second request is sent only after the first group was scored and batched
    wait_until(lambda: len(client.calls) == 2, "the second request")
    stop_and_check(orch, client)
    enqueued = sum(len(orch.queue.get(0, 1.0).groups) for _ in range(orch.queue.depth))
    assert enqueued + sum(orch.drops.snapshot().values()) == len(client.calls)


@pytest.mark.integration
def test_launches_wait_for_the_policy_version(pool, started):
    """max_staleness=0, one version per batch of 2 groups: the orchestrator runs at most one batch ahead."""
    version = PolicyVersion()
    client = ScriptedClient(version, bump=False)
    orch = make_orchestrator(
        client,
        pool,
        ["ok"],
        version=version,
        groups_per_step=2,
        max_inflight=8,
        queue_size=8,
        max_staleness=0,
        vllm_sync_interval=1,
    )
    started.append(orch)
    orch.start()
    wait_until(lambda: len(client.calls) == 2, "the first batch's requests")
    time.sleep(0.5)
    assert len(client.calls) == 2  # the third group needs version 1
    version.bump()
    wait_until(lambda: len(client.calls) == 4, "the second batch's requests")
    time.sleep(0.5)
    assert len(client.calls) == 4
    assert [c["version"] for c in client.calls] == [0, 0, 1, 1]
    stop_and_check(orch, client)


@pytest.mark.integration
def test_dropped_groups_do_not_stall_version_pacing(pool, started):
    version = PolicyVersion()
    client = ScriptedClient(version, bump=False)
    orch = make_orchestrator(
        client,
        pool,
        ["raise", "ok"],
        version=version,
        groups_per_step=2,
        max_inflight=4,
        max_staleness=0,
        vllm_sync_interval=1,
    )
    started.append(orch)
    orch.start()
    for _ in range(2):  # the trainer: one step per batch, one policy version per step
        orch.queue.get(current_version=version.value, timeout_s=PACED_GET_TIMEOUT_S)
        version.bump()
    assert orch.drops.snapshot().get("reward_error", 0) >= 2


def test_client_factory_failure_is_surfaced(idle_pool):
    def broken_factory():
        raise RuntimeError("cannot reach vLLM")

    orch = make_orchestrator(FakeClient(), idle_pool, ["ok"])
    orch.client_factory = broken_factory
    orch.start()
    wait_until(lambda: not orch.alive, "the orchestrator thread to exit")
    assert isinstance(orch.error, RuntimeError) and "cannot reach vLLM" in str(orch.error)
    assert orch.stop_event.is_set()


class SlowFirstClient(FakeClient):
    """Answers at once, except the prompts in `slow` (first prompt id), which take `slow_s`: their groups finish
    many policy versions later and land, stale, in a batch of their own."""

    def __init__(self, slow: set[int], slow_s: float = 0.8) -> None:
        super().__init__()
        self.slow, self.slow_s = slow, slow_s

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.calls.append({"prompt_ids": list(prompt_ids)})
        await asyncio.sleep(self.slow_s if prompt_ids[0] in self.slow else 0.01)
        return [Completion([97 + j], [-0.5], decode([97 + j]), "stop") for j in range(n)]


@pytest.mark.integration
def test_a_step_batch_dropped_as_stale_does_not_shrink_the_async_window(pool, started):
    """Regression (shared/repros/stale_batch_window.py): a batch emptied by stale drops is skipped by the queue;
    pacing must not count it as a trained step, or the orchestrator stays one batch further behind for good
    (after max_staleness such skips the pipeline is lock-step)."""
    version = PolicyVersion()
    client = SlowFirstClient(slow={10, 13})  # prompt ids 10 + i: the first and fourth prompts are slow
    orch = make_orchestrator(
        client,
        pool,
        ["ok"] * 6,
        version=version,
        groups_per_step=1,
        max_inflight=8,
        queue_size=16,
        max_staleness=2,
        vllm_sync_interval=1,
    )
    started.append(orch)
    orch.start()
    for _ in range(30):  # the trainer: one step per batch, one policy version per step
        orch.queue.get(current_version=version.value, timeout_s=PACED_GET_TIMEOUT_S)
        time.sleep(0.02)
        version.bump()
    assert orch.drops.snapshot().get("stale", 0) >= 2 and orch.queue.skipped_steps >= 2
    time.sleep(1.5)  # the trainer pauses: the orchestrator fills its whole window
    # groups for the steps at versions v .. v + max_staleness are ready: 3 batches ahead, whatever was skipped
    assert orch.queue.depth == 3
    stop_and_check(orch, client)


class DyingClient(ScriptedClient):
    """vLLM dies after `answers` requests (connection refused) until `revive()` is called: a restart."""

    def __init__(self, version: PolicyVersion, answers: int) -> None:
        super().__init__(version, bump=False)
        self.answers, self.down = answers, False

    def revive(self) -> None:
        self.down = False

    async def generate(self, prompt_ids, **kwargs):
        if len(self.calls) >= self.answers and not self.down and not getattr(self, "revived", False):
            self.down, self.revived = True, True
        if self.down:
            self.calls.append({"prompt_ids": list(prompt_ids), "refused": True})
            await asyncio.sleep(0.01)
            raise httpx.ConnectError("connection refused")
        return await super().generate(prompt_ids, **kwargs)


def test_groups_whose_server_died_are_parked_and_generated_again_after_recovery(pool, started):
    """A lost server closes the health gate: nothing new is launched, the failed groups wait, and once the runner
    restores the server they are generated again: no drop, every group reaches the queue."""
    from async_grpo.inference.health import InferenceHealth, InferenceLost

    version = PolicyVersion(0)
    client = DyingClient(version, answers=2)
    health = InferenceHealth()
    orch = make_orchestrator(client, pool, ["ok"] * 8, version=version, groups_per_step=2, max_inflight=2, queue_size=8)
    orch.health, orch.recovery_timeout_s = health, WAIT_S
    started.append(orch)
    orch.start()
    wait_until(lambda: health.lost, "the server to be marked lost")
    with pytest.raises(InferenceLost, match="connection refused"):
        health.check()
    time.sleep(0.5)
    refused = sum(1 for c in client.calls if c.get("refused"))
    assert refused <= 2  # only the groups in flight failed; nothing new was launched while lost
    client.revive()
    health.restored()  # what runner.recovery does after restarting vLLM and pushing the weights
    batches = [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(3)]
    stop_and_check(orch, client)
    assert sum(len(b.groups) for b in batches) == 6
    assert health.parked_groups == refused and health.restarts == 1
    drops = orch.drops.snapshot()
    assert not {k: v for k, v in drops.items() if k != "shutdown"}, drops  # nothing dropped for the outage


def test_a_scorer_that_fails_every_group_for_reward_failure_timeout_s_stops_the_orchestrator(pool, started):
    """Single failures are dropped and counted; when every group fails for reward_failure_timeout_s (a dead reward
    service), the orchestrator stops with a RewardServiceError that the trainer's next wait raises."""
    from async_grpo.orchestrator.failures import RewardFailureWatch, RewardServiceError
    from async_grpo.orchestrator.producer import ProducerConfig, VLLMProducer

    watch = RewardFailureWatch(timeout_s=10.0)
    assert watch.failed(RewardError("a")) is None
    watch.scored()  # a success ends the streak
    assert watch.failed(RewardError("b")) is None and watch.in_row == 1
    version = PolicyVersion()
    client = ScriptedClient(version, bump=False)
    orch = make_orchestrator(client, pool, ["raise"], version=version)  # length_reward raises on "raise"
    orch.reward_watch = RewardFailureWatch(timeout_s=0.5)
    started.append(orch)
    t0 = time.monotonic()
    orch.start()
    wait_until(lambda: orch.error is not None, "the orchestrator to give up on the scorer")
    assert isinstance(orch.error, RewardServiceError) and time.monotonic() - t0 < WAIT_S
    assert "reward_failure_timeout_s=0.5" in str(orch.error) and "Fix" in str(orch.error)
    assert orch.drops.snapshot()["reward_error"] >= 2
    producer = VLLMProducer(orch, orch.queue, version, ProducerConfig())
    with pytest.raises(RewardServiceError, match="every group failed to score"):
        producer.produce(None, 0, timeout_s=5)


# ------------------------------------------------------------------ full_determinism
class TimedClient(ScriptedClient):
    """Answers like ScriptedClient (no version bump), after a delay that depends on the request's number:
    `pattern` "even" makes every other request slow, so groups finish out of launch order. Records seeds."""

    def __init__(self, version: PolicyVersion, pattern: str) -> None:
        super().__init__(version, bump=False)
        self.pattern = pattern
        self.seeds: list[int | None] = []  # in request order (= launch order: tasks start in the order created)

    async def generate(self, prompt_ids, *, seed=None, **kwargs):
        number = len(self.seeds)
        self.seeds.append(seed)
        await asyncio.sleep(0.04 if self.pattern == "even" and number % 2 == 0 else 0.002)
        return await super().generate(prompt_ids, seed=seed, **kwargs)


def train_on_schedule(orch: Orchestrator, version: PolicyVersion, steps: int) -> list[list[tuple]]:
    """What the runner does under full_determinism, without a model: take each step batch, then wait for the
    scheduled groups before pushing the next version. Returns, per step, (prompt ids, policy version) per group."""
    trained = []
    for _ in range(steps):
        batch = orch.queue.get(current_version=version.value, timeout_s=WAIT_S)
        trained.append([(tuple(g.prompt_ids), g.policy_version) for g in batch.groups])
        if orch.full_determinism:
            orch.wait_generated(version.value, WAIT_S)
        version.bump()
    return trained


def scheduled_run(pool, started, pattern: str, full_determinism: bool) -> tuple[list[list[tuple]], Orchestrator]:
    version = PolicyVersion(0)
    client = TimedClient(version, pattern)
    orch = make_orchestrator(
        client, pool, ["ok"] * 16, version=version, groups_per_step=2, max_inflight=6, queue_size=2,
        max_staleness=2, full_determinism=full_determinism, seed=3,
    )  # fmt: skip
    started.append(orch)
    orch.start()
    trained = train_on_schedule(orch, version, steps=8)
    stop_and_check(orch, client)
    return trained, orch


def test_full_determinism_fixes_batches_versions_and_seeds_whatever_the_timing(pool, started):
    """Groups finishing out of launch order (every other request slow) and in order give the same step batches:
    the same prompts in the same order, each sampled at the version the schedule gives its launch index, with
    the seed of its launch index; the trainer never pushes a version a scheduled group could still see."""
    in_order, orch = scheduled_run(pool, started, "flat", full_determinism=True)
    out_of_order, _ = scheduled_run(pool, started, "even", full_determinism=True)
    assert in_order == out_of_order
    flat = [group for step in in_order for group in step]
    assert [v for _, v in flat] == [orch.scheduled_version(i) for i in range(len(flat))]  # exactly, not at least
    assert max(v for _, v in flat) >= 4  # the window moved with the trainer
    client = orch.client_factory()
    seeds = client.seeds
    assert seeds == [orch.group_seed(i) for i in range(len(seeds))]
    assert len(set(seeds)) == len(seeds) and all(b - a == G for a, b in zip(seeds, seeds[1:], strict=False))


def test_without_full_determinism_the_same_timings_give_other_batches(pool, started):
    """The control: the same two timings without full_determinism batch groups as they finish (the test above
    could fail)."""
    in_order, _ = scheduled_run(pool, started, "flat", full_determinism=False)
    out_of_order, _ = scheduled_run(pool, started, "even", full_determinism=False)
    assert in_order != out_of_order


def test_full_determinism_refuses_launches_that_depend_on_earlier_outcomes(idle_pool):
    with pytest.raises(ValueError, match="full_determinism with dynamic_sampling"):
        make_orchestrator(FakeClient(), idle_pool, ["ok"], dynamic_sampling=True, full_determinism=True)


def test_a_full_determinism_schedule_resumed_from_its_snapshot_continues_exactly(pool, started):
    """Snapshot the schedule between steps (as a checkpoint does, at the policy version just pushed), stop, start a
    new orchestrator from the snapshot with the trainer's version, and train on: the batches equal an uninterrupted
    run's, with slow and fast requests interleaved (eight in flight, two versions of staleness). The snapshot goes
    through torch.save / torch.load(weights_only=True), as in a checkpoint."""
    import io

    import torch

    whole, _ = scheduled_run(pool, started, "even", full_determinism=True)

    version = PolicyVersion(0)
    client = TimedClient(version, "even")
    kwargs = dict(groups_per_step=2, max_inflight=6, queue_size=2, max_staleness=2, full_determinism=True, seed=3)
    orch = make_orchestrator(client, pool, ["ok"] * 16, version=version, **kwargs)
    started.append(orch)
    orch.start()
    first = []
    for _ in range(3):
        batch = orch.queue.get(current_version=version.value, timeout_s=WAIT_S)
        first.append([(tuple(g.prompt_ids), g.policy_version) for g in batch.groups])
        orch.mark_trained(batch.groups)
        orch.wait_generated(version.value, WAIT_S)
        version.bump()
    buffer = io.BytesIO()
    torch.save(dataclasses.asdict(orch.state_dict(version.value, 30.0)), buffer)  # as TrainState keeps it
    stop_and_check(orch, client)
    state = ProducerState(**torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert state.schedule["groups"], "groups sampled at older versions are kept"

    version = PolicyVersion(version.value)  # the resumed trainer serves the checkpoint's weights at its version
    client = TimedClient(version, "flat")  # other timings after the resume
    resumed = make_orchestrator(client, pool, ["ok"] * 16, version=version, **kwargs)
    resumed.load_state_dict(state, generation_rounds=3, launched_before=0)
    started.append(resumed)
    resumed.start()
    rest = train_on_schedule(resumed, version, steps=5)
    stop_and_check(resumed, client)
    assert first + rest == whole


def test_the_scheduled_version_never_decreases_across_the_on_policy_warm_up(idle_pool):
    """required_version drops where the on-policy warm-up rollouts end (its slack starts); launches are in index
    order, so the schedule holds the version the warm-up reached until the pacing passes it."""
    orch = make_orchestrator(
        FakeClient(), idle_pool, ["ok"], groups_per_step=2, max_staleness=2, sync_warmup_rollouts=3,
        full_determinism=True,
    )  # fmt: skip
    required = [orch.required_version(i) for i in range(40)]
    scheduled = [orch.scheduled_version(i) for i in range(40)]
    assert required[5] == 2 and required[6] == 1  # the warm-up's last batch, then the first with slack
    assert scheduled[:6] == [0, 0, 1, 1, 2, 2] and scheduled[6:10] == [2, 2, 2, 2]
    assert scheduled == sorted(scheduled) and all(s >= max(r, 0) for s, r in zip(scheduled, required, strict=True))
    assert [orch.scheduled_before(v) for v in range(4)] == [2, 4, 10, 12]
