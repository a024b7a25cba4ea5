"""The learning-rate schedule: transformers' own code, with TRL's knob names.

`LRSchedule` is what a learner needs to build `transformers.get_scheduler` over its optimizer (the schedule
steps once per optimizer step, like the HF Trainer's); `warmup_steps` reads TRL's warm-up knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule over a run (TRL / transformers names).

    Attributes:
        name: a transformers `SchedulerType` value (`linear`, `cosine`, `constant`, ...).
        num_training_steps: optimizer steps of the run (>= 1).
        num_warmup_steps: steps of linear warm-up from 0 (>= 0).
        kwargs: `scheduler_specific_kwargs` of `transformers.get_scheduler` (e.g. `min_lr_rate`).
    """

    name: str = "constant"
    num_training_steps: int = 1
    num_warmup_steps: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """`transformers.get_scheduler(name, optimizer, ...)`: a `LambdaLR` (or similar) whose `step()` follows
        each optimizer step.

        Raises:
            ValueError: an unknown name, or arguments the schedule does not take (transformers' message).
        """
        from transformers import get_scheduler

        return get_scheduler(
            self.name,
            optimizer,
            num_warmup_steps=self.num_warmup_steps,
            num_training_steps=self.num_training_steps,
            scheduler_specific_kwargs=dict(self.kwargs) or None,
        )


def warmup_steps(warmup_steps: float, warmup_ratio: float | None, max_steps: int) -> int:
    """Warm-up steps from TRL's knobs: `warmup_steps` >= 1 is a count, below 1 a fraction of `max_steps`
    (transformers 5); `warmup_ratio` (transformers 4) is a fraction. Fractions round up (transformers'
    `get_warmup_steps`: ceil(max_steps x ratio))."""
    if warmup_ratio:
        return math.ceil(max_steps * warmup_ratio)
    if 0 < warmup_steps < 1:
        return math.ceil(max_steps * warmup_steps)
    return int(warmup_steps)
