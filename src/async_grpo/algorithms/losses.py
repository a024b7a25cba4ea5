"""GRPO-family policy losses (grpo, bnpo, dr_grpo, dapo, cispo, sapo; GSPO via sequence-level ratios).

Pure functions over tensors, one :class:`~.inputs.LossInputs` record and a validated
:class:`~.settings.LossSettings` (no model, no config object). :func:`grpo_loss` mirrors TRL 1.16
``GRPOTrainer._compute_loss`` expression for expression, so that loss values and gradients agree with TRL on the
same inputs; its normalizer is the ``loss_type``'s row of :data:`~.normalizers.LOSS_NORMALIZERS`. The helpers it
builds on live in :mod:`.off_policy` (importance sampling, OPSM) and :mod:`.logprobs` (log-softmax, entropy) and
are re-exported here.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens (right padded), ``V`` vocab.
``mask`` is the loss mask, 1 for trained tokens, 0 for padding (and for truncated completions with
``mask_truncated_completions``); any dtype (bool / int / float). Log-probabilities are in nats per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .inputs import LossInputs
from .logprobs import entropy_from_logits, selective_log_softmax
from .off_policy import IS_MODES, importance_sampling_weights, off_policy_mask
from .settings import IS_LEVELS, LOSS_TYPES, LossSettings

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "LOSS_TYPES",
    "LossOutput",
    "entropy_from_logits",
    "grpo_loss",
    "importance_sampling_weights",
    "off_policy_mask",
    "selective_log_softmax",
]


@dataclass
class LossOutput:
    """Result of :func:`grpo_loss`.

    Attributes:
        loss: 0-d tensor; call ``.backward()`` on it. Already divided for gradient accumulation.
        metrics: floats over this micro-batch (local to the rank): ``kl`` (when ``beta != 0``),
            ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (grpo, bnpo,
            dr_grpo, dapo) or ``cispo_clip_ratio`` (cispo); sapo has no clip metric. Also
            ``policy_loss``: the loss before the gradient-accumulation division.
    """

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    """TRL ``global_masked_mean`` on one rank: (B, 1) -> plain mean over sequences; (B, T) -> token mean."""
    if x.shape[1] == 1:
        return (x.sum() / max(x.shape[0], 1)).item()
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()


def _masked_where(valid: Tensor, x: Tensor) -> Tensor:
    """Zero ``x`` at padding so that NaN / inf there cannot leak into sums or gradients."""
    return torch.where(valid, x, torch.zeros_like(x))


def grpo_loss(logps: Tensor, inputs: LossInputs, settings: LossSettings) -> LossOutput:
    """GRPO-family clipped surrogate loss for one micro-batch, mirroring TRL ``GRPOTrainer._compute_loss``.

    The static options come from ``settings`` (:class:`~.settings.LossSettings`, already validated; below
    ``eps_low = settings.epsilon``, ``eps_high = settings.epsilon_high``); the per-call tensors and normalizers
    from ``inputs`` (:class:`~.inputs.LossInputs`; below its fields by name). ``settings.top_entropy_quantile``,
    ``vllm_importance_sampling_*``, ``replay_recompute_logps``, ``temperature``, ``use_liger_kernel`` and
    ``mask_truncated_completions`` are not read here: they shape the inputs
    (:class:`~.objective.GRPOObjective` builds ``is_weights``, ``sampling_logps`` and ``entropy_mask`` from them).

    Ratio ``r = exp(logp - old_logp)`` per token (``importance_sampling_level="token"``) or
    ``exp(mean_t(logp - old_logp))`` per sequence (``"sequence"``: GSPO, Zheng et al. 2025, arXiv 2507.18071).
    Per-token loss by ``loss_type``:

    - grpo / bnpo / dr_grpo / dapo: PPO clip ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``
      (DeepSeekMath eq. 3; asymmetric "clip-higher" from DAPO); with ``delta`` the unclipped branch is
      ``min(r, delta) A`` (two-sided clipping, INTELLECT-2).
    - cispo: ``-sg(min(r, eps_high)) A logp`` (MiniMax-M1 / ScaleRL; ``epsilon_high`` is eps_max,
      recommended 5.0).
    - sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A`` with ``tau = sapo_temperature_pos`` if ``A > 0``
      else ``sapo_temperature_neg`` (SAPO, arXiv 2511.20347; TRL defaults 1.0 / 1.05).

    Then, in TRL's order: times the OPSM mask (:func:`off_policy_mask`, when
    ``settings.off_policy_mask_threshold`` is set), times ``entropy_mask`` (``top_entropy_quantile``,
    :func:`~async_grpo.algorithms.high_entropy_mask`), times ``is_weights`` (stale-policy IS), plus
    ``beta * KL`` with the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020), times ``r``
    when ``use_bias_correction_kl`` (DeepSeek-V3.2 unbiased KL; the un-``delta``-clamped ratio), plus
    ``distillation_token_loss`` when given (on-policy distillation's dense forward KL, already weighted).

    Aggregation over valid tokens (TRL ``loss_type``), then the gradient-accumulation scaling of TRL's
    train mode with ``steps_per_generation == gradient_accumulation_steps``, both read from the row
    ``settings.normalizer`` of :data:`~.normalizers.LOSS_NORMALIZERS`:

    - grpo, sapo: mean over sequences of the per-sequence token mean, ``/ gradient_accumulation_steps``.
    - bnpo: token mean over the micro-batch, ``/ gradient_accumulation_steps``.
    - dr_grpo: token sum ``/ (B * max_completion_length)``, ``/ gradient_accumulation_steps``.
    - dapo, cispo: token sum ``/ (num_items_in_batch / num_processes)``, i.e. after summing over the
      accumulation window and averaging over ranks (DDP), a global token mean.

    Args:
        logps: ``(B, T)`` current policy log-probs of the sampled tokens (nats), with grad.
        inputs: the micro-batch's loss inputs (:class:`~.inputs.LossInputs`: mask, advantages, ``old_logps``
            (None: ``logps.detach()``, ratio 1 as TRL on-policy), ``ref_logps``, ``is_weights``,
            ``sampling_logps``, ``entropy_mask``, ``kl_ratio_logps`` and the normalizers).
        settings: the loss options (``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``,
            ``importance_sampling_level``, ``beta``, ``use_bias_correction_kl``, ``off_policy_mask_threshold``,
            ``sapo_temperature_pos/neg``, ``max_completion_length`` are read).

    Returns:
        :class:`LossOutput`.

    Raises:
        ValueError: shape mismatch (also of ``entropy_mask`` / ``is_weights``), missing ``ref_logps``
            (beta != 0) or ``num_items_in_batch`` (dapo / cispo), non-positive accumulation / process counts,
            non-finite advantages. (Invalid options are refused when ``settings`` is built.)
    """
    loss_type, epsilon_low, epsilon_high = settings.loss_type, settings.epsilon, settings.epsilon_high
    delta, beta, off_policy_threshold = settings.delta, settings.beta, settings.off_policy_mask_threshold
    normalizer_row = settings.normalizer
    mask, advantages, old_logps, ref_logps = inputs.mask, inputs.advantages, inputs.old_logps, inputs.ref_logps
    is_weights, sampling_logps, entropy_mask = inputs.is_weights, inputs.sampling_logps, inputs.entropy_mask
    kl_ratio_logps, num_items_in_batch = inputs.kl_ratio_logps, inputs.num_items_in_batch
    gradient_accumulation_steps, num_processes = inputs.gradient_accumulation_steps, inputs.num_processes
    # ---- validation --------------------------------------------------------------------------------
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must share one (B, T) shape")
    batch = logps.shape[0]
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampling_logps", sampling_logps)):
        if t is not None and t.shape != logps.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logps shape {tuple(logps.shape)}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps")
    if normalizer_row.divides_by_tokens and num_items_in_batch is None:
        raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (active tokens in the accumulation window)")
    if not gradient_accumulation_steps > 0 or num_processes < 1:
        raise ValueError("gradient_accumulation_steps must be > 0 and num_processes >= 1")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    if advantages.shape not in ((batch, 1), tuple(logps.shape)):
        raise ValueError(
            f"advantages must be (B,), (B, 1) or (B, T) with (B, T)={tuple(logps.shape)}, got {tuple(advantages.shape)}"
        )
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf")
    if is_weights is not None and (is_weights.dim() != 2 or is_weights.shape[0] != batch):
        raise ValueError(f"is_weights must be (B, T) or (B, 1), got {tuple(is_weights.shape)}")
    if entropy_mask is not None and entropy_mask.shape != logps.shape:
        raise ValueError(f"entropy_mask shape {tuple(entropy_mask.shape)} != logps shape {tuple(logps.shape)}")
    distill = inputs.distillation_token_loss
    if distill is not None and distill.shape != logps.shape:
        raise ValueError(f"distillation_token_loss shape {tuple(distill.shape)} != logps shape {tuple(logps.shape)}")

    # ---- inputs, padding neutralised -----------------------------------------------------------------
    valid = mask.bool()  # (B, T)
    mask = mask.to(logps.dtype)  # (B, T) float
    logps = _masked_where(valid, logps)  # (B, T); grad flows only through valid tokens
    old_logps = logps.detach() if old_logps is None else _masked_where(valid, old_logps.detach())  # (B, T)

    if off_policy_threshold is not None:
        # OPSM reads the sampler's log-probs when available (trainer drift + sampler mismatch).
        opsm_ref = old_logps if sampling_logps is None else sampling_logps
        seq_advantages = advantages  # (B, 1); per-token advantages (distillation): their mean over valid tokens
        if advantages.shape[1] != 1:
            seq_advantages = (advantages * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        seq_keep = off_policy_mask(seq_advantages, logps, opsm_ref, valid, off_policy_threshold)  # (B, 1)

    log_ratio = logps - old_logps  # (B, T)
    if settings.importance_sampling_level == "token":
        log_importance_weights = log_ratio  # (B, T)
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        log_importance_weights = log_importance_weights.unsqueeze(-1)  # (B, 1)
    coef_1 = torch.exp(log_importance_weights)  # (B, T) or (B, 1)

    if beta != 0.0:
        ref = _masked_where(valid, ref_logps.detach())  # (B, T)
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1  # (B, T), k3 estimator
        if settings.use_bias_correction_kl and kl_ratio_logps is not None:  # pi_theta / pi_sampler, per token
            per_token_kl = per_token_kl * torch.exp(logps - _masked_where(valid, kl_ratio_logps.detach()))
        elif settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    # ---- per-token surrogate ---------------------------------------------------------------------
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * logps  # (B, T)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages  # (B, T) or (B, 1)
    else:  # grpo, bnpo, dr_grpo, dapo
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)  # (B, T) or (B, 1)

    if off_policy_threshold is not None:
        per_token_loss = per_token_loss * seq_keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask.detach().to(logps.dtype)  # (B, T)
    if is_weights is not None:
        per_token_loss = per_token_loss * _masked_where(valid, is_weights.detach().to(logps.dtype).expand_as(mask))
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl  # (B, T)
    if distill is not None:  # on-policy distillation's dense term, normalized as the KL term is
        per_token_loss = per_token_loss + _masked_where(valid, distill.to(logps.dtype))  # (B, T)

    # ---- aggregation and accumulation scaling (the loss_type's row of LOSS_NORMALIZERS) -----------
    loss = normalizer_row.aggregate(per_token_loss, mask, settings.max_completion_length)
    if normalizer_row.divides_by_tokens:  # num_items spans the accumulation window (TRL: * GAS / steps_per_gen == 1)
        num_items = torch.as_tensor(num_items_in_batch, dtype=logps.dtype, device=logps.device)
        normalizer = num_items.clamp(min=1.0) / num_processes
        loss = loss / normalizer
        policy_loss = loss.detach()
    else:  # divided by the micro-batches per optimizer step; policy_loss before the division
        policy_loss = loss.detach()
        loss = loss / gradient_accumulation_steps

    # ---- metrics (local to this micro-batch) -----------------------------------------------------
    with torch.no_grad():
        metrics: dict[str, float] = {"policy_loss": policy_loss.item()}
        if beta != 0.0:
            metrics["kl"] = _masked_mean(per_token_kl, mask)
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
            is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
            is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
            is_region_clipped = is_low_clipped | is_high_clipped
            metrics["clip_ratio/low_mean"] = _masked_mean(is_low_clipped.to(logps.dtype), mask)
            metrics["clip_ratio/high_mean"] = _masked_mean(is_high_clipped.to(logps.dtype), mask)
            metrics["clip_ratio/region_mean"] = _masked_mean(is_region_clipped.to(logps.dtype), mask)
        elif loss_type == "cispo":
            is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
            metrics["cispo_clip_ratio"] = _masked_mean(is_cispo_clipped.to(logps.dtype), mask)
        if off_policy_threshold is not None:  # fraction of this micro-batch's tokens whose sequence OPSM dropped
            metrics["opsm/masked_fraction"] = _masked_mean((1.0 - seq_keep.to(logps.dtype)).expand_as(mask), mask)
    return LossOutput(loss=loss, metrics=metrics)
