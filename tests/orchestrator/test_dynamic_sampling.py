"""Dynamic sampling: zero-std groups are dropped and counted; a batch that cannot be filled fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.orchestrator.batch_shaping import weighted_reward_std
from async_grpo.orchestrator.orchestrator import DynamicSamplingError, Orchestrator
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.rewards.pool import RewardPool
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

from .test_orchestrator import STOP_TIMEOUT_S, WAIT_S, G, ScriptedClient, decode, wait_until

FNS = Path(__file__).with_name("ds_reward_fns.py")


def test_weighted_reward_std():
    assert weighted_reward_std([[1.0, 0.0], [1.0, 0.0]], [1.0, 1.0]) == 0.0
    assert weighted_reward_std([[1.0, 0.0], [0.0, 0.0]], [1.0, 1.0]) == pytest.approx(0.5**0.5)
    assert weighted_reward_std([[1.0, float("nan")], [1.0, 0.0]], [1.0, 2.0]) == 0.0  # NaN counts as 0


def test_an_unscorable_row_does_not_make_a_group_informative():
    """Regression (shared/repros/dynsamp_unscorable.py): [1, 1, 1, None] has all-zero advantages, so dynamic
    sampling must drop it; counting the None row as reward 0 gave it std 0.5 and let it through."""
    import math

    import torch

    from async_grpo.algorithms import compute_advantages
    from async_grpo.orchestrator.batch_shaping import is_zero_std

    rows = [[1.0], [1.0], [1.0], [math.nan]]
    assert compute_advantages(torch.tensor(rows), torch.ones(1), 4).advantages.tolist() == [0.0] * 4
    assert weighted_reward_std(rows, [1.0]) == 0.0 and is_zero_std(weighted_reward_std(rows, [1.0]))
    assert weighted_reward_std([[1.0], [0.0], [math.nan]], [1.0]) == pytest.approx(0.5**0.5)  # 2 scored rows


@pytest.fixture(scope="module")
def pool():
    with RewardPool([f"{FNS}:flat_or_length"], num_workers=1, timeout_s=20) as p:
        yield p


def run(pool, answers, max_gen_batches):
    version, drops = PolicyVersion(), DropCounter()
    queue = RolloutQueue(maxsize=4, max_staleness=10**6, drops=drops)
    prompts = [PromptItem(f"p{i}", [10 + i], {"answer": a}) for i, a in enumerate(answers)]
    orch = Orchestrator(
        client_factory=lambda: ScriptedClient(version, bump=False), prompts=PromptSampler(prompts, seed=0),
        rollout=SingleTurnRollout(pool, decode), sampling=SamplingSettings(G, G, 1.0), reward_names=pool.names,
        reward_weights=pool.weights, scale_rewards="group", dynamic_sampling=True, max_gen_batches=max_gen_batches,
        groups_per_step=2, max_staleness=10**6, vllm_sync_interval=1, max_inflight_groups=1, queue=queue,
        version=version, drops=drops,
    )  # fmt: skip
    return orch, queue, drops


@pytest.mark.integration
def test_zero_std_groups_are_dropped_and_counted(pool):
    orch, queue, drops = run(pool, ["flat", "x", "flat", "y"], max_gen_batches=10)
    orch.start()
    try:
        batch = queue.get(current_version=0, timeout_s=WAIT_S)
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert all(g.columns["answer"] != "flat" for g in batch.groups)  # only groups with signal
    assert batch.metrics["frac_reward_zero_std"] == 0.0
    assert batch.metrics["dynamic_sampling/gen_batches"] >= 2.0  # needed more than one batch of groups
    assert drops.snapshot()["zero_std"] >= 2


@pytest.mark.integration
def test_unfillable_batch_raises_clear_error(pool):
    orch, queue, drops = run(pool, ["flat"], max_gen_batches=3)
    orch.start()
    try:
        wait_until(lambda: orch.error is not None, "the dynamic-sampling error")
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert isinstance(orch.error, DynamicSamplingError)
    assert "only 0 of 2 groups" in str(orch.error) and "max_gen_batches=3" in str(orch.error)
    assert drops.snapshot()["zero_std"] == 6
