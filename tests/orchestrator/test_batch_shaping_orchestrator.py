"""Replay and deferred re-roll wired into a running orchestrator (fake vLLM client, real reward workers)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.orchestrator.batch_shaping import ReplayBuffer, RerollQueue
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.rewards.pool import RewardPool
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

from .test_orchestrator import STOP_TIMEOUT_S, WAIT_S, G, ScriptedClient, decode

pytestmark = pytest.mark.integration

FNS = Path(__file__).with_name("ds_reward_fns.py")


@pytest.fixture(scope="module")
def pool():
    with RewardPool([f"{FNS}:zero_or_length"], num_workers=1, timeout_s=20) as p:
        yield p


def make(pool, answers, *, version, groups_per_step, vllm_sync_interval=1, replay=None, reroll=None) -> Orchestrator:
    drops = DropCounter()
    prompts = [PromptItem(a, [10 + i], {"answer": a}) for i, a in enumerate(answers)]
    return Orchestrator(
        client_factory=lambda: ScriptedClient(version, bump=False), prompts=PromptSampler(prompts, seed=0),
        rollout=SingleTurnRollout(pool, decode), sampling=SamplingSettings(G, G, 1.0), reward_names=pool.names,
        reward_weights=pool.weights, scale_rewards="group", groups_per_step=groups_per_step, max_staleness=10**6,
        vllm_sync_interval=vllm_sync_interval, max_inflight_groups=1,
        queue=RolloutQueue(maxsize=64, max_staleness=10**6, drops=drops), version=version, drops=drops,
        replay=replay, reroll=reroll,
    )  # fmt: skip


def collect(orch: Orchestrator, n: int, version: PolicyVersion) -> list:
    orch.start()
    try:
        return [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(n)]
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
        assert orch.error is None


def test_zero_prompts_are_rerolled_first_and_counted(pool):
    """One group per batch, one launch at a time: every fresh all-zero group is followed by its re-roll."""
    version = PolicyVersion()
    reroll = RerollQueue(start_step=0, max_per_batch=1)
    batches = collect(make(pool, ["zero", "x", "y"], version=version, groups_per_step=1, reroll=reroll), 9, version)
    seq = [(b.groups[0].columns["answer"], b.groups[0].rerolled) for b in batches]
    assert ("zero", True) in seq
    for (answer, rerolled), nxt in zip(seq, seq[1:], strict=False):
        if answer == "zero" and not rerolled:
            assert nxt == ("zero", True), seq  # the re-roll takes precedence over the next fresh prompt
        if rerolled:
            assert answer == "zero" and nxt != ("zero", True), seq  # re-rolled at most once, no loop
    running = 0
    for b in batches:
        running += b.groups[0].rerolled
        assert b.metrics["rerolled_groups"] == running  # cumulative


def test_rerolls_wait_for_the_start_step(pool):
    """start_step 2 with 2 steps per version: nothing is re-rolled until the policy version reaches 1."""
    version = PolicyVersion()
    reroll = RerollQueue(start_step=2, max_per_batch=1)
    orch = make(pool, ["zero", "x"], version=version, groups_per_step=1, vllm_sync_interval=2, reroll=reroll)
    orch.start()
    try:
        early = [orch.queue.get(current_version=0, timeout_s=WAIT_S) for _ in range(6)]
        assert not any(g.rerolled for b in early for g in b.groups)
        assert len(reroll) >= 1  # waiting prompts
        version.bump()  # trainer step 2
        late = [orch.queue.get(current_version=1, timeout_s=WAIT_S) for _ in range(12)]
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert orch.error is None
    assert any(g.rerolled for b in late for g in b.groups)


def test_zero_std_groups_are_replaced_by_replayed_ones(pool):
    version = PolicyVersion()
    replay = ReplayBuffer(4, random.Random(0))
    batches = collect(make(pool, ["zero", "x"], version=version, groups_per_step=2, replay=replay), 8, version)
    seen_signal = False
    replayed = 0
    for b in batches:
        for grp in b.groups:
            if seen_signal:  # once the buffer holds a group, no zero-std group reaches the trainer
                assert grp.reward_std > 0, [g.columns for g in b.groups]
            if grp.replayed:
                assert grp.columns["answer"] == "x"
                replayed += 1
        seen_signal = seen_signal or any(g.reward_std > 0 and not g.replayed for g in b.groups)
        assert b.metrics["replayed_groups"] == replayed  # cumulative
        if seen_signal:
            assert 1 <= b.metrics["replay_buffer/size"] <= 4
    assert replayed >= 1
    assert any(b.metrics["frac_reward_zero_std"] > 0 and any(g.replayed for g in b.groups) for b in batches)
