"""The per-call inputs of a GRPO loss, in one record: :class:`LossInputs`.

Both loss paths take it: :func:`~.losses.grpo_loss` (the reference, on per-token logprobs) and
:func:`~.fused.fused_grpo_loss` (liger's fused linear loss, on hidden states). Each takes its own policy
output first (``logps`` with grad, or ``hidden`` + ``lm_head`` + ``completion_ids``), then this record, then
the static options (:class:`~.settings.LossSettings`). The fields are keyword-only, so no call can swap two
same-shaped tensors by position. This module imports nothing of the package: every loss module can import it.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens (right padded). Log-probabilities are
natural logs (nats) of the sampled tokens' probabilities at the sampling temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["LossInputs"]


@dataclass(frozen=True, kw_only=True, eq=False)
class LossInputs:
    """Everything a GRPO loss needs for one micro-batch besides the policy's own output and the options.

    Padding (``mask == 0``) may hold anything, NaN and inf included, in every per-token field: the losses
    never let it reach a sum or a gradient. Tensors are detached by the losses (no gradient flows into any
    field but ``distillation_token_loss``, which is a loss term of its own). Validation (shapes, finiteness, required fields) happens in the loss functions, which raise
    ``ValueError`` naming the field.

    Attributes:
        mask: ``(B, T)`` loss mask, any dtype (bool / int / float): 1 on trained tokens, 0 on padding, tool
            output (``RolloutGroup.loss_mask``) and truncated completions with ``mask_truncated_completions``.
        advantages: ``(B,)`` or ``(B, 1)`` one advantage per completion (reward units after the group
            baseline and scaling, :func:`~.advantages.compute_advantages`), or ``(B, T)`` one per token (on-policy
            distillation, :func:`~.distillation.distillation_advantages` added to the completion's); must be finite.
        old_logps: ``(B, T)`` log-denominator of the policy ratio ``exp(logps - old_logps)`` (nats): pi_old
            (the trainer's policy before this optimizer step, or cached for rollout reuse), or vLLM's sampling
            logprobs with ``off_policy_clip='behaviour'``; None for the current policy detached (ratio exactly 1,
            as TRL on-policy).
        ref_logps: ``(B, T)`` frozen reference-model logprobs (nats) for the k3 KL; required when
            ``settings.beta != 0``.
        is_weights: ``(B, T)`` or ``(B, 1)`` stale-policy importance weights (dimensionless, >= 0,
            :func:`~.off_policy.importance_sampling_weights`) multiplying the policy term; None for none.
        sampling_logps: ``(B, T)`` vLLM's sampling logprobs (nats), read by OPSM
            (``settings.off_policy_mask_threshold``); None falls back to ``old_logps``.
        entropy_mask: ``(B, T)`` bool / 0-1 mask of the tokens whose policy term is kept (``top_entropy_quantile``,
            :func:`~.entropy.high_entropy_mask`, and NeMo RL's sequence gate); None keeps all. It multiplies the
            policy term only, not the KL and not the normalizer counts (TRL).
        kl_ratio_logps: ``(B, T)`` log-denominator of the KL bias-correction ratio (nats; with
            ``settings.use_bias_correction_kl``): the KL is multiplied by ``exp(logps - kl_ratio_logps)``
            (DeepSeek-V3.2's unbiased KL against the sampler, ``kl_bias_correction_ratio='sampler'``). None
            multiplies by the policy ratio (TRL). The fused path cannot apply it (liger corrects by the policy
            ratio only) and refuses it.
        num_items_in_batch: loss tokens (mask sum) of the whole accumulation window summed over the ranks: the
            step divisor of the ``"tokens"`` normalizers (dapo, cispo; :mod:`.normalizers`), required there.
            A number or a 0-d tensor.
        gradient_accumulation_steps: micro-batches per optimizer step, > 0: the step divisor of the
            ``"micro_batches"`` normalizers (grpo, bnpo, dr_grpo, sapo). Fractional over ranks with unequal
            shares (all ranks' micro-batches / num_processes) or under a token budget (the step's completions
            per rank / this micro-batch's completions).
        num_processes: data-parallel ranks, >= 1 (the tokens divisor is ``num_items_in_batch / num_processes``).
        distillation_token_loss: ``(B, T)`` a per-token loss term with its own gradient (nats; on-policy
            distillation's dense forward KL, :func:`~.distillation.topk_forward_kl`), added to the per-token loss
            after the IS weights and masks, as the ``beta`` KL term is (TRL), then aggregated and normalized with it;
            None: none.
    """

    mask: Tensor
    advantages: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    is_weights: Tensor | None = None
    sampling_logps: Tensor | None = None
    entropy_mask: Tensor | None = None
    kl_ratio_logps: Tensor | None = None
    num_items_in_batch: Tensor | float | int | None = None
    gradient_accumulation_steps: float = 1
    num_processes: int = 1
    distillation_token_loss: Tensor | None = None
