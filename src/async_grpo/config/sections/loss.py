"""The `loss` section: the GRPO objective (`LossType`, TRL's `loss_type`): how per-token terms aggregate, PPO
clipping (epsilon, clip-higher, two-sided delta, per token or per sequence), the KL term against the initial policy,
SAPO's gate temperatures, which tokens count (truncated completions, the high-entropy mask), and liger-kernel's fused
loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


class LossConfig(Section):
    """The GRPO objective: aggregation, clipping, KL, and which tokens count."""

    loss_type: LossType = Field(
        "dapo", description="Loss aggregation, as TRL's `loss_type` (default dapo).", json_schema_extra=tenant()
    )
    beta: float = Field(
        0.0, ge=0.0, description="KL coefficient (k3 estimator against the initial policy).", json_schema_extra=tenant()
    )
    epsilon: float = Field(
        0.2, gt=0.0, description="Lower clip range, ratio >= 1 - epsilon (PPO/TRL).", json_schema_extra=tenant()
    )
    epsilon_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper clip range (DAPO clip-higher); defaults to `epsilon`.",
        json_schema_extra=tenant(),
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        description="Two-sided clipping: the unclipped ratio branch is capped at delta "
        "(INTELLECT-2; TRL `delta`). None disables it.",
        json_schema_extra=tenant(),
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="Policy ratio per token, or one per sequence (GSPO, arXiv 2507.18071; TRL name).",
        json_schema_extra=tenant(),
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="Multiply the k3 KL by the policy ratio pi_theta/pi_old (TRL name and default).",
        json_schema_extra=tenant(),
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, description="SAPO gate temperature for A > 0 (TRL name).", json_schema_extra=tenant()
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, description="SAPO gate temperature for A <= 0 (TRL name).", json_schema_extra=tenant()
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Exclude completions that hit max_completion_length from the loss (DAPO, TRL name).",
        json_schema_extra=tenant(),
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="rho of 'Beyond the 80/20 Rule' (arXiv 2506.01939; TRL name): keep the "
        "policy term only on tokens whose entropy is at or above the (1 - rho) quantile of the micro-batch's valid "
        "tokens. 1.0 keeps all tokens, 0.0 only the highest-entropy one; the paper uses 0.2. The KL term and the "
        "loss denominators are not masked (TRL).",
        json_schema_extra=tenant(),
    )
    use_liger_kernel: bool = Field(
        False,
        description="Compute the GRPO loss with liger-kernel's fused linear GRPO loss (LigerFusedLinearGRPOLoss, "
        "the `gpu` extra): the LM head, log-softmax and loss run chunk by chunk, so (batch, seq, vocab) logits "
        "never exist; OPSM, the entropy mask and the vLLM IS weights enter as its per-token weight. Same loss as the "
        "unfused path (tests/trainer/test_liger_loss.py). It saves memory, not time: on an H200 a Qwen2.5-0.5B-shaped bf16 "
        "step took 2.03 s with it against 0.99 s without, at 2.3 GiB less peak memory (docs/performance.md). Not with "
        "importance_sampling_level=sequence for cispo/sapo (axolotl / TRL name).",
        json_schema_extra=tenant(),
    )
