"""Lineage tags: digests that ignore layout, the code version, and nothing recorded as an empty string."""

import math

from async_grpo.lifecycle import lineage


def test_config_digest_ignores_key_order_and_layout_but_not_values():
    a = lineage.config_digest("seed: 1\nlearning_rate: 0.1\nreward_funcs: [a, b]\n")
    b = lineage.config_digest("learning_rate: 0.1\nreward_funcs:\n  - a\n  - b\nseed: 1\n")
    assert a == b and len(a) == 64
    assert lineage.config_digest("seed: 2\nlearning_rate: 0.1\nreward_funcs: [a, b]\n") != a


def test_git_commit_from_the_image_environment_wins(monkeypatch):
    monkeypatch.setenv(lineage.GIT_COMMIT_ENV, "0123abcd")
    assert lineage.git_commit() == "0123abcd"


def test_tags_leave_out_unknowns_and_nan(monkeypatch):
    monkeypatch.delenv(lineage.IMAGE_DIGEST_ENV, raising=False)
    monkeypatch.setenv(lineage.GIT_COMMIT_ENV, "c0ffee")
    tags = lineage.lineage_tags(
        resolved_config="seed: 0\n",
        parent_version="m/3",
        dataset={"source": "builtin:reverse", "train_digest": "t" * 64},
        kfp_run_id="run-1",
        evaluation={"eval_reward": 1.25, "ci_low": math.nan, "num_prompts": 64},
        decision="register: beats the champion",
    )
    assert tags == {
        "parent_version": "m/3",
        "config_sha256": lineage.config_digest("seed: 0\n"),
        "async_grpo.version": lineage.async_grpo.__version__,
        "git_commit": "c0ffee",
        "kfp.run_id": "run-1",
        "dataset.source": "builtin:reverse",
        "dataset.train_digest": "t" * 64,
        "eval.decision": "register: beats the champion",
        "eval.eval_reward": "1.25",
        "eval.num_prompts": "64.0",
    }
