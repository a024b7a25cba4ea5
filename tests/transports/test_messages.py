"""RolloutGroup: per-token loss masks and policy versions default sensibly, are validated, and a group whose
tokens were sampled under several policy versions is as stale as its oldest token."""

from __future__ import annotations

import dataclasses

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
