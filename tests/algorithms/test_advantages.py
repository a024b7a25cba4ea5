"""Advantages: hand-computed cases and parity with TRL's GRPOTrainer._generate_and_score_completions."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from async_grpo.algorithms import compute_advantages, nanstd

from ._trl_oracle import requires_trl, trl_score, trl_utils

NAN = float("nan")


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Hand-computed cases
# ------------------------------------------------------------------------------------------------


def test_group_scaling_binary_rewards():
    # mean 0.5, Bessel std sqrt(1/3) = 0.57735; advantage = +-0.5 / (0.57735 + 1e-4) = +-0.865875
    out = compute_advantages(_t([[1], [0], [0], [1]]), torch.ones(1), num_generations=4, scale_rewards="group")
    _close(out.advantages, [0.8658754, -0.8658754, -0.8658754, 0.8658754])
    _close(out.rewards, [1.0, 0.0, 0.0, 1.0])
    _close(out.std_rewards, [math.sqrt(1 / 3)] * 4)
    assert not out.is_std_zero.any() and not out.group_std_zero.any()
    assert out.metrics["reward"] == pytest.approx(0.5)
    assert out.metrics["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert out.metrics["frac_reward_zero_std"] == 0.0
    assert out.metrics["rewards/0/mean"] == pytest.approx(0.5)


def test_none_reward_counts_zero_in_weighted_sum():
    # weights [1, 1]: rows sum to [1, 2, 1] (NaN treated as 0 in nansum); mean 4/3, std sqrt(1/3)
    rewards = _t([[1, NAN], [NAN, 2], [0.5, 0.5]])
    out = compute_advantages(rewards, torch.tensor([1.0, 1.0]), num_generations=3, scale_rewards="group")
    _close(out.rewards, [1.0, 2.0, 1.0])
    _close(out.advantages, [-0.5772503, 1.1545006, -0.5772503])
    # per-function metrics ignore NaN: f0 over [1, 0.5], f1 over [2, 0.5]
    assert out.metrics["rewards/0/mean"] == pytest.approx(0.75)
    assert out.metrics["rewards/1/mean"] == pytest.approx(1.25)
    assert out.metrics["rewards/1/std"] == pytest.approx(math.sqrt(2 * 0.75**2))


def test_weights_are_applied():
    # weighted sums [2*1 + 0.5*4, 2*0 + 0.5*0] = [4, 0]; mean 2, std sqrt(8)
    out = compute_advantages(_t([[1, 4], [0, 0]]), torch.tensor([2.0, 0.5]), 2, "group")
    _close(out.rewards, [4.0, 0.0])
    _close(out.advantages, [2 / (math.sqrt(8) + 1e-4), -2 / (math.sqrt(8) + 1e-4)])


def test_unscorable_row_is_excluded_from_baseline_and_gets_zero():
    # row 1 unscorable; scored rows [1, 0, 2] -> mean 1, std 1
    out = compute_advantages(_t([[1, 1], [NAN, NAN], [0, 0], [2, 2]]), torch.tensor([1.0, 0.0]), 4, "group")
    _close(out.advantages, [0.0, 0.0, -1 / 1.0001, 1 / 1.0001])
    assert out.unscorable.tolist() == [False, True, False, False]
    assert math.isnan(out.rewards[1].item())
    assert out.metrics["reward"] == pytest.approx(1.0)  # NaN row left out of the logged mean


def test_all_nan_group_gives_zero_advantages_not_nan():
    rewards = _t([[1], [0], [NAN], [NAN], [3], [NAN]])  # groups: [1,0], all-NaN, single scored row
    for scale in ("group", "batch", "none"):
        for agg in ("sum_then_normalize", "normalize_then_sum"):
            out = compute_advantages(rewards, torch.ones(1), 2, scale, agg)
            assert torch.isfinite(out.advantages).all(), (scale, agg)
            _close(out.advantages[2:], [0.0] * 4)
            assert torch.isfinite(out.std_rewards).all()
    out = compute_advantages(rewards, torch.ones(1), 2, "group")
    _close(out.advantages[:2], [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)])
    # degenerate groups count as zero-std (documented departure from TRL, where isclose(NaN, 0) is False)
    assert out.is_std_zero.tolist() == [False, False, True, True, True, True]
    assert out.group_std_zero.tolist() == [False, False, True, True, True, True]
    assert out.metrics["frac_reward_zero_std"] == pytest.approx(4 / 6)


def test_every_row_unscorable():
    out = compute_advantages(torch.full((4, 2), NAN), torch.ones(2), 2, "group")
    _close(out.advantages, [0.0] * 4)
    assert out.unscorable.all() and out.group_std_zero.all()


def test_batch_scaling():
    # group means [0.5, 3]; diffs [0.5, -0.5, 0, 0]; batch std of [1, 0, 3, 3] = 1.5
    out = compute_advantages(_t([[1], [0], [3], [3]]), torch.ones(1), 2, "batch")
    _close(out.advantages, [0.5 / 1.5001, -0.5 / 1.5001, 0.0, 0.0])
    _close(out.std_rewards, [1.5] * 4)
    # TRL semantics: is_std_zero is about the batch std; group_std_zero flags the constant group
    assert not out.is_std_zero.any()
    assert out.group_std_zero.tolist() == [False, False, True, True]


def test_no_scaling():
    out = compute_advantages(_t([[1], [0], [0], [1], [5], [5], [2], [4]]), torch.ones(1), 4, "none")
    _close(out.advantages, [0.5, -0.5, -0.5, 0.5, 1.0, 1.0, -2.0, 0.0])
    # the group std is still computed, only for the zero-std flag
    _close(out.std_rewards[:4], [math.sqrt(1 / 3)] * 4)


def test_normalize_then_sum():
    rewards = _t([[1, 0], [0, 2], [1, 4], [1, 0]])
    weights = torch.tensor([1.0, 0.5])
    out = compute_advantages(rewards, weights, 2, "group", "normalize_then_sum")
    # per-function group normalisation, then weighted sum, then batch normalisation
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # f0, group 0 (group 1 of f0 is constant -> 0)
    b = 1.0 / (math.sqrt(2.0) + 1e-4)  # f1, group 0
    c = 2.0 / (math.sqrt(8.0) + 1e-4)  # f1, group 1
    summed = [a - 0.5 * b, -a + 0.5 * b, 0.5 * c, -0.5 * c]  # mean 0
    std = math.sqrt(sum(x * x for x in summed) / 3)
    _close(out.advantages, [x / (std + 1e-4) for x in summed])
    _close(out.rewards, [1.0, 1.0, 3.0, 1.0])  # raw weighted sums, as logged


def test_normalize_then_sum_differs_from_sum_then_normalize():
    rewards = _t([[1, 0], [0, 10], [1, 0], [1, 10]])
    a = compute_advantages(rewards, torch.ones(2), 2, "batch", "sum_then_normalize").advantages
    b = compute_advantages(rewards, torch.ones(2), 2, "batch", "normalize_then_sum").advantages
    assert not torch.allclose(a, b, atol=1e-3)


def test_single_generation():
    out = compute_advantages(_t([[1], [2]]), torch.ones(1), 1, "group")
    _close(out.advantages, [0.0, 0.0])
    assert out.is_std_zero.all() and out.group_std_zero.all()


def test_nanstd_matches_bessel():
    x = torch.tensor([[1.0, 2.0, NAN, 4.0], [NAN, NAN, 3.0, NAN]])
    _close(nanstd(x, dim=1)[0], math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert math.isnan(nanstd(x, dim=1)[1].item())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards_per_func=torch.ones(4), reward_weights=torch.ones(1), num_generations=2), "2-D"),
        (dict(rewards_per_func=torch.ones(4, 2), reward_weights=torch.ones(1), num_generations=2), "reward_weights"),
        (dict(rewards_per_func=torch.ones(5, 1), reward_weights=torch.ones(1), num_generations=2), "multiple"),
        (dict(rewards_per_func=torch.ones(4, 1), reward_weights=torch.ones(1), num_generations=0), "positive"),
        (
            dict(rewards_per_func=torch.ones(4, 1), reward_weights=torch.ones(1), num_generations=2, scale_rewards="x"),
            "scale_rewards",
        ),
        (
            dict(
                rewards_per_func=torch.ones(4, 1),
                reward_weights=torch.ones(1),
                num_generations=2,
                multi_objective_aggregation="x",
            ),
            "multi_objective_aggregation",
        ),
        (dict(rewards_per_func=_t([[1], [math.inf]]), reward_weights=torch.ones(1), num_generations=2), "inf"),
    ],
)
def test_invalid_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(**kwargs)


# ------------------------------------------------------------------------------------------------
# Parity with TRL
# ------------------------------------------------------------------------------------------------


def _random_rewards(kind: str, num_groups: int, num_generations: int, num_funcs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = num_groups * num_generations
    if kind == "binary":
        rewards = torch.randint(0, 2, (batch, num_funcs), generator=gen).float()
        rewards[:num_generations] = 1.0  # one constant group: zero std
    else:
        rewards = torch.randn(batch, num_funcs, generator=gen) * 2 + 0.5
    if kind in ("sparse_nan", "degenerate"):
        rewards[torch.rand(batch, num_funcs, generator=gen) < 0.25] = NAN
        rewards[1, :] = NAN  # one unscorable row
    if kind == "degenerate" and num_generations > 1:
        rewards[num_generations : 2 * num_generations] = NAN  # an all-NaN group
        rewards[2 * num_generations + 1 : 3 * num_generations] = NAN  # a group with one scored row
    return rewards


@requires_trl
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("kind", ["dense", "binary", "sparse_nan", "degenerate"])
@pytest.mark.parametrize("num_generations", [1, 4])
def test_matches_trl(aggregation, scale_rewards, kind, num_generations):
    num_funcs = 3
    seed = zlib.crc32(f"{aggregation}{scale_rewards}{kind}".encode())
    rewards = _random_rewards(kind, 4, num_generations, num_funcs, seed=seed)
    weights = torch.tensor([1.0, 0.5, -0.25])
    trl_out, trl_metrics = trl_score(rewards, weights, num_generations, scale_rewards, aggregation)
    ours = compute_advantages(rewards, weights, num_generations, scale_rewards, aggregation)

    assert torch.isfinite(ours.advantages).all()
    torch.testing.assert_close(ours.advantages, trl_out["advantages"], atol=1e-6, rtol=1e-6)
    assert ours.advantages.abs().sum() > 0 or num_generations == 1
    for key in ["reward", "reward_std"] + [f"rewards/{i}/{s}" for i in range(num_funcs) for s in ("mean", "std")]:
        assert ours.metrics[key] == pytest.approx(trl_metrics[key], rel=1e-6, abs=1e-6, nan_ok=True), key
    group_std_used = scale_rewards != "batch" and aggregation == "sum_then_normalize"
    if kind == "degenerate" and num_generations > 1 and group_std_used:
        # documented departure: groups with an undefined std count as zero-std here, not in TRL
        assert ours.metrics["frac_reward_zero_std"] > trl_metrics["frac_reward_zero_std"]
    else:
        assert ours.metrics["frac_reward_zero_std"] == pytest.approx(trl_metrics["frac_reward_zero_std"])


@requires_trl
def test_nanstd_matches_trl():
    x = torch.randn(5, 6)
    x[x > 1.0] = NAN
    x[2] = NAN
    for dim in (None, 0, 1):
        torch.testing.assert_close(nanstd(x, dim=dim), trl_utils.nanstd(x, dim=dim), equal_nan=True)
