"""RolloutGroup: per-token loss masks and policy versions default sensibly, are validated, and a group whose
tokens were sampled under several policy versions is as stale as its oldest token; the teacher's top-k fields default
to none, are checked when given (naming the field), and a group pickled before them unpickles without them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from async_grpo.transports.messages import RolloutGroup


def group(**kw) -> RolloutGroup:
    base = dict(
        prompt_ids=[1],
        completion_ids=[[5, 6, 7], [8]],
        sampling_logprobs=[[-1.0, -1.0, -1.0], [-1.0]],
        truncated=[False, False],
        completions=["a", "b"],
        prompt="p",
        columns={},
        policy_version=4,
    )
    base.update(kw)
    return RolloutGroup(**base)


def test_defaults_train_every_token_at_the_requested_version():
    grp = group()
    assert grp.loss_mask == [[1, 1, 1], [1]]
    assert grp.token_versions == [[4, 4, 4], [4]]
    assert grp.policy_version == 4


def test_a_group_straddling_a_weight_push_is_stamped_with_its_oldest_version():
    grp = group(policy_version=7, token_versions=[[5, 5, 6], [6]], loss_mask=[[1, 0, 1], [1]])
    assert grp.policy_version == 5  # staleness counts from the oldest token
    copy = dataclasses.replace(grp, replayed=True)  # the replay buffer's copies keep both
    assert copy.policy_version == 5 and copy.loss_mask == [[1, 0, 1], [1]]


@pytest.mark.parametrize(
    "bad",
    [
        {"loss_mask": [[1, 1], [1]]},
        {"token_versions": [[4, 4, 4], [4, 4]]},
        {"sampling_logprobs": [[-1.0], [-1.0]]},
        {"truncated": [False]},
    ],
)
def test_per_token_lists_must_match_the_completions(bad):
    with pytest.raises(ValueError, match="RolloutGroup"):
        group(**bad)


# ------------------------------------------------------------------ the teacher's fields (on-policy distillation)
TOPK_IDS = [[[9, 3], [4, 0], [2, 1]], [[7, 8]]]  # G=2 rows of T_i positions of K=2 ids
TOPK_LOGPROBS = [[[-0.1, -2.0], [-0.3, float("nan")], [-0.5, -0.9]], [[-0.2, -1.7]]]
TEACHER = [[-0.4, -0.3, -0.5], [-3.0]]


def test_the_teachers_topk_defaults_to_none_and_is_checked_when_given():
    plain = group()
    assert plain.teacher_topk_ids == [] and plain.teacher_topk_logprobs == []
    grp = group(teacher_logprobs=TEACHER, teacher_topk_ids=TOPK_IDS, teacher_topk_logprobs=TOPK_LOGPROBS)
    assert grp.teacher_topk_ids == TOPK_IDS
    grp.check_teacher_logprobs()
    empty = group(completion_ids=[[], []], sampling_logprobs=[[], []], teacher_logprobs=[[], []])
    empty.teacher_topk_ids, empty.teacher_topk_logprobs = [[], []], [[], []]  # no position: any K
    empty.check_teacher_logprobs()


@pytest.mark.parametrize(
    "bad, field, why",
    [
        ({"teacher_topk_ids": TOPK_IDS[:1]}, "teacher_topk_ids", "G=2 rows"),  # a row short
        ({"teacher_topk_ids": [TOPK_IDS[0][:2], TOPK_IDS[1]]}, "teacher_topk_ids", "G=2 rows"),  # a position short
        ({"teacher_topk_logprobs": []}, "teacher_topk_logprobs", "G=2 rows"),  # one field without the other
        ({"teacher_topk_ids": [[[9, 3], [4], [2, 1]], [[7, 8]]]}, "teacher_topk_ids", "one common K"),
        ({"teacher_topk_ids": [[[], [], []], [[]]]}, "teacher_topk_ids", "K > 0"),
        (
            {"teacher_topk_logprobs": [[[-0.1, -2.0], (-0.3, -1.0), [-0.5, -0.9]], [[-0.2, -1.7]]]},
            "teacher_topk_logprobs",
            "not a list",
        ),
        (
            {"teacher_topk_logprobs": [[[-0.1], [-0.3], [-0.5]], [[-0.2]]]},
            "teacher_topk_ids holds K=2 entries per position but teacher_topk_logprobs K=1",
            "one logprob per top-k id",
        ),
    ],
)
def test_a_misshapen_topk_is_refused_naming_the_field(bad, field, why):
    fields = {"teacher_logprobs": TEACHER, "teacher_topk_ids": TOPK_IDS, "teacher_topk_logprobs": TOPK_LOGPROBS}
    with pytest.raises(ValueError, match=f"RolloutGroup.{field}.*{why}"):
        group(**{**fields, **bad})
    grp = group(**fields)  # set after construction, as the teacher's rollout does, then checked
    for name, value in bad.items():
        setattr(grp, name, value)
    with pytest.raises(ValueError, match=f"RolloutGroup.{field}"):
        grp.check_teacher_logprobs()


def test_a_group_pickled_before_the_topk_fields_unpickles_without_them():
    grp = group(teacher_logprobs=TEACHER, teacher_topk_ids=TOPK_IDS, teacher_topk_logprobs=TOPK_LOGPROBS)
    copy = pickle.loads(pickle.dumps(grp))
    assert copy.teacher_topk_ids == TOPK_IDS and copy.teacher_topk_logprobs[1] == TOPK_LOGPROBS[1]
    old = group(teacher_logprobs=TEACHER)
    for name in ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_logprobs", "teacher_seconds"):
        del old.__dict__[name]  # what an older version pickled
    restored = pickle.loads(pickle.dumps(old))
    assert restored.teacher_topk_ids == [] and restored.teacher_topk_logprobs == []
    assert restored.teacher_logprobs == [] and restored.teacher_seconds == 0.0
