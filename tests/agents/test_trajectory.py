"""Trajectories from calls (agents.trajectory): calls whose prompt extends the held ids join one segment, with the
observation between them loss-masked; a call that rewrites history starts a new segment; nothing is re-tokenized."""

from __future__ import annotations

from async_grpo.agents.trajectory import ModelCall, Segment, build_segments, common_prefix, extends


def call(prompt, completion, version=0, finish="stop"):
    return ModelCall(list(prompt), list(completion), [-0.5] * len(completion), version, finish)


def test_calls_that_extend_join_one_segment_with_masked_observations():
    first = call([1, 2, 3], [10, 11], version=4)
    second = call([1, 2, 3, 10, 11, 20, 21], [12], version=5)  # observation 20, 21 appended by the agent
    third = call([1, 2, 3, 10, 11, 20, 21, 12], [13, 14], version=6)  # nothing appended between
    (seg,) = build_segments([first, second, third])
    assert seg.prompt_ids == [1, 2, 3]
    assert seg.ids == [10, 11, 20, 21, 12, 13, 14]
    assert seg.mask == [1, 1, 0, 0, 1, 1, 1]
    assert seg.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert seg.versions == [4, 4, 4, 4, 5, 6, 6]  # an observation carries the call before it's version
    assert seg.calls == 3 and seg.generated_tokens == 7
    # the trained tokens are exactly the sampled ones, in order
    assert [t for t, m in zip(seg.ids, seg.mask, strict=True) if m] == [10, 11, 12, 13, 14]


def test_a_rewritten_history_starts_a_new_segment():
    a = call([1, 2], [10, 11])
    b = call([1, 2, 10, 11, 5], [12])
    rewrite = call([1, 2, 99, 5], [13])  # the agent replaced its first answer (a summary): not a continuation
    c = call([1, 2, 99, 5, 13, 6], [14], finish="length")
    segs = build_segments([a, b, rewrite, c])
    assert len(segs) == 2
    assert segs[0].held == [1, 2, 10, 11, 5, 12]
    assert segs[1].prompt_ids == [1, 2, 99, 5] and segs[1].ids == [13, 6, 14] and segs[1].mask == [1, 0, 1]
    assert segs[1].finish_reason == "length" and segs[1].calls == 2


def test_a_prompt_that_drops_the_sampled_eos_is_a_rewrite():
    # a template that re-renders the past turn differently (e.g. strips a reasoning block) shares only a prefix
    segs = build_segments([call([1, 2], [30, 31, 7]), call([1, 2, 31, 7, 8], [9])])
    assert len(segs) == 2


def test_segment_add_refuses_a_call_that_does_not_extend():
    seg = Segment([1])
    seg.add(call([1], [2]))
    try:
        seg.add(call([5], [6]))
    except ValueError as err:
        assert "new segment" in str(err)
    else:
        raise AssertionError("a non-extending call was joined")


def test_extends_and_common_prefix():
    assert extends([1, 2], [1, 2]) and extends([1, 2], [1, 2, 3])
    assert not extends([1, 2, 3], [1, 2]) and not extends([1, 2], [1, 3, 3])
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert common_prefix([[1, 2], [3]]) == [] and common_prefix([]) == []
    assert build_segments([]) == []
