"""Per-pair reward correlations (issue 26, "reward hacking visible"): checked against numpy's Pearson coefficient,
with NaN rows left out pairwise and undefined pairs left out of the metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from async_grpo.orchestrator.batching import make_train_batch, reward_correlations
from async_grpo.transports.messages import RolloutGroup


def test_pearson_over_the_rows_both_functions_scored():
    nan = math.nan
    verifier = [1.0, 0.0, 1.0, 0.0, 1.0, nan]
    model = [0.9, 0.1, 0.7, 0.3, nan, 5.0]
    judge = [0.2, 0.8, 0.1, 0.9, 0.4, 0.6]
    out = reward_correlations(
        torch.tensor([verifier, model, judge], dtype=torch.float64).T, ["verifier", "rm", "judge"]
    )
    both = [0, 1, 2, 3]  # rows 4 and 5 miss one of verifier/rm
    expected_vr = np.corrcoef(np.array(verifier)[both], np.array(model)[both])[0, 1]
    assert out["rewards/verifier/correlation/rm"] == pytest.approx(expected_vr, abs=1e-12)
    expected_vj = np.corrcoef(np.array(verifier)[:5], np.array(judge)[:5])[0, 1]
    assert out["rewards/verifier/correlation/judge"] == pytest.approx(expected_vj, abs=1e-12)
    assert out["rewards/verifier/correlation/judge"] < -0.9  # the judge prefers what the verifier rejects
    assert set(out) == {
        "rewards/verifier/correlation/rm",
        "rewards/verifier/correlation/judge",
        "rewards/rm/correlation/judge",
    }


def test_undefined_pairs_are_left_out():
    constant = [1.0, 1.0, 1.0, 1.0]
    varying = [0.0, 1.0, 2.0, 3.0]
    sparse = [0.0, math.nan, math.nan, 1.0]
    out = reward_correlations(torch.tensor([constant, varying, sparse]).T, ["c", "v", "s"])
    assert out == {}  # constant with anything; sparse shares only 2 rows with each
    assert reward_correlations(torch.tensor([varying]).T, ["v"]) == {}
    with pytest.raises(ValueError, match="expected \\(completions, 2\\)"):
        reward_correlations(torch.tensor([varying]).T, ["v", "w"])


def test_the_train_batch_logs_them_under_the_function_names():
    groups = []
    for k in range(2):
        rows = [[float(i % 2), float(i % 2) * 0.5 + 0.1 * k] for i in range(4)]
        groups.append(
            RolloutGroup(
                prompt_ids=[1, 2],
                completion_ids=[[3]] * 4,
                sampling_logprobs=[[-1.0]] * 4,
                truncated=[False] * 4,
                completions=["x"] * 4,
                prompt=f"p{k}",
                columns={},
                rewards_per_func=rows,
                policy_version=0,
            )
        )
    batch = make_train_batch(groups, ["exact", "reward_model/rm"], [1.0, 1.0], "group")
    pooled = np.array([row for grp in groups for row in grp.rewards_per_func])  # every completion of the batch
    expected = np.corrcoef(pooled[:, 0], pooled[:, 1])[0, 1]
    assert batch.metrics["rewards/exact/correlation/reward_model/rm"] == pytest.approx(expected, abs=1e-6)
    assert 0.9 < expected < 0.999
