"""The GRPO loss options, listed once: :class:`LossSettings` (TRL 1.16 ``GRPOConfig`` names), validated on
construction.

Every loss path reads them from here: :func:`~.losses.grpo_loss`, :func:`~.fused.fused_grpo_loss` and
:class:`~.objective.GRPOObjective`. This module imports only the leaves it validates against
(:mod:`.normalizers` for ``loss_type``, :mod:`.off_policy` for the IS modes); nothing here imports a loss, so
the loss modules can import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from .normalizers import LOSS_NORMALIZERS, LOSS_TYPES, LossNormalizer
from .off_policy import IS_MODES

__all__ = [
    "DISTILLATION_LOSSES",
    "IS_LEVELS",
    "KL_RATIOS",
    "LIGER_VERSION",
    "LOSS_TYPES",
    "OFF_POLICY_CLIPS",
    "LossSettings",
]

LIGER_VERSION = "0.8.5"  # the liger-kernel release whose fused GRPO loss `fused.py` maps onto (pinned in the gpu extra)
IS_LEVELS = ("token", "sequence")  # LossSettings.importance_sampling_level
OFF_POLICY_CLIPS = ("current", "behaviour")  # LossSettings.off_policy_clip
KL_RATIOS = ("old", "sampler")  # LossSettings.kl_bias_correction_ratio
DISTILLATION_LOSSES = ("reverse_kl", "forward_kl")  # LossSettings.distillation_loss


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
            Its normalizer is the row :data:`~.normalizers.LOSS_NORMALIZERS` [loss_type] (:attr:`normalizer`).
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
        distillation_weight: on-policy distillation (the run config's ``distillation`` section): each trained token
            the teacher scored gains the advantage ``distillation_weight * (log p_teacher - log p_student)``
            (:func:`~.distillation.distillation_advantages`; Tinker's ``kl_penalty_coef``). 0 (the default): no
            distillation, the teacher's logprobs are not read. >= 0.
        distillation_baseline: subtract each row's leave-one-out group baseline from its distillation advantage
            (:func:`~.distillation.group_baselines`: unbiased, lower variance); False: Tinker's plain advantage.
        distillation_only: leave the GRPO advantage out, so the teacher's signal is the whole advantage (run config
            ``distillation_only``). Needs ``distillation_weight`` > 0.
        distillation_loss: ``reverse_kl`` (the per-token advantage above, from the sampled tokens) or ``forward_kl``
            (the dense term :func:`~.distillation.topk_forward_kl` over the teacher's top-k, ``distillation_weight``
            times it added to the per-token loss; the sampled-token advantage is then not added). Run config
            ``distillation_loss``.
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
    distillation_weight: float = 0.0
    distillation_baseline: bool = True
    distillation_only: bool = False
    distillation_loss: str = "reverse_kl"

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
        checks += (
            (
                "distillation_loss",
                self.distillation_loss in DISTILLATION_LOSSES,
                f"is not one of {DISTILLATION_LOSSES}. Fix: use reverse_kl (sampled tokens) or forward_kl (top-k)",
            ),
            ("distillation_weight", self.distillation_weight >= 0, "must be >= 0. Fix: use e.g. 1.0, or 0 for none"),
            (
                "distillation_only",
                not self.distillation_only or self.distillation_weight > 0,
                "needs distillation_weight > 0 (there would be no advantage at all). Fix: set distillation_weight",
            ),
            (
                "distillation_weight",
                not (self.use_liger_kernel and self.distillation_weight > 0),
                "is not available with use_liger_kernel (the fused loss takes one advantage per completion). Fix: "
                "use_liger_kernel=False",
            ),
        )
        for name, holds, requirement in checks:
            if not holds:
                raise ValueError(f"{name}={getattr(self, name)!r} {requirement}.")

    @property
    def normalizer(self) -> LossNormalizer:
        """How ``loss_type`` normalizes the per-token losses: its row of :data:`~.normalizers.LOSS_NORMALIZERS`
        (micro-batch aggregation, step divisor, whether the micro-batch cut matters, source)."""
        return LOSS_NORMALIZERS[self.loss_type]
