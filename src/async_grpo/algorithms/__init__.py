"""Pure-math core of async-grpo: advantages, policy losses, off-policy corrections, log-prob helpers.

Plain functions over torch tensors (CPU-testable, no model, no config object), each mirroring TRL 1.16
``GRPOTrainer`` where TRL has the algorithm.
"""

from .advantages import AdvantageOutput, compute_advantages, nanstd
from .entropy import high_entropy_mask
from .logprobs import entropy_from_logits, selective_log_softmax
from .losses import LOSS_TYPES, LossOutput, grpo_loss
from .off_policy import IS_MODES, importance_sampling_weights, off_policy_mask

__all__ = [
    "IS_MODES",
    "LOSS_TYPES",
    "AdvantageOutput",
    "LossOutput",
    "compute_advantages",
    "entropy_from_logits",
    "grpo_loss",
    "high_entropy_mask",
    "importance_sampling_weights",
    "nanstd",
    "off_policy_mask",
    "selective_log_softmax",
]
