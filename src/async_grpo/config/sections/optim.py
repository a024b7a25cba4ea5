"""The `optim` section: AdamW (learning rate, betas, epsilon, weight decay), gradient clipping and the learning-rate
schedule (`LR_SCHEDULERS`, warm-up), with transformers' `TrainingArguments` names. How many completions a step takes
and how many steps run is the `batch` section; how the learner computes a step is the `compute` section.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

# transformers 5 `SchedulerType` values that `get_scheduler` can build from a step count alone
# (`reduce_lr_on_plateau` needs a metric and `greedy` a loss trace, neither of which a GRPO run has).
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)


class OptimConfig(Section):
    """AdamW, gradient clipping and the learning-rate schedule (transformers / TRL names and defaults)."""

    learning_rate: float = Field(
        1e-6,
        ge=0.0,
        description="AdamW learning rate (TRL name; TRL default 1e-6). 0 trains nothing: a control run that keeps its "
        "starting weights (e.g. to check that the promotion gate does not promote an unchanged model).",
        json_schema_extra=tenant(),
    )
    adam_beta1: float = Field(
        0.9, ge=0.0, lt=1.0, description="AdamW beta1 (transformers name).", json_schema_extra=tenant()
    )
    adam_beta2: float = Field(
        0.999, ge=0.0, lt=1.0, description="AdamW beta2 (transformers name).", json_schema_extra=tenant()
    )
    adam_epsilon: float = Field(
        1e-8, gt=0.0, description="AdamW epsilon (transformers name).", json_schema_extra=tenant()
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.", json_schema_extra=tenant())
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.", json_schema_extra=tenant())
    lr_scheduler_type: Literal[LR_SCHEDULERS] = Field(  # type: ignore[valid-type]
        "linear",
        description="Learning-rate schedule over max_steps, transformers.get_scheduler (TRL name and "
        "default: linear decay to 0). `constant` keeps learning_rate.",
        json_schema_extra=tenant(),
    )
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra arguments of the schedule (transformers `scheduler_specific_kwargs`), e.g. "
        "{min_lr_rate: 0.1} for cosine_with_min_lr.",
        json_schema_extra=tenant(),
    )
    warmup_steps: float = Field(
        0,
        ge=0,
        description="Linear warm-up from 0 to learning_rate over this many steps; a value below 1 is a "
        "fraction of max_steps (transformers 5 semantics).",
        json_schema_extra=tenant(),
    )
    warmup_ratio: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Warm-up as a fraction of max_steps (the transformers 4 name, kept for "
        "older TRL configs); not together with warmup_steps > 0.",
        json_schema_extra=tenant(),
    )
