"""The GRPO objective: the loss of one micro-batch, composed from the trainer's forward passes.

The loss options are listed once, in :class:`~.settings.LossSettings` (TRL 1.16 ``GRPOConfig`` names);
:func:`~async_grpo.algorithms.grpo_loss` and :func:`~async_grpo.algorithms.fused_grpo_loss` read them from
it and take their per-call tensors as one :class:`~.inputs.LossInputs`. :class:`GRPOObjective` composes one
micro-batch's loss, in this order (as TRL's ``_generate_and_score_completions`` + ``_compute_loss``):

1. pi_old: the cached rollout-reuse logprobs, else the current policy's, detached (ratio 1).
2. Replayed rows (``replay_recompute_logps``): their sampling logprobs become pi_old's, so their
   stale-policy IS weight is exactly 1 and OPSM sees no drift (trained as if on-policy).
   With ``off_policy_clip='behaviour'`` the ratio's denominator is the behaviour policy instead: vLLM's
   sampling logprobs replace pi_old, so the PPO clip bounds pi_theta / pi_vLLM (decoupled PPO with the
   proximal policy at the behaviour policy, as TRL's async GRPO), and no separate IS weight is applied.
3. Entropy mask (``top_entropy_quantile`` < 1): :func:`~async_grpo.algorithms.high_entropy_mask` over the
   micro-batch's valid tokens.
4. Stale-policy IS weights (``vllm_importance_sampling_*``): :func:`~async_grpo.algorithms.importance_sampling_weights`.
5. On-policy distillation (``distillation_weight`` > 0, a teacher's logprobs given): with ``distillation_loss:
   reverse_kl`` each token's advantage becomes the completion's GRPO advantage (left out with ``distillation_only``)
   plus :func:`~async_grpo.algorithms.distillation_advantages` of pi_old against the teacher, a ``(B, T)`` advantage;
   with ``forward_kl`` the advantage stays the GRPO one (zero with ``distillation_only``) and
   :func:`~async_grpo.algorithms.distillation.topk_forward_kl` over the teacher's top-k joins the per-token loss.
6. The loss with OPSM and KL: :func:`~async_grpo.algorithms.grpo_loss` on logprobs, or
   :func:`~async_grpo.algorithms.fused_grpo_loss` on hidden states (``use_liger_kernel``).

The trainer stays algorithm-blind: it runs the forward passes the objective asks for
(:attr:`GRPOObjective.needs_reference`, :attr:`GRPOObjective.wants_hidden_states`,
:attr:`GRPOObjective.temperature`), hands the tensors over, backpropagates and logs what comes back, and reads
the step's normalizer from :attr:`GRPOObjective.normalizer` (a row of :data:`~.normalizers.LOSS_NORMALIZERS`).

Imports run one way: :mod:`.settings`, :mod:`.inputs` and :mod:`.normalizers` import no loss module;
:mod:`.losses` imports them; :mod:`.fused` imports :mod:`.losses`; this module imports all of them.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens (right padded), ``H`` hidden size,
``V`` vocabulary. Log-probabilities and entropies in nats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from .distillation import distillation_advantages, topk_forward_kl
from .entropy import high_entropy_mask
from .fused import fused_grpo_loss
from .inputs import LossInputs
from .losses import LossOutput, grpo_loss
from .normalizers import LossNormalizer
from .off_policy import importance_sampling_weights, seq_logprob_error_mask
from .settings import LossSettings

__all__ = ["GRPOObjective", "MicroBatchInputs", "MicroBatchLoss"]

logger = logging.getLogger(__name__)


@dataclass
class MicroBatchInputs:
    """One micro-batch as the trainer's forward passes leave it: the input of
    :meth:`GRPOObjective.micro_batch_loss`.

    Attributes:
        logps: (B, T) current-policy logprobs of the sampled tokens at ``temperature`` (nats): with grad on the
            plain path, detached on the fused path (there the gradient flows through ``hidden``).
        entropies: (B, T) current-policy entropies of the next-token distribution (nats), no grad.
        mask: (B, T) loss mask, 1 on trained tokens, 0 on padding / masked tokens.
        advantages: (B,) one advantage per completion.
        sampling_logps: (B, T) vLLM's logprobs of the sampled tokens (nats; anything at padding).
        replayed: (B,) bool, True on rows of replayed groups; None when nothing is replayed.
        old_logps: (B, T) cached pi_old logprobs (rollout reuse), or None for the current policy (ratio 1).
        ref_logps: (B, T) reference-model logprobs; required when ``needs_reference``.
        hidden: (B, T, H) decoder hidden states predicting the completion tokens, with grad; fused path only.
        lm_head: the output projection (``weight`` (V, H)); fused path only.
        completion_ids: (B, T) sampled token ids; fused path only.
        teacher_logps: (B, T) the teacher's logprobs of the sampled tokens (nats, temperature 1; NaN where it gave
            none), read when ``distillation_weight`` > 0; None: no teacher.
        teacher_baselines: (B,) each row's distillation baseline (nats per token,
            :func:`~async_grpo.algorithms.distillation.group_baselines`), subtracted when
            ``distillation_baseline``; None: none.
        topk_logps: (B, T, K) current-policy logprobs of the teacher's top-k tokens at each position (nats, with
            grad), read with ``distillation_loss='forward_kl'``; None: no top-k.
        teacher_topk_logps: (B, T, K) the teacher's logprobs of the same tokens (NaN where none); None: no top-k.
    """

    logps: Tensor
    entropies: Tensor
    mask: Tensor
    advantages: Tensor
    sampling_logps: Tensor
    replayed: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    hidden: Tensor | None = None
    lm_head: torch.nn.Module | None = None
    completion_ids: Tensor | None = None
    teacher_logps: Tensor | None = None
    teacher_baselines: Tensor | None = None
    topk_logps: Tensor | None = None
    teacher_topk_logps: Tensor | None = None


@dataclass
class MicroBatchLoss:
    """Result of :meth:`GRPOObjective.micro_batch_loss`.

    Attributes:
        output: the loss (0-d, with grad, already scaled for accumulation: call ``output.loss.backward()``)
            and the loss function's own metrics.
        metrics: every per-micro-batch metric to log, in the order the trainer reports them: the stale-policy
            IS metrics (``sampling/...``, with the correction on), the distillation metrics (``distill/...``, with
            a teacher), ``output.metrics`` (``policy_loss``, ``kl``,
            clip ratios, ``opsm/masked_fraction``), ``entropy`` (mean over valid tokens) and
            ``entropy_mask/kept_fraction`` (with ``top_entropy_quantile`` < 1).
        weight: valid (mask) tokens in the micro-batch: the weight of ``metrics`` in the step's average.
    """

    output: LossOutput
    metrics: dict[str, float]
    weight: float


class GRPOObjective:
    """The per-micro-batch GRPO loss from :class:`LossSettings` (see the module docstring for the order).

    Args:
        settings: the loss options.
    """

    def __init__(self, settings: LossSettings):
        self.settings = settings
        if settings.importance_sampling_level == "sequence" and settings.loss_type in (
            "bnpo",
            "dr_grpo",
            "dapo",
            "cispo",
        ):
            logger.warning(  # TRL 1.16 GRPOTrainer warns the same
                "importance_sampling_level='sequence' with loss_type=%r sums per-token contributions, which weights "
                "each sequence by its completion length instead of optimizing the per-sequence objective. To reproduce "
                "the GSPO paper's setup, set loss_type='grpo'.",
                settings.loss_type,
            )

    @property
    def needs_reference(self) -> bool:
        """True when the loss has a KL term (``beta > 0``): the trainer keeps a frozen reference model and
        passes its logprobs as ``ref_logps``."""
        return self.settings.beta > 0

    @property
    def wants_hidden_states(self) -> bool:
        """True on the fused path (``use_liger_kernel``): the trainer passes ``hidden``, ``lm_head`` and
        ``completion_ids`` with detached ``logps``, instead of ``logps`` with grad."""
        return self.settings.use_liger_kernel

    @property
    def temperature(self) -> float:
        """The divisor of every logit the trainer scores (policy, pi_old, reference): the sampling temperature."""
        return self.settings.temperature

    @property
    def normalizer(self) -> LossNormalizer:
        """How the loss is normalized: the ``loss_type``'s row of :data:`~.normalizers.LOSS_NORMALIZERS`. The
        trainer reads from it the streamed step's gradient factor (:meth:`~.normalizers.LossNormalizer.streamed_scale`)
        and metrics (:meth:`~.normalizers.LossNormalizer.streamed_metrics`), and whether it may order the
        completions by length (:attr:`~.normalizers.LossNormalizer.cut_invariant`)."""
        return self.settings.normalizer

    def micro_batch_loss(
        self,
        inputs: MicroBatchInputs,
        *,
        num_items_in_batch: Tensor | float | int | None,
        gradient_accumulation_steps: float = 1,
        num_processes: int = 1,
    ) -> MicroBatchLoss:
        """The loss and metrics of one micro-batch.

        Args:
            inputs: the micro-batch's tensors (shapes in :class:`MicroBatchInputs`).
            num_items_in_batch: valid tokens of the whole accumulation window summed over the ranks (dapo /
                cispo normalizer), as in ``grpo_loss``.
            gradient_accumulation_steps: micro-batches per optimizer step (> 0; with several ranks the real
                micro-batches of all ranks / world size, which may be fractional when shares are unequal).
            num_processes: data-parallel ranks (>= 1).

        Returns:
            :class:`MicroBatchLoss`.

        Raises:
            ValueError: the fused path without ``hidden`` / ``lm_head`` / ``completion_ids``, ``ref_logps``
                missing with ``beta > 0``, and everything ``grpo_loss`` / ``fused_grpo_loss`` reject.
        """
        s, mask = self.settings, inputs.mask
        old = inputs.logps.detach() if inputs.old_logps is None else inputs.old_logps  # (B, T)
        sampling_logps = inputs.sampling_logps
        if s.replay_recompute_logps and inputs.replayed is not None and bool(inputs.replayed.any()):
            sampling_logps = torch.where(inputs.replayed.unsqueeze(1), old, sampling_logps)  # replayed: on-policy
        entropy_mask = None
        if s.top_entropy_quantile < 1.0:  # quantile over this micro-batch's valid tokens (TRL, one rank)
            entropy_mask = high_entropy_mask(inputs.entropies, mask, s.top_entropy_quantile)  # (B, T) bool
        metrics: dict[str, float] = {}
        policy_mask = entropy_mask
        if s.seq_logprob_error_threshold is not None:  # masked sequences lose their policy term, as with OPSM
            keep, mismatch = seq_logprob_error_mask(old, sampling_logps, mask, s.seq_logprob_error_threshold)
            rows = keep.unsqueeze(1).expand_as(mask)
            policy_mask = rows if entropy_mask is None else entropy_mask & rows
        is_weights = None
        if s.vllm_importance_sampling_correction:
            is_weights, is_metrics = importance_sampling_weights(
                old,
                sampling_logps,
                mask,
                s.vllm_importance_sampling_mode,
                s.vllm_importance_sampling_cap,
                s.vllm_importance_sampling_clip_min,
            )  # (B, T)
            metrics.update(is_metrics)  # logged in both modes: how far the sampler drifted from pi_old
        behaviour = torch.where(torch.isnan(sampling_logps), old, sampling_logps)  # (B, T) unscorable: ratio 1
        ratio_old = old
        if s.off_policy_clip == "behaviour":  # the clipped ratio is pi_theta / pi_vLLM: it is the IS correction
            ratio_old, is_weights = behaviour, None
        if s.use_liger_kernel:
            if inputs.hidden is None or inputs.lm_head is None or inputs.completion_ids is None:
                raise ValueError(
                    "use_liger_kernel=True needs MicroBatchInputs.hidden, lm_head and completion_ids "
                    "(the fused loss applies the LM head itself). Fix: pass them when "
                    "objective.wants_hidden_states."
                )
            # liger corrects the KL by its policy ratio only, so no kl_ratio_logps: with 'behaviour' that ratio is
            # against the sampler anyway, and LossSettings refuses 'sampler' with 'current' when beta > 0
            old_logps, kl_ratio = (ratio_old if s.off_policy_clip == "behaviour" else inputs.old_logps), None
        else:
            old_logps = ratio_old
            kl_ratio = behaviour if s.kl_bias_correction_ratio == "sampler" else None
        advantages, distill_loss = self._distillation(inputs, old, metrics)
        loss_inputs = LossInputs(
            mask=mask, advantages=advantages, old_logps=old_logps, ref_logps=inputs.ref_logps,
            is_weights=is_weights, sampling_logps=sampling_logps, entropy_mask=policy_mask, kl_ratio_logps=kl_ratio,
            num_items_in_batch=num_items_in_batch, gradient_accumulation_steps=gradient_accumulation_steps,
            num_processes=num_processes, distillation_token_loss=distill_loss,
        )  # fmt: skip
        if s.use_liger_kernel:
            output = fused_grpo_loss(
                inputs.hidden, inputs.lm_head, inputs.completion_ids, loss_inputs, s, current_logps=inputs.logps
            )
        else:
            output = grpo_loss(inputs.logps, loss_inputs, s)
        metrics.update(output.metrics)
        if s.seq_logprob_error_threshold is not None:
            metrics.update(mismatch)
        tokens = mask.sum().clamp(min=1)
        metrics["entropy"] = float((inputs.entropies * mask).sum() / tokens)
        if entropy_mask is not None:
            metrics["entropy_mask/kept_fraction"] = float(entropy_mask.sum() / tokens)
        return MicroBatchLoss(output=output, metrics=metrics, weight=float(mask.sum()))

    def _distillation(
        self, inputs: MicroBatchInputs, old: Tensor, metrics: dict[str, float]
    ) -> tuple[Tensor, Tensor | None]:
        """The advantages ((B,), or (B, T) with the sampled-token term) and the dense per-token loss term ((B, T) or
        None) of on-policy distillation (step 5 of the module docstring); `inputs.advantages` and None when the
        micro-batch has no teacher. Adds the `distill/...` metrics to `metrics`.

        Raises:
            ValueError: ``forward_kl`` with a teacher but no top-k logprobs (the trainer scores them when the batch
                carries `teacher_topk_ids`; a teacher answer without them would train nothing).
        """
        s, mask, advantages = self.settings, inputs.mask, inputs.advantages
        if not (s.distillation_weight > 0 and inputs.teacher_logps is not None):
            return advantages, None
        grpo = torch.zeros_like(advantages) if s.distillation_only else advantages
        baselines = inputs.teacher_baselines if s.distillation_baseline else None
        sampled = distillation_advantages(old, inputs.teacher_logps, mask, s.distillation_weight, baselines)
        metrics.update(sampled.metrics)  # distill/reverse_kl is logged by either loss
        if s.distillation_loss == "reverse_kl":  # (B, T): each token its own advantage
            return grpo.reshape(-1, 1).to(sampled.advantages.dtype) + sampled.advantages, None
        if inputs.topk_logps is None or inputs.teacher_topk_logps is None:
            raise ValueError(
                "distillation_loss='forward_kl' needs MicroBatchInputs.topk_logps and teacher_topk_logps (the "
                "teacher's top-k, RolloutGroup.teacher_topk_ids). Fix: ask the teacher for distillation_topk > 0."
            )
        dense = topk_forward_kl(inputs.topk_logps, inputs.teacher_topk_logps, mask, s.distillation_weight)
        metrics.update(dense.metrics)
        return grpo, dense.per_token
