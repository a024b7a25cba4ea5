"""Pure-math core of async-grpo: advantages, policy losses, off-policy corrections, log-prob helpers.

Functions over torch tensors (CPU-testable, no model, no config object), each mirroring TRL 1.16
``GRPOTrainer`` where TRL has the algorithm. The loss options are :class:`LossSettings`, listed once
(``settings.py``); the per-call tensors of a loss are one :class:`LossInputs` (``inputs.py``), taken by both
:func:`grpo_loss` and :func:`fused_grpo_loss`; each ``loss_type``'s normalizer is a row of
:data:`LOSS_NORMALIZERS` (``normalizers.py``). :class:`GRPOObjective` composes one micro-batch's loss from them.
"""

from .advantages import AdvantageOutput, compute_advantages, nanstd
from .distillation import DistillationTerm, distillation_advantages
from .entropy import high_entropy_mask
from .fused import detached_completion_logps, fused_grpo_loss
from .inputs import LossInputs
from .logprobs import entropy_from_logits, selective_log_softmax
from .losses import LossOutput, grpo_loss
from .normalizers import LOSS_NORMALIZERS, LOSS_TYPES, LossNormalizer
from .objective import GRPOObjective, MicroBatchInputs, MicroBatchLoss
from .off_policy import IS_MODES, importance_sampling_weights, off_policy_mask
from .settings import IS_LEVELS, LossSettings

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "LOSS_NORMALIZERS",
    "LOSS_TYPES",
    "AdvantageOutput",
    "DistillationTerm",
    "GRPOObjective",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "LossSettings",
    "MicroBatchInputs",
    "MicroBatchLoss",
    "compute_advantages",
    "detached_completion_logps",
    "distillation_advantages",
    "entropy_from_logits",
    "fused_grpo_loss",
    "grpo_loss",
    "high_entropy_mask",
    "importance_sampling_weights",
    "nanstd",
    "off_policy_mask",
    "selective_log_softmax",
]
