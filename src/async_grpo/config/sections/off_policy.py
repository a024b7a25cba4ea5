"""The `off_policy` section: how rollouts sampled by an older policy (or with vLLM's numerics) are corrected: the
vLLM importance-sampling weight and how it is bounded (`ISMode`), OPSM, NeMo RL's sequence-level mismatch gate,
the policy the PPO ratio is taken against, the ratio of the bias-corrected KL, and the staleness bound."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class OffPolicyConfig(Section):
    """Correction of stale rollouts: vLLM importance-sampling weights, OPSM, and the staleness bound."""

    # NeMo RL's sequence-level trainer/vLLM mismatch gate
    seq_logprob_error_threshold: float | None = Field(
        None,
        gt=1.0,
        description="Mask the policy term of sequences whose multiplicative probability error, the "
        "mean over their tokens of exp(|trainer old logp - vLLM sampling logp|), exceeds this (NeMo RL "
        "`seq_logprob_error_threshold` and `seq_mult_prob_error`; about 1 + the mean absolute logprob gap for "
        "small gaps; NeMo's examples use 2.0). Counted as sampling/seq_logprob_error_masked. None: measure only.",
        json_schema_extra=tenant(),
    )
    # The vLLM importance-sampling weight, OPSM, the clipped ratio and the staleness bound
    vllm_importance_sampling_correction: bool = Field(
        True,
        description="Weight each token by rho = exp(trainer old logp - vLLM sampling logp) (TRL name).",
        json_schema_extra=tenant(),
    )
    vllm_importance_sampling_mode: ISMode = Field(
        "token_truncate",
        description="How rho is bounded: truncate (clamp) or mask (zero), per token or per sequence.",
        json_schema_extra=tenant(),
    )
    vllm_importance_sampling_cap: float = Field(
        3.0,
        gt=0.0,
        description="Upper bound C on rho (TRL `vllm_importance_sampling_cap`; the key "
        "`vllm_importance_sampling_clip_max`, TRL's newer name, sets it too).",
        json_schema_extra=tenant(),
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0.0, description="Optional lower bound on rho (TRL name).", json_schema_extra=tenant()
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0.0,
        description="OPSM (DeepSeek-V3.2 eq. 9): drop a sequence when its advantage is negative "
        "and mean_t(sampling logp - current logp) exceeds this (TRL name). None disables it.",
        json_schema_extra=tenant(),
    )
    max_staleness: int = Field(
        2,
        ge=0,
        description="Groups generated more than this many policy versions ago are dropped (and counted).",
        json_schema_extra=tenant(),
    )
    off_policy_clip: Literal["current", "behaviour"] = Field(
        "behaviour",
        description="The policy the PPO ratio is taken against. `behaviour` (default): the policy "
        "that sampled, vLLM's logprobs (TRL AsyncGRPOTrainer; decoupled PPO): pi_theta/pi_vLLM is clipped to "
        "[1 - epsilon, 1 + epsilon_high], so a stale token outside the trust region stops pushing, and no IS weight "
        "is applied on top (the vllm_importance_sampling_* metrics are still logged). `current`: the trainer's own "
        "policy before the step (TRL GRPOTrainer; with one optimizer step per batch the ratio is 1, so staleness is "
        "corrected by the truncated IS weight alone). Measured on the demo at max_staleness 4: docs/algorithms.md.",
        json_schema_extra=tenant(),
    )
    kl_bias_correction_ratio: Literal["old", "sampler"] = Field(
        "old",
        description="With use_bias_correction_kl: multiply the k3 KL by pi_theta/pi_old (`old`, TRL) or by "
        "pi_theta/pi_vLLM (`sampler`, DeepSeek-V3.2's unbiased KL against the policy that sampled the tokens).",
        json_schema_extra=tenant(),
    )
