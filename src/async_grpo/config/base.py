"""The base of every config section (kept apart so that section modules can import it without a cycle)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are rejected and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
