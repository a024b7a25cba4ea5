"""Off-policy corrections: stale-policy importance sampling (trainer vs sampler) and OPSM.

Mirrors TRL 1.16 ``GRPOTrainer``: the ``vllm_importance_sampling_correction`` block of
``_generate_and_score_completions`` and ``get_off_policy_mask``.

Shapes: ``B`` completions, ``T`` completion tokens (right padded). ``mask`` is the loss mask, 1 for
trained tokens, 0 for padding, any dtype. Log-probabilities in nats.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["IS_MODES", "importance_sampling_weights", "off_policy_mask", "seq_logprob_error_mask"]

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# --------------------------------------------------------------------------------------------------
# Stale-policy importance sampling (trainer vs vLLM sampler)
# --------------------------------------------------------------------------------------------------


def importance_sampling_weights(
    old_logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    mode: str,
    cap: float | None,
    clip_min: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights correcting for the sampler/trainer mismatch, ``rho = pi_old / pi_sampler``.

    ``rho_t = exp(old_logp_t - sampling_logp_t)``. Token modes use ``rho_t`` per token; sequence modes
    use one ratio per sequence, ``exp(sum_t mask_t * (old_t - sampling_t))`` (the masked *sum* of
    log-ratios, i.e. the product of token ratios, as TRL), broadcast to the sequence's tokens.
    ``*_truncate`` clamps to ``[clip_min, cap]`` (truncated IS, Ionides 2008 / "Your efficient RL
    framework secretly brings you off-policy RL training", Yao et al. 2025); ``*_mask`` sets ratios
    outside ``[clip_min, cap]`` to exactly 0 (masked IS, MIS). A bound of None is no bound.

    Mirrors the block under ``vllm_importance_sampling_correction`` in TRL
    ``GRPOTrainer._generate_and_score_completions`` (``GRPOConfig.vllm_importance_sampling_mode``,
    ``vllm_importance_sampling_clip_max`` = ``cap``, ``vllm_importance_sampling_clip_min``).
    Like TRL, a NaN sampling log-prob (token vLLM could not score) contributes a zero log-ratio.
    Unlike TRL, padding positions (mask 0) are set to weight 0 in the output (TRL leaves 1 / the
    sequence ratio there; the loss masks them either way), and nothing at padding is ever read.

    Args:
        old_logps: ``(B, T)`` trainer log-probs of the sampled tokens under the policy that the
            loss treats as "old" (nats). Treated as constant (no gradient).
        sampling_logps: ``(B, T)`` log-probs the sampler (vLLM) reported for the same tokens.
        mask: ``(B, T)`` loss mask.
        mode: ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or ``"sequence_mask"``.
        cap: upper bound ``C_max`` (TRL default 3.0) or None.
        clip_min: lower bound ``C_min`` or None (TRL default None).

    Returns:
        ``(weights, metrics)``: ``weights`` ``(B, T)`` detached, 0 at padding; ``metrics`` with
        ``sampling/importance_sampling_ratio/{mean,min,max}`` over valid tokens (token modes) or over
        sequences (sequence modes, as TRL), after truncation/masking;
        ``sampling/importance_sampling_ratio/masked_frac``: fraction of those units out of
        ``[clip_min, cap]`` (zeroed in mask modes, clamped in truncate modes); and
        ``sampling/sampling_logp_difference/{mean,max}`` of ``|old - sampling|`` over valid,
        non-NaN tokens (TRL's metric). Empty selections give 0.0.

    Raises:
        ValueError: unknown ``mode``, shape mismatch, or ``clip_min > cap``.
    """
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; expected one of {IS_MODES}")
    if old_logps.shape != sampling_logps.shape or old_logps.shape != mask.shape or old_logps.dim() != 2:
        raise ValueError(
            f"old_logps {tuple(old_logps.shape)}, sampling_logps {tuple(sampling_logps.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape"
        )
    if cap is not None and clip_min is not None and clip_min > cap:
        raise ValueError(f"clip_min ({clip_min}) must be <= cap ({cap})")

    valid = mask.bool()  # (B, T)
    sequence_level = mode.startswith("sequence")
    with torch.no_grad():
        old_logps = old_logps.detach()
        sampling_logps = sampling_logps.detach()
        diff = torch.where(valid, old_logps - sampling_logps, torch.zeros_like(old_logps))  # (B, T)
        diff = torch.nan_to_num(diff, nan=0.0)  # unscorable sampler tokens: ratio 1
        log_ratio = diff.sum(dim=-1, keepdim=True) if sequence_level else diff  # (B, 1) or (B, T)
        ratio = torch.exp(log_ratio)

        lo = clip_min if clip_min is not None else -math.inf
        hi = cap if cap is not None else math.inf
        out_of_bounds = (ratio < lo) | (ratio > hi)  # (B, 1) or (B, T)
        if mode.endswith("truncate"):
            if clip_min is not None or cap is not None:
                ratio = torch.clamp(ratio, min=clip_min, max=cap)
        else:
            ratio = ratio.masked_fill(out_of_bounds, 0.0)

        weights = torch.where(valid, ratio.expand_as(diff), torch.zeros_like(diff))  # (B, T)

        if sequence_level:  # one value per sequence, all sequences (TRL flattens the (B, 1) ratio)
            flat_ratio, flat_oob = ratio.flatten(), out_of_bounds.flatten()
        else:
            flat_ratio, flat_oob = ratio[valid], out_of_bounds[valid]
        abs_delta = (old_logps - sampling_logps).abs()
        abs_delta = abs_delta[valid & ~torch.isnan(abs_delta)]

        def _stat(x: Tensor, fn) -> float:
            return fn(x).item() if x.numel() > 0 else 0.0

        metrics = {
            "sampling/importance_sampling_ratio/mean": _stat(flat_ratio, torch.mean),
            "sampling/importance_sampling_ratio/min": _stat(flat_ratio, torch.min),
            "sampling/importance_sampling_ratio/max": _stat(flat_ratio, torch.max),
            "sampling/importance_sampling_ratio/masked_frac": _stat(flat_oob.float(), torch.mean),
            "sampling/sampling_logp_difference/mean": _stat(abs_delta, torch.mean),
            "sampling/sampling_logp_difference/max": _stat(abs_delta, torch.max),
        }
    return weights, metrics


# --------------------------------------------------------------------------------------------------
# Off-policy sequence masking (OPSM)
# --------------------------------------------------------------------------------------------------


def off_policy_mask(
    advantages: Tensor,
    logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    threshold: float,
) -> Tensor:
    """Off-Policy Sequence Mask, DeepSeek-V3.2 (arXiv 2512.02556) eq. 9.

    A sequence is kept unless its advantage is negative *and* its mean per-token forward KL estimate
    ``mean_t(sampling_logp_t - logp_t)`` over valid tokens exceeds ``threshold``. Mirrors TRL
    ``GRPOTrainer.get_off_policy_mask`` (``GRPOConfig.off_policy_mask_threshold``): NaN sampling
    log-probs contribute 0 to the mean (but still count in its denominator), the mean divides by
    ``max(#valid, 1)``. Padding positions are never read (TRL multiplies by the mask, which turns an
    inf at padding into NaN; we select instead).

    Args:
        advantages: ``(B,)`` or ``(B, 1)`` per-sequence advantages.
        logps: ``(B, T)`` current policy log-probs (detached internally).
        sampling_logps: ``(B, T)`` log-probs of the policy that sampled (vLLM), or the old policy.
        mask: ``(B, T)`` loss mask.
        threshold: ``delta`` in eq. 9 (nats per token), e.g. 0.5.

    Returns:
        ``(B, 1)`` float mask (``logps.dtype``), 1.0 keep, 0.0 drop; no gradient.

    Raises:
        ValueError: shape mismatch.
    """
    if logps.shape != sampling_logps.shape or logps.shape != mask.shape or logps.dim() != 2:
        raise ValueError("logps, sampling_logps and mask must share one (B, T) shape")
    batch = logps.shape[0]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    if advantages.shape != (batch, 1):
        raise ValueError(f"advantages must be (B,) or (B, 1) with B={batch}, got {tuple(advantages.shape)}")
    valid = mask.bool()
    mask_f = mask.to(logps.dtype)
    kl_div = torch.nan_to_num(sampling_logps.detach() - logps.detach(), nan=0.0)  # (B, T)
    kl_div = torch.where(valid, kl_div, torch.zeros_like(kl_div))
    avg_seq_kl = kl_div.sum(dim=1, keepdim=True) / mask_f.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    keep = (advantages.detach() >= 0) | (avg_seq_kl <= threshold)  # (B, 1)
    return keep.to(dtype=logps.dtype)


# --------------------------------------------------------------------------------------------------
# Sequence-level trainer/sampler mismatch (NeMo RL seq_logprob_error_threshold)
# --------------------------------------------------------------------------------------------------


def seq_logprob_error_mask(
    old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, threshold: float | None
) -> tuple[Tensor | None, dict[str, float]]:
    """NeMo RL's sequence multiplicative probability error and its mask.

    ``e_i = sum_t m_it exp(|old_it - sampling_it|) / sum_t m_it`` (NeMo RL ``seq_mult_prob_error``: the mean over
    the sequence's valid tokens of the factor by which trainer and sampler disagree on the token's probability;
    1 when they agree, about ``1 + mean_t |old - sampling|`` for small gaps). Tokens vLLM could not score
    (NaN sampling logps) and rows without valid tokens count as agreeing. With ``threshold``, sequences with
    ``e_i > threshold`` are masked (NeMo RL ``seq_logprob_error_threshold``).

    Args:
        old_logps: (B, T) the trainer's pi_old logprobs.
        sampling_logps: (B, T) vLLM's sampling logprobs.
        mask: (B, T) loss mask.
        threshold: mask above this (> 1), or None to measure only.

    Returns:
        (keep, metrics): keep (B,) bool (False: masked) or None without a threshold; metrics
        ``sampling/seq_mult_prob_error/mean`` (token-weighted in the step average), ``.../max``, and with a
        threshold ``sampling/seq_logprob_error_masked`` (sequences masked in this micro-batch).
    """
    valid = (mask > 0) & ~torch.isnan(sampling_logps)
    gap = torch.where(valid, (old_logps.detach() - sampling_logps).abs(), torch.zeros_like(old_logps))
    tokens = valid.sum(-1)
    error = torch.where(tokens > 0, (gap.exp() * valid).sum(-1) / tokens.clamp(min=1), torch.ones_like(gap[:, 0]))
    metrics = {
        "sampling/seq_mult_prob_error/mean": float(error.mean()) if error.numel() else 1.0,
        "sampling/seq_mult_prob_error/max": float(error.max()) if error.numel() else 1.0,
    }
    if threshold is None:
        return None, metrics
    keep = error <= threshold
    metrics["sampling/seq_logprob_error_masked"] = float((~keep).sum())
    return keep, metrics
