"""The GRPO objective: the one list of loss options, and the loss of one micro-batch.

:class:`LossSettings` is the only place the loss options are listed (TRL 1.16 ``GRPOConfig`` names);
:func:`~async_grpo.algorithms.grpo_loss` and :func:`~async_grpo.algorithms.fused_grpo_loss` read them from
it. :class:`GRPOObjective` composes one micro-batch's loss from the trainer's forward passes, in this order
(as TRL's ``_generate_and_score_completions`` + ``_compute_loss``):

1. pi_old: the cached rollout-reuse logprobs, else the current policy's, detached (ratio 1).
2. Replayed rows (``replay_recompute_logps``): their sampling logprobs become pi_old's, so their
   stale-policy IS weight is exactly 1 and OPSM sees no drift (trained as if on-policy).
   With ``off_policy_clip='behaviour'`` the ratio's denominator is the behaviour policy instead: vLLM's
   sampling logprobs replace pi_old, so the PPO clip bounds pi_theta / pi_vLLM (decoupled PPO with the
   proximal policy at the behaviour policy, as TRL's async GRPO), and no separate IS weight is applied.
3. Entropy mask (``top_entropy_quantile`` < 1): :func:`~async_grpo.algorithms.high_entropy_mask` over the
   micro-batch's valid tokens.
4. Stale-policy IS weights (``vllm_importance_sampling_*``): :func:`~async_grpo.algorithms.importance_sampling_weights`.
5. The loss with OPSM and KL: :func:`~async_grpo.algorithms.grpo_loss` on logprobs, or
   :func:`~async_grpo.algorithms.fused_grpo_loss` on hidden states (``use_liger_kernel``).

The trainer stays algorithm-blind: it runs the forward passes the objective asks for
(:attr:`GRPOObjective.needs_reference`, :attr:`GRPOObjective.wants_hidden_states`,
:attr:`GRPOObjective.temperature`), hands the tensors over, and backpropagates and logs what comes back.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens (right padded), ``H`` hidden size,
``V`` vocabulary. Log-probabilities and entropies in nats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from .entropy import high_entropy_mask
from .fused import LIGER_VERSION, fused_grpo_loss
from .losses import IS_LEVELS, LOSS_TYPES, TOKEN_SUM_LOSSES, LossOutput, grpo_loss
from .off_policy import IS_MODES, importance_sampling_weights, seq_logprob_error_mask

__all__ = ["KL_RATIOS", "OFF_POLICY_CLIPS", "GRPOObjective", "LossSettings", "MicroBatchInputs", "MicroBatchLoss"]

logger = logging.getLogger(__name__)

OFF_POLICY_CLIPS = ("current", "behaviour")  # LossSettings.off_policy_clip
KL_RATIOS = ("old", "sampler")  # LossSettings.kl_bias_correction_ratio


@dataclass(frozen=True)
class LossSettings:
    """The GRPO loss options, validated on construction (``ValueError`` naming the field and the fix).

    Names and defaults are TRL 1.16 ``GRPOConfig``'s unless noted; ``launch/local.py`` builds this from the
    run config. Ratios are ``pi_theta / pi_old`` per token (or per sequence) unless noted.

    Attributes:
        loss_type: loss aggregation, one of ``grpo`` (per-sequence token mean, DeepSeekMath), ``bnpo`` (token
            mean over the micro-batch), ``dr_grpo`` (token sum / (B x max_completion_length), Dr. GRPO),
            ``dapo`` (token mean over the accumulation window and ranks, DAPO), ``cispo`` (clipped IS weight
            times logp, MiniMax-M1 / ScaleRL), ``sapo`` (soft sigmoid gate, arXiv 2511.20347). TRL ``loss_type``.
        epsilon: lower clip range: the ratio is clipped at ``1 - epsilon`` (PPO; TRL ``epsilon``, liger's
            ``epsilon_low``). Unused by cispo and sapo. >= 0.
        epsilon_high: upper clip range, ratio <= ``1 + epsilon_high`` (DAPO clip-higher; TRL
            ``epsilon_high``); for cispo the cap eps_max on the ratio itself, >= 1 (ScaleRL recommends 5.0).
        beta: KL coefficient of the k3 estimator against the frozen initial policy (Schulman 2020; TRL
            ``beta``). 0 disables the KL and the reference model. >= 0.
        delta: two-sided clipping: the unclipped ratio branch is capped at ``delta`` (INTELLECT-2; TRL
            ``delta``), > 1; None disables it.
        importance_sampling_level: ``token`` (one ratio per token) or ``sequence`` (one per sequence, the
            exp of the mean token log-ratio: GSPO, arXiv 2507.18071). TRL ``importance_sampling_level``.
        use_bias_correction_kl: multiply the per-token KL by the ratio (DeepSeek-V3.2 unbiased KL; TRL
            ``use_bias_correction_kl``).
        off_policy_mask_threshold: OPSM (DeepSeek-V3.2, arXiv 2512.02556, eq. 9): drop a sequence whose
            advantage is negative and whose mean per-token ``sampling logp - current logp`` (nats per token)
            exceeds this, > 0; None disables it. TRL ``off_policy_mask_threshold``.
        sapo_temperature_pos: SAPO gate temperature for advantages > 0, > 0 (TRL name).
        sapo_temperature_neg: SAPO gate temperature for advantages <= 0, > 0 (TRL name).
        max_completion_length: completion tokens per sample at most (TRL name); dr_grpo's ``L``. >= 1.
        mask_truncated_completions: completions that hit ``max_completion_length`` get loss mask 0 (DAPO
            overlong filtering; TRL name). Read when the batch is packed, not by the loss.
        vllm_importance_sampling_correction: weight each token by the stale-policy ratio
            ``rho = exp(pi_old logp - vLLM sampling logp)`` (TRL name).
        vllm_importance_sampling_mode: how rho is bounded: ``token_truncate``, ``token_mask``,
            ``sequence_truncate`` or ``sequence_mask`` (truncated IS, Ionides 2008; masked IS, Yao et al.
            2025; TRL name).
        vllm_importance_sampling_cap: upper bound on rho, > 0 (TRL ``vllm_importance_sampling_cap`` /
            ``_clip_max``).
        vllm_importance_sampling_clip_min: lower bound on rho, in ``[0, cap)``, or None (TRL name).
        top_entropy_quantile: rho of "Beyond the 80/20 Rule" (arXiv 2506.01939; TRL name): keep the policy
            term only on the micro-batch's top ``top_entropy_quantile`` fraction of valid tokens by entropy.
            In ``[0, 1]``; 1 keeps every token.
        replay_recompute_logps: for rows of replayed groups, use pi_old's logprobs as the sampling logprobs
            (IS weight 1, no OPSM drift); False keeps vLLM's, so IS corrects their real staleness (axolotl name).
        temperature: sampling temperature, > 0. The trainer divides its logits by it (TRL), so its logprobs
            compare with vLLM's processed sampling logprobs.
        use_liger_kernel: compute the loss with liger-kernel's fused linear GRPO loss on the decoder hidden
            states (no (B, T, V) logits; axolotl / TRL name). Not with sequence-level cispo or sapo (liger
            0.8.5).
        off_policy_clip: which policy the PPO ratio is taken against (this dataclass defaults to ``current``, the
            TRL GRPOTrainer semantics its parity tests check; the run config defaults to ``behaviour``, which
            learned at least as well on the demo at max_staleness 4, docs/algorithms.md). ``current``: pi_old is
            the trainer's own policy before the step (TRL's GRPOTrainer): with one optimizer step per batch the
            ratio is 1 and the clip never acts; staleness is handled by the truncated IS weight alone.
            ``behaviour``: the policy that sampled (vLLM's logprobs; TRL's AsyncGRPOTrainer, decoupled PPO of
            Hilton et al. 2022 with the proximal policy at the behaviour policy): the ratio pi_theta / pi_vLLM is
            clipped to
            ``[1 - epsilon, 1 + epsilon_high]``, so a stale token whose ratio left the trust region stops
            pushing, and the IS weight is not applied on top (the ratio already is the IS correction).
        kl_bias_correction_ratio: with ``use_bias_correction_kl``, the ratio the k3 KL is multiplied by:
            ``old`` = pi_theta / pi_old (TRL), ``sampler`` = pi_theta / pi_vLLM (DeepSeek-V3.2's unbiased KL
            against the policy that actually sampled the tokens).
        seq_logprob_error_threshold: NeMo RL's sequence gate: the policy term of a sequence whose mean over tokens
            of exp(|pi_old logp - vLLM logp|) exceeds this (> 1) is masked like OPSM's (KL and denominators
            kept); None only measures (`off_policy.seq_logprob_error_mask`).
    """

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    delta: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    max_completion_length: int = 16
    mask_truncated_completions: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    vllm_importance_sampling_cap: float = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    top_entropy_quantile: float = 1.0
    replay_recompute_logps: bool = True
    temperature: float = 1.0
    use_liger_kernel: bool = False
    off_policy_clip: str = "current"
    kl_bias_correction_ratio: str = "old"
    seq_logprob_error_threshold: float | None = None

    def __post_init__(self) -> None:
        """Refuse unknown names and out-of-range values.

        Raises:
            ValueError: the message starts with ``field=value`` and ends with ``Fix: ...``.
        """
        for name, choices in (
            ("loss_type", LOSS_TYPES),
            ("importance_sampling_level", IS_LEVELS),
            ("vllm_importance_sampling_mode", IS_MODES),
            ("off_policy_clip", OFF_POLICY_CLIPS),
            ("kl_bias_correction_ratio", KL_RATIOS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}. Fix: pick one of them.")
        cap, clip_min = self.vllm_importance_sampling_cap, self.vllm_importance_sampling_clip_min
        checks = (  # (field, holds, requirement and fix)
            ("epsilon", self.epsilon >= 0, "must be >= 0. Fix: use e.g. 0.2"),
            ("epsilon_high", self.epsilon_high >= 0, "must be >= 0. Fix: use e.g. 0.28 (DAPO)"),
            ("beta", self.beta >= 0, "must be >= 0. Fix: use 0 (no KL) or e.g. 0.04"),
            (
                "delta",
                self.delta is None or self.delta > 1,
                "must be > 1. Fix: use a value above 1 + epsilon (TRL's advice; INTELLECT-2 uses 4), or None",
            ),
            (
                "off_policy_mask_threshold",
                self.off_policy_mask_threshold is None or self.off_policy_mask_threshold > 0,
                "must be > 0 (nats per token). Fix: use e.g. 0.5, or None to disable OPSM",
            ),
            ("sapo_temperature_pos", self.sapo_temperature_pos > 0, "must be > 0. Fix: use TRL's 1.0"),
            ("sapo_temperature_neg", self.sapo_temperature_neg > 0, "must be > 0. Fix: use TRL's 1.05"),
            ("max_completion_length", self.max_completion_length >= 1, "must be >= 1. Fix: set the generation limit"),
            ("vllm_importance_sampling_cap", cap > 0, "must be > 0. Fix: use TRL's 3.0"),
            (
                "vllm_importance_sampling_clip_min",
                clip_min is None or 0 <= clip_min < cap,
                f"must be in [0, vllm_importance_sampling_cap={cap}). Fix: lower it, raise the cap, or use None",
            ),
            (
                "top_entropy_quantile",
                0 <= self.top_entropy_quantile <= 1,
                "must be in [0, 1]. Fix: use 1.0 (every token) or the paper's 0.2",
            ),
            ("temperature", self.temperature > 0, "must be > 0. Fix: use the sampling temperature, e.g. 1.0"),
            (
                "seq_logprob_error_threshold",
                self.seq_logprob_error_threshold is None or self.seq_logprob_error_threshold > 1,
                "must be > 1 (a ratio of probabilities). Fix: e.g. 2.0, or None",
            ),
            (
                "epsilon_high",
                self.loss_type != "cispo" or self.epsilon_high >= 1,
                "must be >= 1 with loss_type='cispo': it caps the ratio itself (eps_max, ScaleRL arXiv 2510.13786), so "
                "every on-policy ratio of 1 would be clamped. Fix: use e.g. 5.0 (ScaleRL's and TRL's recommendation)",
            ),
            (
                "importance_sampling_level",
                not (
                    self.use_liger_kernel
                    and self.importance_sampling_level == "sequence"
                    and self.loss_type in ("cispo", "sapo")
                ),
                f"is not available with use_liger_kernel and loss_type={self.loss_type!r} (liger-kernel "
                f"{LIGER_VERSION}). Fix: use importance_sampling_level='token' or use_liger_kernel=False",
            ),
            (
                "kl_bias_correction_ratio",
                not (
                    self.use_liger_kernel
                    and self.beta > 0
                    and self.off_policy_clip == "current"
                    and self.kl_bias_correction_ratio == "sampler"
                ),
                "is not available with use_liger_kernel (liger corrects the KL by pi_theta / pi_old only). Fix: use "
                "off_policy_clip='behaviour' (then pi_old is the sampler), kl_bias_correction_ratio='old', or "
                "use_liger_kernel=False",
            ),
        )
        for name, holds, requirement in checks:
            if not holds:
                raise ValueError(f"{name}={getattr(self, name)!r} {requirement}.")


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


@dataclass
class MicroBatchLoss:
    """Result of :meth:`GRPOObjective.micro_batch_loss`.

    Attributes:
        output: the loss (0-d, with grad, already scaled for accumulation: call ``output.loss.backward()``)
            and the loss function's own metrics.
        metrics: every per-micro-batch metric to log, in the order the trainer reports them: the stale-policy
            IS metrics (``sampling/...``, with the correction on), ``output.metrics`` (``policy_loss``, ``kl``,
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

    def normalizer_scale(self, num_items_in_batch: float, gradient_accumulation_steps: int) -> float:
        """The factor that turns losses computed with unit normalizers into the normalized ones.

        Streaming learns the normalizers only after the last micro-batch: its micro-batches are computed with
        ``num_items_in_batch=1`` and ``gradient_accumulation_steps=1``; multiplying their summed gradients by
        this factor gives those of the real normalizers (dapo / cispo: ``1 / num_items_in_batch``; the others:
        ``1 / gradient_accumulation_steps``; each clamped at 1 as in ``grpo_loss``).
        """
        if self.settings.loss_type in TOKEN_SUM_LOSSES:
            return 1.0 / max(num_items_in_batch, 1.0)
        return 1.0 / max(gradient_accumulation_steps, 1)

    def normalize_streamed_metrics(self, metrics: dict[str, float], num_items_in_batch: float) -> dict[str, float]:
        """A streamed step's averaged micro-batch metrics, on the scale of the unstreamed step: for dapo / cispo
        ``policy_loss`` was each micro-batch's token *sum* (``num_items_in_batch=1``), so it is divided by the
        step's token count here; the other loss types' ``policy_loss`` does not depend on the normalizers.

        Args:
            metrics: token-weighted means of the micro-batches' metrics.
            num_items_in_batch: the step's loss tokens.

        Returns:
            A new dict.
        """
        out = dict(metrics)
        if self.settings.loss_type in TOKEN_SUM_LOSSES and "policy_loss" in out:
            out["policy_loss"] /= max(num_items_in_batch, 1.0)
        return out

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
        per_call = dict(
            ref_logps=inputs.ref_logps, is_weights=is_weights, sampling_logps=sampling_logps,
            entropy_mask=policy_mask, num_items_in_batch=num_items_in_batch,
            gradient_accumulation_steps=gradient_accumulation_steps, num_processes=num_processes,
        )  # fmt: skip
        if s.use_liger_kernel:
            if inputs.hidden is None or inputs.lm_head is None or inputs.completion_ids is None:
                raise ValueError(
                    "use_liger_kernel=True needs MicroBatchInputs.hidden, lm_head and completion_ids "
                    "(the fused loss applies the LM head itself). Fix: pass them when "
                    "objective.wants_hidden_states."
                )
            fused_old = ratio_old if s.off_policy_clip == "behaviour" else inputs.old_logps
            output = fused_grpo_loss(
                inputs.hidden,
                inputs.lm_head,
                inputs.completion_ids,
                mask,
                inputs.advantages,
                fused_old,
                s,
                current_logps=inputs.logps,
                **per_call,
            )
        else:
            kl_ratio = behaviour if s.kl_bias_correction_ratio == "sampler" else None
            output = grpo_loss(inputs.logps, ratio_old, inputs.advantages, mask, s, kl_ratio_logps=kl_ratio, **per_call)
        metrics.update(output.metrics)
        if s.seq_logprob_error_threshold is not None:
            metrics.update(mismatch)
        tokens = mask.sum().clamp(min=1)
        metrics["entropy"] = float((inputs.entropies * mask).sum() / tokens)
        if entropy_mask is not None:
            metrics["entropy_mask/kept_fraction"] = float(entropy_mask.sum() / tokens)
        return MicroBatchLoss(output=output, metrics=metrics, weight=float(mask.sum()))
