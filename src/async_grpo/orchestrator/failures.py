"""Failures that end the orchestrator, and the watch that decides when failed scoring means the scorer is down."""

from __future__ import annotations

import time

from async_grpo.errors import RunFailedError
from async_grpo.transports.scorer import RewardError


class RewardServiceError(RunFailedError):
    """Scoring failed for every group for `reward_failure_timeout_s` seconds (the reward service or workers are
    down, or the distillation teacher: its failures are reward failures)."""


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill a batch within `max_gen_batches` generation batches."""


class RewardFailureWatch:
    """Tracks the current streak of groups that failed to score.

    Args:
        timeout_s: a streak of at least two failures lasting this long (seconds) means the scorer is down.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.since: float | None = None  # monotonic time of the streak's first failure
        self.in_row = 0

    def scored(self) -> None:
        """A group was scored: the streak ends."""
        self.since, self.in_row = None, 0

    def failed(self, err: RewardError) -> RewardServiceError | None:
        """Count a failed group; returns the error to stop with once the streak is long enough, else None."""
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.in_row += 1
        failing_s = now - self.since
        if self.in_row < 2 or failing_s < self.timeout_s:
            return None
        if err.reason.startswith("teacher_"):  # distillation.teacher.TeacherError
            fix = "check that the teacher's vLLM server (teacher_url) is up and serves the student's tokens"
        else:
            fix = (
                "check that the reward service (reward_url) or the reward workers are up and that the reward "
                "functions run"
            )
        return RewardServiceError(
            f"every group failed to score for {failing_s:.0f} s ({self.in_row} in a row; "
            f"reward_failure_timeout_s={self.timeout_s:g}); last error: {err}. Fix: {fix}, then resume the run"
        )
