"""The step's reward-side seconds (issue 53): each function's mean seconds per group, and all of them together."""

from __future__ import annotations

import pytest

from async_grpo.orchestrator.batching import make_train_batch, reward_time_metrics
from async_grpo.transports.messages import RolloutGroup


def group(seconds: dict[str, float], rewards: list[list[float]]) -> RolloutGroup:
    g = len(rewards)
    return RolloutGroup(
        prompt_ids=[1], completion_ids=[[2]] * g, sampling_logprobs=[[-0.1]] * g, truncated=[False] * g,
        completions=["a"] * g, prompt="p", columns={}, policy_version=0, rewards_per_func=rewards,
        reward_seconds=seconds,
    )  # fmt: skip


def test_reward_seconds_are_averaged_over_the_groups_their_scorer_timed():
    groups = [
        group({"accuracy": 0.5, "format": 0.25}, [[1.0, 0.0], [0.0, 1.0]]),
        group({"accuracy": 1.5, "format": 0.75}, [[1.0, 1.0], [0.0, 0.0]]),
        group({}, [[0.0, 0.0], [1.0, 1.0]]),  # a scorer that did not time it: left out, not counted as 0
    ]
    metrics = reward_time_metrics(groups)
    assert metrics == {"rewards/seconds": pytest.approx(1.5), "rewards/accuracy/seconds": pytest.approx(1.0),
                       "rewards/format/seconds": pytest.approx(0.5)}  # fmt: skip
    assert reward_time_metrics([group({}, [[1.0]])]) == {}
    batch = make_train_batch(groups, ["accuracy", "format"], [1.0, 1.0], "group")
    assert batch.metrics["rewards/accuracy/seconds"] == pytest.approx(1.0)
