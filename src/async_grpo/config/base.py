"""The base of every config section (kept apart so that section modules can import it without a cycle)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are rejected, assignments are validated, and float fields refuse
    inf and NaN (`learning_rate: .inf` fails with the field's name)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
