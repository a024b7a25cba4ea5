"""The loss normalizer of each ``loss_type``, in one table: :data:`LOSS_NORMALIZERS`.

A GRPO-family loss is built from per-token terms ``l_t`` (the surrogate, KL and corrections of
:func:`~.losses.grpo_loss`) under the loss mask ``m``. Once ``l_t`` is known, the ``loss_type`` values differ only
in how the tokens of one optimizer step are averaged, in two stages (TRL 1.16 ``GRPOTrainer._compute_loss``, train mode,
``steps_per_generation == gradient_accumulation_steps``):

1. within a micro-batch, :attr:`LossNormalizer.aggregate` reduces ``(B, T)`` per-token losses to one number;
2. across the step, that number is divided by a step-level count, :attr:`LossNormalizer.divisor`: the
   micro-batches per optimizer step (``gradient_accumulation_steps``), or the loss tokens of the whole
   accumulation window over every rank per rank (``num_items_in_batch / num_processes``).

Every place that depends on the choice reads this table: the unfused loss (:func:`~.losses.grpo_loss`), the
liger-fused loss (:func:`~.fused.fused_grpo_loss`), the streamed step's gradient rescaling and
``policy_loss`` metric (:class:`LossNormalizer` methods, called by ``trainer.GRPOLearner.step`` through
:attr:`~.objective.GRPOObjective.normalizer`), and the trainer's micro-batch ordering
(:attr:`LossNormalizer.cut_invariant`).

GSPO (arXiv 2507.18071) is not a row: it is ``importance_sampling_level='sequence'`` (one ratio per
sequence), combined with any ``loss_type`` (TRL's GSPO recipe uses ``grpo``); its normalizer is that row's.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens (right padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

__all__ = ["LOSS_NORMALIZERS", "LOSS_TYPES", "LossNormalizer"]


def sequence_mean(per_token_loss: Tensor, mask: Tensor, max_completion_length: int) -> Tensor:
    """Mean over sequences of each sequence's token mean: ``mean_i [sum_t m_it l_it / max(sum_t m_it, 1)]``.

    Args:
        per_token_loss: ``(B, T)`` per-token losses, or ``(B, 1)`` broadcast over the tokens.
        mask: ``(B, T)`` float loss mask (1 trained, 0 padding).
        max_completion_length: unused (the common signature of the aggregations).

    Returns:
        0-d tensor. Source: DeepSeekMath (Shao et al. 2024, arXiv 2402.03300) eq. 3; TRL 1.16
        ``GRPOTrainer._compute_loss`` (``loss_type in ["grpo", "sapo"]``), expression for expression.
    """
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def token_mean(per_token_loss: Tensor, mask: Tensor, max_completion_length: int) -> Tensor:
    """Token mean over the micro-batch: ``sum m l / max(sum m, 1)``.

    Args:
        per_token_loss: ``(B, T)`` or ``(B, 1)`` per-token losses.
        mask: ``(B, T)`` float loss mask.
        max_completion_length: unused.

    Returns:
        0-d tensor. Source: TRL 1.16 ``GRPOTrainer._compute_loss`` (``loss_type == "bnpo"``).
    """
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def token_sum_over_max_length(per_token_loss: Tensor, mask: Tensor, max_completion_length: int) -> Tensor:
    """Token sum over a constant: ``sum m l / (B * max_completion_length)``.

    Args:
        per_token_loss: ``(B, T)`` or ``(B, 1)`` per-token losses.
        mask: ``(B, T)`` float loss mask.
        max_completion_length: the generation limit ``L`` (tokens, >= 1).

    Returns:
        0-d tensor. Source: Dr. GRPO (Liu et al. 2025, arXiv 2503.20783); TRL 1.16 ``GRPOTrainer._compute_loss``
        (``loss_type == "dr_grpo"``).
    """
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def token_sum(per_token_loss: Tensor, mask: Tensor, max_completion_length: int) -> Tensor:
    """Token sum ``sum m l``; the step divisor (tokens of the accumulation window) makes it a global token mean.

    Args:
        per_token_loss: ``(B, T)`` or ``(B, 1)`` per-token losses.
        mask: ``(B, T)`` float loss mask.
        max_completion_length: unused.

    Returns:
        0-d tensor. Source: DAPO (Yu et al. 2025, arXiv 2503.14476) token-level loss; TRL 1.16
        ``GRPOTrainer._compute_loss`` (``loss_type in ["cispo", "dapo", ...]``).
    """
    return (per_token_loss * mask).sum()


@dataclass(frozen=True)
class LossNormalizer:
    """How one ``loss_type`` normalizes its per-token losses: one row of :data:`LOSS_NORMALIZERS`.

    Attributes:
        aggregate: ``(per_token_loss (B, T) or (B, 1), mask (B, T) float, max_completion_length) -> 0-d``: the
            micro-batch's loss before the step divisor (one of :func:`sequence_mean`, :func:`token_mean`,
            :func:`token_sum_over_max_length`, :func:`token_sum`).
        divisor: the step-level count the aggregate is divided by. ``"micro_batches"``: by
            ``gradient_accumulation_steps`` (micro-batches per optimizer step; over ranks with unequal shares all
            ranks' micro-batches / world size); the ``policy_loss`` metric is the aggregate before the division.
            ``"tokens"``: by ``max(num_items_in_batch, 1) / num_processes``, ``num_items_in_batch`` the loss
            tokens of the whole accumulation window summed over the ranks, which makes the ranks' averaged
            gradient a global token mean; ``policy_loss`` is the loss after the division.
        cut_invariant: True when the step's gradient does not depend on which completions share a micro-batch
            (micro-batches of equal completion counts): then the trainer may order the completions by length
            (``group_by_length``). False for bnpo, whose per-micro-batch token mean depends on the cut.
        source: where the formula comes from (paper and TRL 1.16 branch).
    """

    aggregate: Callable[[Tensor, Tensor, int], Tensor]
    divisor: Literal["micro_batches", "tokens"]
    cut_invariant: bool
    source: str

    @property
    def divides_by_tokens(self) -> bool:
        """True for ``divisor == "tokens"`` (dapo, cispo): the loss needs ``num_items_in_batch``."""
        return self.divisor == "tokens"

    def streamed_scale(self, num_items_in_batch: float, micro_batches: int) -> float:
        """The factor that turns gradients of losses computed with unit normalizers into the normalized ones.

        A streamed step learns its normalizers only after the last micro-batch, so its micro-batches run with
        ``num_items_in_batch=1`` and ``gradient_accumulation_steps=1``; multiplying their summed gradients by
        this factor gives those of the real normalizers (same clamps at 1 as :func:`~.losses.grpo_loss`).

        Args:
            num_items_in_batch: the step's loss tokens (mask sum).
            micro_batches: the step's micro-batches (with a token budget: its completions, each micro-batch
                having been weighted by its completion count).

        Returns:
            ``1 / max(num_items_in_batch, 1)`` (tokens) or ``1 / max(micro_batches, 1)`` (micro_batches).
        """
        if self.divides_by_tokens:
            return 1.0 / max(num_items_in_batch, 1.0)
        return 1.0 / max(micro_batches, 1)

    def streamed_metrics(self, metrics: dict[str, float], num_items_in_batch: float) -> dict[str, float]:
        """A streamed step's averaged micro-batch metrics on the scale of the unstreamed step.

        With ``divisor == "tokens"`` each micro-batch's ``policy_loss`` was its token *sum*
        (``num_items_in_batch=1``), so it is divided by the step's token count here; the ``micro_batches``
        rows' ``policy_loss`` is taken before the division and does not depend on the normalizers.

        Args:
            metrics: token-weighted means of the micro-batches' metrics.
            num_items_in_batch: the step's loss tokens.

        Returns:
            A new dict (``metrics`` is not modified).
        """
        out = dict(metrics)
        if self.divides_by_tokens and "policy_loss" in out:
            out["policy_loss"] /= max(num_items_in_batch, 1.0)
        return out


_TRL = "TRL 1.16 GRPOTrainer._compute_loss"
LOSS_NORMALIZERS: dict[str, LossNormalizer] = {
    "grpo": LossNormalizer(
        sequence_mean, "micro_batches", True, f"DeepSeekMath (arXiv 2402.03300) eq. 3; {_TRL}, loss_type 'grpo'"
    ),
    "bnpo": LossNormalizer(token_mean, "micro_batches", False, f"{_TRL}, loss_type 'bnpo' (local-batch token mean)"),
    "dr_grpo": LossNormalizer(
        token_sum_over_max_length, "micro_batches", True, f"Dr. GRPO (arXiv 2503.20783); {_TRL}, loss_type 'dr_grpo'"
    ),
    "dapo": LossNormalizer(token_sum, "tokens", True, f"DAPO (arXiv 2503.14476); {_TRL}, loss_type 'dapo'"),
    "cispo": LossNormalizer(token_sum, "tokens", True, f"MiniMax-M1 (arXiv 2506.13585); {_TRL}, loss_type 'cispo'"),
    "sapo": LossNormalizer(
        sequence_mean, "micro_batches", True, f"SAPO (arXiv 2511.20347); {_TRL}, loss_type 'sapo' (as 'grpo')"
    ),
}
"""``loss_type`` -> its :class:`LossNormalizer` (TRL 1.16 ``GRPOConfig.loss_type`` names and semantics)."""

LOSS_TYPES = tuple(LOSS_NORMALIZERS)  # ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"): LossSettings.loss_type
