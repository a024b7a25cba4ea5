"""The `batch` section: the optimizer step's batch geometry (completions per micro-batch, micro-batches per step) and
the run's length (max_steps, or epochs over the prompts), with TRL's names and meanings. Completions per step must be
a multiple of `num_generations` (whole groups: `GRPOConfig.groups_per_step`).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant


class BatchConfig(Section):
    """How many completions an optimizer step takes, and how many steps the run trains."""

    per_device_train_batch_size: int = Field(
        8,
        ge=1,
        description="Completions per micro-batch on each trainer rank (TRL semantics).",
        json_schema_extra=tenant(),
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step. Completions per step = "
        "per_device_train_batch_size x gradient_accumulation_steps x world size, and must be a "
        "multiple of num_generations (whole groups per step).",
        json_schema_extra=tenant(),
    )
    max_steps: int = Field(
        50,
        ge=-1,
        description="Optimizer steps to run; -1: num_train_epochs passes over the training prompts (TRL).",
        json_schema_extra=tenant(),
    )
    num_train_epochs: float = Field(
        3.0,
        gt=0.0,
        description="With max_steps=-1: train for this many passes over the training prompts, i.e. "
        "max_steps = ceil(num_train_epochs x prompts / prompts per step) (TRL name and default). Ignored when "
        "max_steps > 0.",
        json_schema_extra=tenant(),
    )

    @field_validator("max_steps")
    @classmethod
    def _no_zero_steps(cls, value: int) -> int:
        """max_steps is a step count (>= 1) or -1 (epochs); 0 would train nothing."""
        if value == 0:
            raise ValueError("max_steps=0 trains nothing. Fix: give a step count, or -1 for num_train_epochs passes.")
        return value
