"""`Section`, the base of every section of `GRPOConfig` and of its top-level fields: what they all share (unknown
keys refused, assignments validated, inf and NaN refused)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are rejected, assignments are validated, and float fields refuse
    inf and NaN (`learning_rate: .inf` fails with the field's name)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
