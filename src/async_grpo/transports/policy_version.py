"""The policy version: which weights vLLM serves, shared by the trainer (which bumps it after each push) and every
role that stamps or checks a rollout's version (the orchestrator, the rollout queue's staleness check)."""

from __future__ import annotations

import threading


class PolicyVersion:
    """Thread-safe policy version counter: the trainer bumps it after each weight push (`GRPORecipe.push_weights`)."""

    def __init__(self, value: int = 0):
        self._value = value
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """Current version: the one vLLM serves (the trainer bumps it once a push has finished)."""
        with self._lock:
            return self._value

    def bump(self) -> int:
        """Increment and return the new version."""
        with self._lock:
            self._value += 1
            return self._value

    def reset(self, value: int) -> None:
        """Set the version (checkpoint resume, before any producer runs).

        Raises:
            ValueError: value < 0.
        """
        if value < 0:
            raise ValueError(f"policy version {value} must be >= 0")
        with self._lock:
            self._value = value
