"""Batch shaping state (replay buffer, deferred re-roll FIFO): hand-computed cases, no threads, no vLLM."""

from __future__ import annotations

import math
import random

import pytest

from async_grpo.orchestrator.batch_shaping import (
    ReplayBuffer,
    RerollQueue,
    all_rewards_near_zero,
    is_zero_std,
    replay_score,
    weighted_rewards,
)
from async_grpo.transports.messages import RolloutGroup

NAN = float("nan")


class FixedRandom:
    """Stands in for random.Random: `random()` returns the given values in order."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)

    def getstate(self) -> list[float]:
        return list(self.values)


def group(rewards, advantages, tag="g", version=0) -> RolloutGroup:
    """A scored group with the given weighted rewards and advantages (one token per completion)."""
    g = len(rewards)
    return RolloutGroup(
        prompt_ids=[1], completion_ids=[[2]] * g, sampling_logprobs=[[-0.5]] * g, truncated=[False] * g,
        completions=["x"] * g, prompt=tag, columns={}, policy_version=version,
        rewards_per_func=[[r] for r in rewards], rewards=list(rewards), advantages=list(advantages),
    )  # fmt: skip


def scored(score: float, tag: str) -> RolloutGroup:
    """A group with replay score `score`: rewards [1, 0] have std sqrt(0.5); advantages +-a give 2a sqrt(0.5)."""
    a = score / (2 * math.sqrt(0.5))
    return group([1.0, 0.0], [a, -a], tag=tag)


def flat(tag: str = "flat") -> RolloutGroup:
    return group([0.0, 0.0], [0.0, 0.0], tag=tag)


# ------------------------------------------------------------------ reward statistics
def scores(buf: ReplayBuffer) -> list[float]:
    """The scores a buffer holds, ascending (read through its checkpoint state)."""
    return sorted(entry[0] for entry in buf.state_dict()["heap"])


def test_weighted_rewards_and_near_zero():
    out = weighted_rewards([[1.0, 0.5], [NAN, 2.0], [NAN, NAN]], [1.0, 2.0])
    assert out[:2] == [2.0, 4.0] and math.isnan(out[2])  # NaN counts as 0 in a row; an all-None row is unscored
    assert not all_rewards_near_zero([[NAN, NAN], [NAN, NAN]], [1.0, 1.0])  # never scored: nothing to re-roll
    assert all_rewards_near_zero([[0.0, 1e-6], [-1e-6, NAN]], [1.0, 1.0])  # |r| <= 1e-6 is ~0
    assert not all_rewards_near_zero([[0.0, 2e-6], [0.0, 0.0]], [1.0, 1.0])
    assert all_rewards_near_zero([[1.0, 0.0], [0.0, 0.0]], [0.0, 1.0])  # weight 0 hides f1's reward


def test_is_zero_std():
    assert is_zero_std(0.0) and is_zero_std(1e-9)
    assert not is_zero_std(1e-6)
    # three tied 0.1 rewards: float rounding gives a std of ~1.7e-17, still zero
    assert is_zero_std(group([0.1, 0.1, 0.1], [0.0] * 3).reward_std)


def test_replay_score_is_sum_abs_advantage_times_std():
    # rewards [1, 0, 0, 0]: mean 0.25, Bessel std sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5
    grp = group([1.0, 0.0, 0.0, 0.0], [1.5, -0.5, -0.5, -0.5])
    assert grp.reward_std == pytest.approx(0.5)
    assert replay_score(grp) == pytest.approx((1.5 + 3 * 0.5) * 0.5)
    assert replay_score(scored(2.5, "s")) == pytest.approx(2.5)


# ------------------------------------------------------------------ replay buffer: heap
def test_heap_keeps_the_highest_scores_and_refuses_the_rest():
    buf = ReplayBuffer(2, random.Random(0))
    assert buf.add(scored(1.0, "a")) and buf.add(scored(3.0, "b"))
    assert scores(buf)[0] == pytest.approx(1.0)  # the next to be evicted
    assert buf.add(scored(2.0, "c"))  # full: beats the minimum 1.0, which is evicted
    assert scores(buf) == pytest.approx([2.0, 3.0])
    assert not buf.add(scored(1.5, "d"))  # below the minimum of a full buffer
    assert not buf.add(scored(2.0, "e"))  # a tie with the minimum does not evict it
    assert not buf.add(flat())  # std 0
    replayed = scored(9.0, "r")
    replayed.replayed = True
    assert not buf.add(replayed)  # a replayed copy never re-enters
    assert len(buf) == 2 and scores(buf) == pytest.approx([2.0, 3.0])
    with pytest.raises(ValueError, match="replay_buffer_size=0"):
        ReplayBuffer(0, random.Random(0))


# ------------------------------------------------------------------ replay buffer: proportional draws
def filled(*scores: float, rng) -> ReplayBuffer:
    buf = ReplayBuffer(len(scores), rng)
    for i, s in enumerate(scores):
        buf.add(scored(s, f"s{s}-{i}"))
    return buf


def test_sample_inverts_the_cdf_in_ascending_score_order():
    # scores (1, 3), total 4: u x 4 < 1 picks the score-1 group, otherwise the score-3 group
    buf = filled(3.0, 1.0, rng=FixedRandom(0.2, 0.3, 0.9, 0.0))
    picks = [buf.sample(1)[0].prompt for _ in range(2)]
    assert picks == ["s1.0-1", "s3.0-0"]  # 0.8 < 1 -> first; 1.2 >= 1 -> second
    # without replacement: u = 0.9 takes the score-3 group, then only the score-1 group is left
    both = buf.sample(2)
    assert [g.prompt for g in both] == ["s3.0-0", "s1.0-1"]
    assert all(g.replayed for g in both)
    assert buf.sample(0) == []
    assert len(buf) == 2  # sampling does not remove anything


def test_sample_with_replacement_when_asking_for_more_than_held():
    buf = filled(1.0, 3.0, rng=FixedRandom(0.1, 0.1, 0.9))
    assert [g.prompt for g in buf.sample(3)] == ["s1.0-0", "s1.0-0", "s3.0-1"]


def test_sample_frequencies_follow_scores_with_a_seeded_rng():
    buf = filled(1.0, 3.0, rng=random.Random(1234))
    n = 20_000
    high = sum(buf.sample(1)[0].prompt == "s3.0-1" for _ in range(n))
    assert high / n == pytest.approx(0.75, abs=0.015)
    again = filled(1.0, 3.0, rng=random.Random(1234))
    first = filled(1.0, 3.0, rng=random.Random(1234))
    assert [again.sample(1)[0].prompt for _ in range(50)] == [first.sample(1)[0].prompt for _ in range(50)]


def test_sampled_copies_leave_the_buffered_originals_untouched():
    original = scored(2.0, "o")
    buf = ReplayBuffer(1, FixedRandom(0.5))
    buf.add(original)
    copy = buf.sample(1)[0]
    assert copy is not original and copy.replayed and not original.replayed
    assert copy.advantages == original.advantages and copy.policy_version == original.policy_version


# ------------------------------------------------------------------ replay buffer: filling a batch
def test_fill_replaces_zero_std_groups_from_earlier_batches_only():
    buf = ReplayBuffer(4, FixedRandom(0.5, 0.5))
    old = scored(4.0, "old")
    old.policy_version = 0
    buf.add(old)
    fresh = scored(1.5, "fresh")
    out = buf.fill([fresh, flat("z1"), flat("z2")])
    assert out[0] is fresh
    assert [g.prompt for g in out[1:]] == ["old", "old"]  # 2 draws from a 1-group buffer: with replacement
    assert all(g.replayed and g.policy_version == 0 for g in out[1:])
    assert buf.replayed_total == 2
    assert scores(buf) == pytest.approx([1.5, 4.0])  # the fresh group entered after the draw, the flat ones never


def test_fill_with_an_empty_buffer_keeps_the_batch():
    buf = ReplayBuffer(4, FixedRandom())
    batch = [flat("z"), scored(1.0, "s")]
    out = buf.fill(batch)
    assert out == batch and buf.replayed_total == 0
    assert len(buf) == 1  # ...but fills the buffer for later batches


def test_fill_counts_cumulatively_and_never_replaces_replayed_groups():
    buf = ReplayBuffer(4, random.Random(0))
    buf.fill([scored(1.0, "a")])
    first = buf.fill([flat("z1"), flat("z2")])
    assert [g.prompt for g in first] == ["a", "a"] and buf.replayed_total == 2
    second = buf.fill([first[0], flat("z3")])  # an already replayed group stays as it is
    assert second[0] is first[0] and second[1].prompt == "a"
    assert buf.replayed_total == 3


# ------------------------------------------------------------------ deferred re-roll FIFO
ZERO = [[0.0], [0.0]]
SOME = [[0.0], [1.0]]


def test_reroll_queue_takes_only_all_zero_groups_in_fifo_order():
    q = RerollQueue(start_step=0, max_per_batch=5)
    assert q.offer("p1", ZERO, [1.0])
    assert not q.offer("p2", SOME, [1.0])  # one completion scored: not ~0
    assert q.offer("p3", [[NAN], [1e-7]], [1.0])  # None counts as 0; 1e-7 is within 1e-6
    assert len(q) == 2
    assert [q.take(0, 0), q.take(0, 0), q.take(0, 0)] == ["p1", "p3", None]


def test_reroll_queue_waits_for_the_start_step():
    q = RerollQueue(start_step=3, max_per_batch=1)
    q.offer("p", ZERO, [1.0])
    assert q.take(step=2, batch_index=0) is None
    assert len(q) == 1
    assert q.take(step=3, batch_index=0) == "p"


def test_reroll_queue_caps_rerolls_per_batch():
    q = RerollQueue(start_step=0, max_per_batch=2)
    for p in "abcde":
        q.offer(p, ZERO, [1.0])
    assert [q.take(0, 7) for _ in range(3)] == ["a", "b", None]  # batch 7: two at most
    assert [q.take(0, 8) for _ in range(3)] == ["c", "d", None]  # batch 8: two more
    assert q.take(0, 9) == "e"


def test_reroll_queue_capacity_and_counts():
    q = RerollQueue(start_step=0, max_per_batch=1, capacity=2)
    assert q.offer("a", ZERO, [1.0]) and q.offer("b", ZERO, [1.0])
    assert not q.offer("c", ZERO, [1.0])
    assert q.overflowed == 1 and len(q) == 2
    rerolled = flat()
    rerolled.rerolled = True
    assert q.count_batched([rerolled, flat(), rerolled]) == 2
    assert q.count_batched([rerolled]) == 3  # cumulative
    for bad in (dict(start_step=-1, max_per_batch=1), dict(start_step=0, max_per_batch=0)):
        with pytest.raises(ValueError):
            RerollQueue(**bad)


# ------------------------------------------------------------------ config -> batch-shaping state
def test_config_fields_validate_and_build_the_state():
    from pydantic import ValidationError

    from async_grpo.config import GRPOConfig
    from async_grpo.runner.builders import setup_batch_shaping

    off = setup_batch_shaping(GRPOConfig())
    assert off == {"replay": None, "reroll": None}  # defaults: replay_buffer_size 0, reroll_start_fraction 1.0
    config = GRPOConfig(replay_buffer_size=4, reroll_start_fraction=0.5, reroll_max_groups=2, max_steps=5)
    assert config.reroll_start_step == 3  # ceil(0.5 x 5)
    state = setup_batch_shaping(config)
    assert isinstance(state["replay"], ReplayBuffer) and state["replay"].capacity == 4
    assert isinstance(state["reroll"], RerollQueue)
    assert (state["reroll"].start_step, state["reroll"].max_per_batch) == (3, 2)
    assert GRPOConfig(reroll_start_fraction=0.0).reroll_start_step == 0
    for bad in (
        dict(reroll_start_fraction=1.5),
        dict(reroll_start_fraction=-0.1),
        dict(reroll_max_groups=0),
        dict(replay_buffer_size=-1),
        dict(top_entropy_quantile=1.1),
        dict(top_entropy_quantile=-0.5),
    ):
        with pytest.raises(ValidationError):
            GRPOConfig(**bad)
    with pytest.raises(ValidationError, match="replay_buffer_size > 0 has no effect with dynamic_sampling"):
        GRPOConfig(replay_buffer_size=4, dynamic_sampling=True)
