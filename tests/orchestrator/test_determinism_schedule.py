"""`ScheduleState` under full_determinism: a checkpoint between steps keeps the groups sampled at older policy
versions, and waits for the ones still being scored instead of failing (issue 48: `save_steps` crashed when a
group had finished generating but not yet been scored)."""

from __future__ import annotations

import itertools

import pytest

from async_grpo.data import PromptItem
from async_grpo.orchestrator.determinism import ScheduleState
from async_grpo.transports.messages import RolloutGroup


def prompts():
    for i in itertools.count():
        yield PromptItem(prompt=f"p{i}", prompt_ids=[i], columns={})


def group(index: int) -> RolloutGroup:
    return RolloutGroup(
        prompt_ids=[index], completion_ids=[[1]], sampling_logprobs=[[-0.5]], truncated=[False], completions=["a"],
        prompt=f"p{index}", columns={}, policy_version=0, rewards=[1.0],
    )  # fmt: skip


def test_a_generated_but_unscored_group_is_unsettled_until_it_settles():
    state, sampler = ScheduleState(), prompts()
    for _ in range(3):
        state.draw(sampler)
    state.settle(0, group(0))
    state.mark_generated(1)  # generated (the push's gate passed it), its rewards still running
    state.mark_generated(2)
    assert state.generated_through == 3
    assert state.unsettled_before(3) == [1, 2]
    with pytest.raises(RuntimeError, match="launch index 1 .* has not settled"):
        state.snapshot(3, dict)
    state.settle(1, group(1))
    state.settle(2, None)  # dropped: settled as a gap
    assert state.unsettled_before(3) == []
    snap = state.snapshot(3, dict)
    assert sorted(snap["groups"]) == [0, 1, 2] and snap["groups"][2] is None


def test_trained_groups_are_not_waited_for():
    state, sampler = ScheduleState(), prompts()
    for _ in range(2):
        state.draw(sampler)
    released = state.settle(0, group(0))
    state.mark_trained(released)
    state.mark_generated(1)
    assert state.unsettled_before(2) == [1]
    assert state.unsettled_before(1) == []
