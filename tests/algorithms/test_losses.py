"""Losses, importance sampling, OPSM and log-prob helpers: hand-computed cases and parity with TRL."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from async_grpo.algorithms import (
    LossInputs,
    LossSettings,
    entropy_from_logits,
    grpo_loss,
    high_entropy_mask,
    importance_sampling_weights,
    off_policy_mask,
    selective_log_softmax,
)

from ._trl_oracle import GRPOTrainer, requires_trl, trl_compute_loss, trl_high_entropy_mask, trl_score, trl_utils

NAN, INF = float("nan"), float("inf")
LN = math.log


def _close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def _mask(lengths, width):
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def _settings(**options) -> LossSettings:
    """LossSettings with these options; the KL bias correction is off unless asked for (TRL's default)."""
    return LossSettings(**{"use_bias_correction_kl": False, **options})


# ------------------------------------------------------------------------------------------------
# Importance sampling weights (hand-built)
# ------------------------------------------------------------------------------------------------

# old - sampling = [ln 4, ln 0.5, ln 1, pad]; padding holds garbage that must never be read
IS_OLD = torch.tensor([[LN(4.0), LN(0.5), 0.0, 123.0]], dtype=torch.float64)
IS_SAMPLING = torch.tensor([[0.0, 0.0, 0.0, NAN]], dtype=torch.float64)
IS_MASK = _mask([3], 4)


def test_token_truncate_clamps():
    w, m = importance_sampling_weights(IS_OLD, IS_SAMPLING, IS_MASK, "token_truncate", cap=2.0, clip_min=0.6)
    _close(w, [[2.0, 0.6, 1.0, 0.0]])
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.6)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(3.6 / 3)
    assert m["sampling/importance_sampling_ratio/masked_frac"] == pytest.approx(2 / 3)


def test_token_mask_sets_exact_zero():
    w, m = importance_sampling_weights(IS_OLD, IS_SAMPLING, IS_MASK, "token_mask", cap=2.0, clip_min=0.6)
    assert w.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # exactly 0, not 1/C
    assert m["sampling/importance_sampling_ratio/masked_frac"] == pytest.approx(2 / 3)
    # only an upper bound: 0.5 is kept
    w, _ = importance_sampling_weights(IS_OLD, IS_SAMPLING, IS_MASK, "token_mask", cap=2.0)
    _close(w, [[0.0, 0.5, 1.0, 0.0]])


def test_sequence_modes_use_the_masked_sum():
    # row 0: log-ratios [ln 2, ln 2] -> sum ln 4 -> ratio 4 (a mean would give 2 <= cap)
    # row 1: [ln 0.5, ln 2, ln 1.5] -> ratio 1.5; row 2: [ln 0.25] -> 0.25
    old = torch.tensor([[LN(2), LN(2), 9.0], [LN(0.5), LN(2), LN(1.5)], [LN(0.25), INF, -INF]], dtype=torch.float64)
    sampling = torch.tensor([[0.0, 0.0, -INF], [0.0, 0.0, 0.0], [0.0, NAN, 0.0]], dtype=torch.float64)
    mask = _mask([2, 3, 1], 3)
    w, m = importance_sampling_weights(old, sampling, mask, "sequence_truncate", cap=3.0, clip_min=0.5)
    _close(w, [[3.0, 3.0, 0.0], [1.5, 1.5, 1.5], [0.5, 0.0, 0.0]])
    assert m["sampling/importance_sampling_ratio/masked_frac"] == pytest.approx(2 / 3)
    w, m = importance_sampling_weights(old, sampling, mask, "sequence_mask", cap=3.0, clip_min=0.5)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(0.5)  # over sequences: (0 + 1.5 + 0) / 3


def test_nan_sampling_logp_means_no_correction():
    old = torch.tensor([[LN(2.0), 0.3, LN(2.0)]])
    sampling = torch.tensor([[0.0, NAN, 0.0]])
    mask = torch.ones(1, 3)
    w, m = importance_sampling_weights(old, sampling, mask, "token_truncate", cap=10.0)
    _close(w, [[2.0, 1.0, 2.0]])
    w, _ = importance_sampling_weights(old, sampling, mask, "sequence_truncate", cap=10.0)
    _close(w, [[4.0, 4.0, 4.0]])
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(LN(2.0))  # NaN token excluded


def test_is_weights_carry_no_gradient_and_validate():
    old = torch.zeros(2, 3, requires_grad=True)
    w, _ = importance_sampling_weights(old, torch.zeros(2, 3), torch.ones(2, 3), "token_mask", cap=2.0)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="mode"):
        importance_sampling_weights(old, old, torch.ones(2, 3), "bogus", cap=2.0)
    with pytest.raises(ValueError, match="clip_min"):
        importance_sampling_weights(old, old, torch.ones(2, 3), "token_mask", cap=2.0, clip_min=3.0)


@requires_trl
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(3.0, None), (1.3, 0.7), (None, 0.8)])
def test_is_weights_match_trl(mode, bounds):
    cap, clip_min = bounds
    gen = torch.Generator().manual_seed(3)
    lengths = [6, 4, 1, 0, 6, 3, 5, 2]
    old = torch.randn(8, 6, generator=gen) * 0.5 - 1.0
    sampling = old + torch.randn(8, 6, generator=gen) * 0.3
    sampling[0, 2] = NAN
    mask = _mask(lengths, 6)
    rewards = torch.arange(8, dtype=torch.float32).unsqueeze(1)
    trl_out, trl_metrics = trl_score(
        rewards,
        torch.ones(1),
        2,
        old_logps=old,
        sampling_logps=sampling,
        lengths=lengths,
        is_mode=mode,
        is_cap=cap,
        is_clip_min=clip_min,
    )
    w, m = importance_sampling_weights(old, sampling, mask, mode, cap=cap, clip_min=clip_min)
    trl_w = trl_out["importance_sampling_ratio"].expand(8, 6) * mask
    torch.testing.assert_close(w, trl_w, atol=1e-6, rtol=1e-6)
    assert (w != w.round()).any()  # a non-trivial case
    for key in ["min", "mean", "max"]:
        name = f"sampling/importance_sampling_ratio/{key}"
        assert m[name] == pytest.approx(trl_metrics[name], rel=1e-6), name
    for key in ["mean", "max"]:
        name = f"sampling/sampling_logp_difference/{key}"
        assert m[name] == pytest.approx(trl_metrics[name], rel=1e-6), name


# ------------------------------------------------------------------------------------------------
# OPSM (hand-built)
# ------------------------------------------------------------------------------------------------


def test_off_policy_mask_keep_and_drop():
    logps = torch.zeros(5, 3)
    # per-token (sampling - current); the third column of rows 3-4 is padding with garbage
    sampling = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.4, 0.4, 0.4], [1.0, 0.0, 100.0], [0.5, 0.6, NAN]])
    mask = _mask([3, 3, 3, 2, 2], 3)
    advantages = torch.tensor([0.0, -1.0, -1.0, -1.0, -2.0])
    keep = off_policy_mask(advantages, logps, sampling, mask, threshold=0.5)
    assert keep.shape == (5, 1) and keep.dtype == torch.float32
    # row 0: A >= 0 keeps despite KL 2; row 1: A < 0 and KL 1 > 0.5 drops; row 2: KL 0.4 keeps;
    # row 3: mean over the 2 valid tokens = 0.5 <= 0.5 keeps (padding counted would drop it); row 4: 0.55 drops
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_opsm_masked_fraction_metric_counts_dropped_tokens():
    """Same rows as above: rows 1 (3 tokens) and 4 (2 tokens) are dropped, 5 of 13 valid tokens."""
    logps = torch.zeros(5, 3, requires_grad=True)
    sampling = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.4, 0.4, 0.4], [1.0, 0.0, 100.0], [0.5, 0.6, NAN]])
    out = grpo_loss(
        logps,
        LossInputs(
            mask=_mask([3, 3, 3, 2, 2], 3),
            advantages=torch.tensor([0.0, -1.0, -1.0, -1.0, -2.0]),
            old_logps=logps.detach(),
            num_items_in_batch=13,
            sampling_logps=sampling,
        ),
        _settings(loss_type="dapo", epsilon=0.2, epsilon_high=0.2, off_policy_mask_threshold=0.5),
    )
    assert out.metrics["opsm/masked_fraction"] == pytest.approx(5 / 13)
    assert (
        "opsm/masked_fraction"
        not in grpo_loss(
            logps,
            LossInputs(mask=_mask([3] * 5, 3), advantages=torch.ones(5), num_items_in_batch=15),
            _settings(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
        ).metrics
    )


def test_off_policy_mask_nan_sampling_token_counts_zero():
    keep = off_policy_mask(
        torch.tensor([-1.0]), torch.zeros(1, 4), torch.tensor([[1.0, NAN, 0.0, 0.9]]), torch.ones(1, 4), threshold=0.5
    )
    assert keep.item() == 1.0  # (1 + 0 + 0 + 0.9) / 4 = 0.475


@requires_trl
@pytest.mark.parametrize("threshold", [0.05, 0.3])
def test_off_policy_mask_matches_trl(threshold):
    gen = torch.Generator().manual_seed(7)
    logps = torch.randn(10, 5, generator=gen)
    sampling = logps + torch.randn(10, 5, generator=gen).abs() * 0.4
    mask = _mask([5, 4, 3, 2, 1, 5, 5, 2, 0, 3], 5)
    advantages = torch.randn(10, generator=gen)
    ours = off_policy_mask(advantages, logps, sampling, mask, threshold)
    theirs = GRPOTrainer.get_off_policy_mask(advantages.unsqueeze(1), logps, sampling, mask.float(), threshold)
    assert torch.equal(ours, theirs)
    assert 0 < ours.sum() < 10


# ------------------------------------------------------------------------------------------------
# Loss aggregation and surrogates (hand-computed)
# ------------------------------------------------------------------------------------------------

# Two sequences of lengths 1 and 3 (T = 4), on-policy (ratio 1), advantages A = [1, 2]: the per-token
# loss is -A_i on every valid token, the gradient of each valid token is -A_i times its aggregation
# weight. Padding holds garbage that must not matter.
AGG_MASK = _mask([1, 3], 4)
AGG_ADV = torch.tensor([1.0, 2.0], dtype=torch.float64)


def _agg_logps():
    return torch.tensor([[-1.0, 7.0, 7.0, 7.0], [-0.5, -0.2, -0.3, 7.0]], dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize(
    "loss_type, options, extra, value, grads",
    [
        # mean over sequences of the per-sequence mean: (-1 + -2) / 2; grads -A_i / (len_i * B)
        ("grpo", {}, {}, -1.5, [-1 / 2, -2 / 6]),
        ("sapo", {}, {}, -(2.0 / 1.0 + 2 * 2.0 / 1.0) / 2, [-1 / 2, -2 / 6]),
        # token mean over the batch: (-1 - 2 * 3) / 4; grads -A_i / 4
        ("bnpo", {}, {}, -7 / 4, [-1 / 4, -2 / 4]),
        # token sum / (B * L) with L = 8: -7 / 16
        ("dr_grpo", {"max_completion_length": 8}, {}, -7 / 16, [-1 / 16, -2 / 16]),
        # token sum / (num_items / num_processes) = -7 / (14 / 2)
        ("dapo", {}, {"num_items_in_batch": 14, "num_processes": 2}, -1.0, [-1 / 7, -2 / 7]),
    ],
)
@pytest.mark.parametrize("gas", [1, 2])
def test_loss_aggregation(loss_type, options, extra, value, grads, gas):
    logps = _agg_logps()
    out = grpo_loss(
        logps,
        LossInputs(
            mask=AGG_MASK, advantages=AGG_ADV, old_logps=logps.detach(), gradient_accumulation_steps=gas, **extra
        ),
        _settings(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, **options),
    )
    out.loss.backward()
    scale = 1 if loss_type == "dapo" else gas  # dapo's normaliser already spans the accumulation window
    assert out.loss.item() == pytest.approx(value / scale)
    assert out.metrics["policy_loss"] == pytest.approx(value)
    expected = torch.tensor([[grads[0], 0, 0, 0], [grads[1]] * 3 + [0]], dtype=torch.float64) / scale
    _close(logps.grad, expected)


def test_sapo_temperatures():
    # at ratio 1: loss_i = -(4 / tau) * sigmoid(0) * A = -2 A / tau; tau = 1.0 for A > 0, 1.05 otherwise
    logps = torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)
    out = grpo_loss(
        logps,
        LossInputs(
            mask=torch.ones(2, 1), advantages=torch.tensor([1.0, -1.0], dtype=torch.float64), old_logps=logps.detach()
        ),
        _settings(loss_type="sapo", epsilon=0.2, epsilon_high=0.2),
    )
    assert out.loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    out.loss.backward()  # d/dlogp = -(4 / tau) * sigmoid'(0) * tau * r * A = -A, halved by the batch mean
    _close(logps.grad, [[-0.5], [0.5]])


def test_dapo_global_token_mean_across_micro_batches_and_ranks():
    # 2 ranks x 2 micro-batches, lengths vary; summing grads over micro-batches and averaging over ranks
    # must equal the gradient of one global token mean.
    gen = torch.Generator().manual_seed(0)
    lengths = [[[3, 1], [2, 2]], [[4, 0], [1, 1]]]  # [rank][micro][seq]
    total_tokens = sum(sum(sum(mb) for mb in rank) for rank in lengths)
    advs = torch.randn(2, 2, 2, generator=gen)
    base = torch.randn(2, 2, 2, 4, generator=gen, dtype=torch.float64)
    leaf = base.clone().requires_grad_(True)
    for r in range(2):
        for k in range(2):
            out = grpo_loss(
                leaf[r, k],
                LossInputs(
                    mask=_mask(lengths[r][k], 4),
                    advantages=advs[r, k],
                    old_logps=leaf[r, k].detach(),
                    num_items_in_batch=total_tokens,
                    gradient_accumulation_steps=2,
                    num_processes=2,
                ),
                _settings(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
            )
            out.loss.backward()
    ddp_grad = leaf.grad / 2  # DDP averages over ranks
    ref = base.clone().requires_grad_(True)
    all_mask = torch.stack([torch.stack([_mask(lengths[r][k], 4) for k in range(2)]) for r in range(2)])
    global_mean = (-(torch.exp(ref - ref.detach())) * advs.unsqueeze(-1) * all_mask).sum() / total_tokens
    global_mean.backward()
    _close(ddp_grad, ref.grad)


def test_clipping_and_metrics():
    # ratios [1.5, 1.5, 0.5, 0.5] with A = [+1, -1, -1, +1]; eps_low 0.2, eps_high 0.28
    old = torch.zeros(4, 1, dtype=torch.float64)
    logps = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    out = grpo_loss(
        logps,
        LossInputs(mask=torch.ones(4, 1), advantages=adv, old_logps=old),
        _settings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.28),
    )
    # per-token: -min(1.5, 1.28) = -1.28 (clipped high); -min(-1.5, -1.28) = 1.5; -min(-0.5, -0.8) = 0.8
    # (clipped low); -min(0.5, 0.8) = -0.5
    assert out.loss.item() == pytest.approx((-1.28 + 1.5 + 0.8 - 0.5) / 4)
    out.loss.backward()  # clipped tokens have zero gradient; others -A * r / 4
    _close(logps.grad, [[0.0], [1.5 / 4], [0.0], [-0.5 / 4]])
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(0.25)
    assert out.metrics["clip_ratio/low_mean"] == pytest.approx(0.25)
    assert out.metrics["clip_ratio/region_mean"] == pytest.approx(0.5)


def test_two_sided_clipping_delta():
    # ratio 3 with A = -1: without delta the loss is 3 (gradient 3); with delta = 2 it is 2 (no gradient)
    old = torch.zeros(1, 1, dtype=torch.float64)
    for delta, value, grad in [(None, 3.0, 3.0), (2.0, 2.0, 0.0)]:
        logps = torch.full((1, 1), LN(3.0), dtype=torch.float64, requires_grad=True)
        out = grpo_loss(
            logps,
            LossInputs(mask=torch.ones(1, 1), advantages=torch.tensor([-1.0], dtype=torch.float64), old_logps=old),
            _settings(loss_type="grpo", epsilon=0.2, epsilon_high=0.2, delta=delta),
        )
        out.loss.backward()
        assert out.loss.item() == pytest.approx(value)
        assert logps.grad.item() == pytest.approx(grad)


def test_cispo_caps_the_detached_ratio():
    # ratio 3 > eps_max 2: loss = -2 * A * logp / num_items, gradient -2 * A / num_items
    logps = torch.full((1, 2), LN(3.0), dtype=torch.float64, requires_grad=True)
    out = grpo_loss(
        logps,
        LossInputs(
            mask=torch.ones(1, 2),
            advantages=torch.tensor([1.0], dtype=torch.float64),
            old_logps=torch.zeros(1, 2, dtype=torch.float64),
            num_items_in_batch=4,
        ),
        _settings(loss_type="cispo", epsilon=0.0, epsilon_high=2.0),
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2 * 2 * LN(3.0) / 4)
    _close(logps.grad, [[-0.5, -0.5]])
    assert out.metrics["cispo_clip_ratio"] == 1.0


def test_sequence_level_ratio_is_the_mean_log_ratio():
    # log-ratios [0.2, 0.4] -> sequence ratio exp(0.3) for every token; A = 1, eps wide: loss = -exp(0.3)
    old = torch.zeros(1, 2, dtype=torch.float64)
    logps = torch.tensor([[0.2, 0.4]], dtype=torch.float64, requires_grad=True)
    out = grpo_loss(
        logps,
        LossInputs(mask=torch.ones(1, 2), advantages=torch.tensor([1.0], dtype=torch.float64), old_logps=old),
        _settings(loss_type="grpo", epsilon=0.9, epsilon_high=9.0, importance_sampling_level="sequence"),
    )
    assert out.loss.item() == pytest.approx(-math.exp(0.3))
    out.loss.backward()
    _close(logps.grad, [[-math.exp(0.3) / 2] * 2])


def test_k3_kl_and_bias_correction():
    # ref - logp = ln 2: k3 = 2 - ln 2 - 1 = 0.306853; ratio r = 1.5 multiplies it with bias correction
    logps = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 1), -LN(1.5), dtype=torch.float64)
    ref = torch.full((1, 1), LN(2.0), dtype=torch.float64)
    zero_adv = torch.zeros(1, dtype=torch.float64)
    kw = dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.2, beta=0.1)
    out = grpo_loss(
        logps, LossInputs(mask=torch.ones(1, 1), advantages=zero_adv, old_logps=old, ref_logps=ref), _settings(**kw)
    )
    assert out.metrics["kl"] == pytest.approx(1 - LN(2.0))
    assert out.loss.item() == pytest.approx(0.1 * (1 - LN(2.0)))
    out = grpo_loss(
        logps,
        LossInputs(mask=torch.ones(1, 1), advantages=zero_adv, old_logps=old, ref_logps=ref),
        _settings(use_bias_correction_kl=True, **kw),
    )
    assert out.metrics["kl"] == pytest.approx(1.5 * (1 - LN(2.0)))


def test_opsm_and_is_weights_scale_per_token_loss():
    logps = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    sampling = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)  # row 0 is off-policy: dropped
    is_w = torch.tensor([[1.0, 0.0], [0.5, 2.0]], dtype=torch.float64)
    out = grpo_loss(
        logps,
        LossInputs(
            mask=torch.ones(2, 2), advantages=adv, old_logps=logps.detach(), sampling_logps=sampling, is_weights=is_w
        ),
        _settings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.2, off_policy_mask_threshold=0.5),
    )
    assert out.loss.item() == pytest.approx((0.5 + 2.0) / 4)  # per-token loss +1 times IS weight, row 0 dropped


def test_padding_garbage_does_not_leak():
    gen = torch.Generator().manual_seed(1)
    mask = _mask([3, 1, 4], 4)
    base = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    old = base + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ref = base - 0.2
    is_w = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    dirty = lambda x: torch.where(mask.bool(), x, torch.tensor(NAN, dtype=x.dtype))  # noqa: E731
    results = []
    for clean in (True, False):
        f = (lambda x: x) if clean else dirty
        logps = base.clone().requires_grad_(True)
        settings = _settings(
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.2,
            beta=0.04,
            use_bias_correction_kl=True,
            off_policy_mask_threshold=0.1,
            importance_sampling_level="sequence",
        )
        out = grpo_loss(
            f(logps) if not clean else logps,
            LossInputs(
                mask=mask,
                advantages=torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64),
                old_logps=f(old),
                ref_logps=f(ref),
                is_weights=f(is_w),
                sampling_logps=f(old),
                num_items_in_batch=8,
            ),
            settings,
        )
        out.loss.backward()
        results.append((out.loss.detach(), logps.grad))
    assert torch.isfinite(results[1][0]) and torch.isfinite(results[1][1]).all()
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize(
    "options, kwargs, match",
    [
        (dict(loss_type="ppo"), {}, "loss_type='ppo'"),  # refused by LossSettings
        (dict(importance_sampling_level="chunk"), {}, "importance_sampling_level='chunk'"),
        (dict(loss_type="dr_grpo", max_completion_length=0), {}, "max_completion_length"),
        (dict(loss_type="dapo"), {}, "num_items_in_batch"),
        (dict(loss_type="cispo", epsilon_high=5.0), {}, "num_items_in_batch"),
        (dict(beta=0.1), {}, "ref_logps"),
        ({}, dict(advantages=torch.tensor([NAN, 0.0])), "NaN"),
        ({}, dict(advantages=torch.zeros(3)), "advantages"),
        ({}, dict(old_logps=torch.zeros(2, 2)), "old_logps"),
    ],
)
def test_grpo_loss_invalid_inputs_raise(options, kwargs, match):
    base = dict(old_logps=torch.zeros(2, 3), advantages=torch.zeros(2), mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=match):
        grpo_loss(
            torch.zeros(2, 3), LossInputs(**{**base, **kwargs}), settings=_settings(**{"loss_type": "grpo", **options})
        )


# ------------------------------------------------------------------------------------------------
# Parity with TRL's _compute_loss: value, gradient and metrics, float32, every combination
# ------------------------------------------------------------------------------------------------

B, T = 6, 7
LENGTHS = [7, 5, 1, 0, 3, 6]


def _parity_inputs():
    gen = torch.Generator().manual_seed(1234)
    mask = _mask(LENGTHS, T)
    logps = -torch.rand(B, T, generator=gen) * 3  # (B, T) in (-3, 0]
    old = logps + torch.randn(B, T, generator=gen) * 0.5  # ratios spread enough to clip
    ref = logps + torch.randn(B, T, generator=gen) * 0.2
    sampling = old + torch.randn(B, T, generator=gen) * 0.4
    advantages = torch.tensor([1.2, 0.7, -0.4, 0.5, -1.5, -0.3])
    is_w, _ = importance_sampling_weights(old, sampling, mask, "token_mask", cap=1.4, clip_min=0.6)
    assert (is_w[mask.bool()] == 0).any()  # some tokens are masked out
    return mask, logps, old, ref, sampling, advantages, is_w


CASES = [
    (lt, level, kl, use_is, opsm, delta)
    for lt, level, kl, use_is, opsm, delta in itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"],
        ["token", "sequence"],
        ["none", "k3", "k3_bias"],
        [False, True],
        [False, True],
        [None, 1.6],
    )
    if delta is None or lt in ("grpo", "dapo")
]


@requires_trl
@pytest.mark.parametrize("loss_type, level, kl, use_is, opsm, delta", CASES)
def test_grpo_loss_matches_trl(loss_type, level, kl, use_is, opsm, delta):
    mask, base, old, ref, sampling, advantages, is_w = _parity_inputs()
    settings = _settings(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=3.0 if loss_type == "cispo" else 0.28,
        delta=delta,
        importance_sampling_level=level,
        beta=0.0 if kl == "none" else 0.05,
        use_bias_correction_kl=kl == "k3_bias",
        off_policy_mask_threshold=0.1 if opsm else None,
        max_completion_length=T + 3,
    )
    kwargs = dict(
        ref_logps=None if kl == "none" else ref,
        is_weights=is_w if use_is else None,
        sampling_logps=sampling if opsm else None,
        num_items_in_batch=torch.tensor(3 * int(mask.sum())),
        gradient_accumulation_steps=3,
        num_processes=2,
    )
    ours_leaf = base.clone().requires_grad_(True)
    trl_leaf = base.clone().requires_grad_(True)
    ours = grpo_loss(ours_leaf, LossInputs(mask=mask, advantages=advantages, old_logps=old, **kwargs), settings)
    trl_loss, trl_metrics = trl_compute_loss(trl_leaf, old, advantages, mask, settings, **kwargs)
    ours.loss.backward()
    trl_loss.backward()

    torch.testing.assert_close(ours.loss, trl_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad, atol=1e-6, rtol=1e-6)
    assert ours_leaf.grad.abs().sum() > 0
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"):
        assert (key in ours.metrics) == (key in trl_metrics), key
        if key in trl_metrics:
            assert ours.metrics[key] == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key


def test_parity_cases_exercise_clipping_and_opsm():
    # guard against the parity matrix silently testing trivial inputs
    mask, base, old, ref, sampling, advantages, _ = _parity_inputs()
    out = grpo_loss(
        base.clone().requires_grad_(True),
        LossInputs(mask=mask, advantages=advantages, old_logps=old),
        _settings(loss_type="grpo", epsilon=0.2, epsilon_high=0.28),
    )
    assert out.metrics["clip_ratio/low_mean"] > 0 and out.metrics["clip_ratio/high_mean"] > 0
    keep = off_policy_mask(advantages, base, sampling, mask, 0.1)
    assert 0 < keep.sum() < B


# ------------------------------------------------------------------------------------------------
# top_entropy_quantile: hand-computed cases and parity with TRL's get_high_entropy_mask / _compute_loss
# ------------------------------------------------------------------------------------------------

# valid entropies (row-major) 0.1, 0.5, 0.9 | 0.3, 0.7; sorted 0.1 0.3 0.5 0.7 0.9; padding holds 5.0
ENT = torch.tensor([[0.1, 0.5, 0.9, 5.0], [0.3, 0.7, 5.0, 5.0]])
ENT_MASK = _mask([3, 2], 4)


@pytest.mark.parametrize(
    "rho, kept",
    [
        (1.0, [[1, 1, 1, 0], [1, 1, 0, 0]]),  # quantile 0 = min 0.1: every valid token
        (0.5, [[0, 1, 1, 0], [0, 1, 0, 0]]),  # quantile 0.5: position 2 of 0..4 -> 0.5; keep >= 0.5
        (0.2, [[0, 0, 1, 0], [0, 0, 0, 0]]),  # quantile 0.8: position 3.2 -> 0.7 + 0.2 * 0.2 = 0.74
        (0.0, [[0, 0, 1, 0], [0, 0, 0, 0]]),  # quantile 1 = max: only the highest-entropy token
    ],
)
def test_high_entropy_mask_quantile(rho, kept):
    out = high_entropy_mask(ENT, ENT_MASK, rho)
    assert out.dtype == torch.bool
    assert out.int().tolist() == kept  # padding (entropy 5.0) is never kept


def test_high_entropy_mask_ties_empty_and_errors():
    ties = torch.tensor([[0.9, 0.2, 0.9]])
    assert high_entropy_mask(ties, torch.ones(1, 3), 0.0).tolist() == [[True, False, True]]  # ties at the max
    assert not high_entropy_mask(ENT, torch.zeros(2, 4), 0.5).any()  # no valid token
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        high_entropy_mask(ENT, ENT_MASK, 1.5)
    with pytest.raises(ValueError, match="shape"):
        high_entropy_mask(ENT, ENT_MASK[:, :2], 0.5)


def test_entropy_mask_scales_policy_term_not_kl():
    # on-policy (ratio 1), A = +1, bnpo over 2 tokens: policy term -1 per kept token; KL 1 - ln 2 on every token
    logps = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), LN(2.0), dtype=torch.float64)
    keep = torch.tensor([[True, False]])
    out = grpo_loss(
        logps,
        LossInputs(
            mask=torch.ones(1, 2),
            advantages=torch.tensor([1.0], dtype=torch.float64),
            old_logps=logps.detach(),
            ref_logps=ref,
            entropy_mask=keep,
        ),
        _settings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.2, beta=0.1),
    )
    assert out.loss.item() == pytest.approx((-1.0 + 0.0) / 2 + 0.1 * (1 - LN(2.0)))  # denominator still 2 tokens
    out.loss.backward()  # policy grad -A/2 on the kept token only; KL grad d/dlogp k3 = 1 - 2 = -1, times 0.1 / 2
    _close(logps.grad, [[-0.5 - 0.05, -0.05]])
    with pytest.raises(ValueError, match="entropy_mask"):
        grpo_loss(
            logps,
            LossInputs(mask=torch.ones(1, 2), advantages=torch.tensor([1.0]), entropy_mask=keep[:, :1]),
            _settings(loss_type="grpo", epsilon=0.2, epsilon_high=0.2),
        )


def _parity_entropies():
    gen = torch.Generator().manual_seed(99)
    return torch.rand(B, T, generator=gen) * 4  # (B, T) entropies in nats


@requires_trl
@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_high_entropy_mask_matches_trl(rho):
    mask, *_ = _parity_inputs()
    ent = _parity_entropies()
    ours = high_entropy_mask(ent, mask, rho)
    theirs = trl_high_entropy_mask(ent, mask, 1 - rho)
    assert torch.equal(ours, theirs)
    assert 0 < int(ours.sum()) <= int(mask.sum())


@requires_trl
@pytest.mark.parametrize(
    "loss_type, level, rho",
    list(
        itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], ["token", "sequence"], [0.0, 0.2, 0.7])
    ),
)
def test_entropy_mask_loss_matches_trl(loss_type, level, rho):
    # everything on at once (OPSM, stale-policy IS, KL with bias correction), so the order of the masks matters
    mask, base, old, ref, sampling, advantages, is_w = _parity_inputs()
    ent = _parity_entropies()
    settings = _settings(
        loss_type=loss_type, epsilon=0.2, epsilon_high=3.0 if loss_type == "cispo" else 0.28,
        importance_sampling_level=level, beta=0.05, use_bias_correction_kl=True, off_policy_mask_threshold=0.1,
        max_completion_length=T + 3, top_entropy_quantile=rho,
    )  # fmt: skip
    kwargs = dict(
        ref_logps=ref, is_weights=is_w, sampling_logps=sampling, num_items_in_batch=torch.tensor(3 * int(mask.sum())),
        gradient_accumulation_steps=3, num_processes=2,
    )  # fmt: skip
    ours_leaf = base.clone().requires_grad_(True)
    trl_leaf = base.clone().requires_grad_(True)
    ours = grpo_loss(
        ours_leaf,
        LossInputs(
            mask=mask, advantages=advantages, old_logps=old, entropy_mask=high_entropy_mask(ent, mask, rho), **kwargs
        ),
        settings,
    )
    trl_loss, _ = trl_compute_loss(trl_leaf, old, advantages, mask, settings, entropies=ent, **kwargs)
    ours.loss.backward()
    trl_loss.backward()
    torch.testing.assert_close(ours.loss, trl_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad, atol=1e-6, rtol=1e-6)
    # the mask matters: the unmasked loss differs
    unmasked = grpo_loss(base.clone(), LossInputs(mask=mask, advantages=advantages, old_logps=old, **kwargs), settings)
    assert not torch.allclose(unmasked.loss, ours.loss, atol=1e-6)


@requires_trl
def test_on_policy_old_logps_none_matches_trl():
    mask, base, _, _, _, advantages, _ = _parity_inputs()
    ours_leaf, trl_leaf = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    settings = _settings(loss_type="bnpo", epsilon=0.2, epsilon_high=0.2)
    ours = grpo_loss(ours_leaf, LossInputs(mask=mask, advantages=advantages), settings)
    theirs, _ = trl_compute_loss(trl_leaf, None, advantages, mask, settings)
    ours.loss.backward()
    theirs.backward()
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad)


# ------------------------------------------------------------------------------------------------
# Log-prob helpers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_selective_log_softmax(dtype):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 11, generator=gen) * 3).to(dtype)
    index = torch.randint(0, 11, (3, 4), generator=gen)
    ours = selective_log_softmax(logits, index)
    naive = torch.gather(logits.float().log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), naive, atol=tol, rtol=tol)
    if trl_utils is not None:
        torch.testing.assert_close(ours, trl_utils.selective_log_softmax(logits, index))
    assert ours.dtype == dtype
    with pytest.raises(ValueError):
        selective_log_softmax(logits, index[:, :2])


def test_entropy_from_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 5, 13, generator=gen, dtype=torch.float64) * 2
    ours = entropy_from_logits(logits, chunk_size=4)
    p = logits.softmax(-1)
    _close(ours, -(p * p.log()).sum(-1))
    if trl_utils is not None:
        torch.testing.assert_close(ours, trl_utils.entropy_from_logits(logits))
    # uniform over V has entropy ln V; a one-hot-like distribution has ~0
    _close(entropy_from_logits(torch.zeros(1, 1, 13)), [[LN(13)]])
    assert entropy_from_logits(torch.tensor([[[100.0, 0.0, 0.0]]])).item() < 1e-6
