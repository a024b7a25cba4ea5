"""The trust region against the behaviour policy (`off_policy_clip='behaviour'`, TRL AsyncGRPOTrainer's loss) and
the KL corrected against the sampler (`kl_bias_correction_ratio='sampler'`, DeepSeek-V3.2), on hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.algorithms.objective import GRPOObjective, MicroBatchInputs


def inputs(logps: list[float], sampling: list[float], adv: float, ref: list[float] | None = None):
    lp = torch.tensor([logps], requires_grad=True)
    return lp, MicroBatchInputs(
        logps=lp,
        entropies=torch.zeros(1, len(logps)),
        mask=torch.ones(1, len(logps)),
        advantages=torch.tensor([adv]),
        sampling_logps=torch.tensor([sampling]),
        ref_logps=None if ref is None else torch.tensor([ref]),
    )


def grad_of(settings: LossSettings, logps, sampling, adv, ref=None) -> tuple[torch.Tensor, dict]:
    lp, mb = inputs(logps, sampling, adv, ref)
    out = GRPOObjective(settings).micro_batch_loss(mb, num_items_in_batch=len(logps))
    out.output.loss.backward()
    return lp.grad[0], out.metrics


def test_on_policy_samples_train_the_same_under_both_clips():
    """Sampler == trainer: the behaviour ratio is 1 and the current-mode IS weight is 1: identical updates."""
    logps, adv = [-0.5, -1.2, -0.3], 0.8
    current, _ = grad_of(LossSettings(loss_type="dapo", epsilon_high=0.28), logps, logps, adv)
    behaviour, _ = grad_of(
        LossSettings(loss_type="dapo", epsilon_high=0.28, off_policy_clip="behaviour"), logps, logps, adv
    )
    torch.testing.assert_close(behaviour, current, rtol=0, atol=0)
    assert torch.allclose(current, torch.full((3,), -adv / 3))  # d/dlogp of -(r A)/N at r = 1


def test_a_stale_token_outside_the_trust_region_stops_pushing():
    """Token 0 became 2x likelier since vLLM sampled it (ratio 2 > 1 + 0.28, A > 0): behaviour clips it to zero
    gradient; token 1 (ratio exp(0.1) ~ 1.105, inside) keeps the gradient -A r / N. The current mode weights every
    token by the truncated IS weight min(ratio, 3) instead and never clips."""
    logps, sampling, adv = [-0.5, -1.0], [-0.5 - math.log(2.0), -1.1], 1.0
    behaviour, metrics = grad_of(
        LossSettings(loss_type="dapo", epsilon_high=0.28, off_policy_clip="behaviour"), logps, sampling, adv
    )
    assert behaviour[0] == 0.0
    assert behaviour[1].item() == pytest.approx(-adv * math.exp(0.1) / 2, rel=1e-6)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.5)
    current, metrics = grad_of(LossSettings(loss_type="dapo", epsilon_high=0.28), logps, sampling, adv)
    torch.testing.assert_close(current, torch.tensor([-2.0 / 2, -math.exp(0.1) / 2]), rtol=1e-6, atol=0)
    assert metrics["clip_ratio/high_mean"] == 0.0  # ratio pi_theta / pi_old is 1: the clip cannot act
    # the sampler drift is reported in both modes
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(2.0), rel=1e-6)


def test_unscorable_sampler_tokens_count_as_on_policy_under_the_behaviour_clip():
    behaviour, _ = grad_of(
        LossSettings(loss_type="dapo", off_policy_clip="behaviour"), [-0.5, -1.0], [float("nan"), -1.0], 1.0
    )
    torch.testing.assert_close(behaviour, torch.tensor([-0.5, -0.5]), rtol=1e-6, atol=0)


def test_the_kl_is_weighted_by_the_sampler_ratio_on_request():
    """k3(ref, logp) x pi_theta / pi_sampler per token (DeepSeek-V3.2), against x pi_theta / pi_old = 1 (TRL)."""
    logps, sampling, ref = [-0.5, -1.0], [-0.7, -1.0], [-0.6, -0.9]
    k3 = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(ref, logps, strict=True)]
    base = dict(loss_type="dapo", beta=0.1, vllm_importance_sampling_correction=False)
    _, old = grad_of(LossSettings(**base), logps, sampling, 0.0, ref)
    _, sampler = grad_of(LossSettings(**base, kl_bias_correction_ratio="sampler"), logps, sampling, 0.0, ref)
    assert old["kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert sampler["kl"] == pytest.approx((k3[0] * math.exp(0.2) + k3[1]) / 2, rel=1e-6)


def test_names_are_checked():
    with pytest.raises(ValueError, match="off_policy_clip='sampler' is not one of"):
        LossSettings(off_policy_clip="sampler")
    with pytest.raises(ValueError, match="kl_bias_correction_ratio.*use_liger_kernel"):
        LossSettings(use_liger_kernel=True, beta=0.1, kl_bias_correction_ratio="sampler")
