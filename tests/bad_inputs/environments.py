"""Environments for the bad-input corpus: each breaks the environment protocol one way."""

from __future__ import annotations


class WrongSignature:
    """reset takes no row and no state."""

    async def reset(self):
        return None

    async def step(self, action, state):
        return None


class ResetRaises:
    """reset needs a column the dataset does not have."""

    async def reset(self, row, state):
        state["level"] = row["level"]

    async def step(self, action, state):
        return None
