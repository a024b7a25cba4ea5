"""Why a group was dropped: the one list of drop reasons (:data:`DropReason`), shared by every role that drops.

A group that is not trained is never lost silently: whoever drops it counts it under one of these reasons in
the run's `DropCounter` (below). The same strings are the MLflow metrics ``dropped_groups/<reason>``
(`runner.report.pipeline_metrics`), the keys of ``RunSummary.dropped_groups`` and of the checkpointed
``TrainState.drops``, and the terms of the prompt ledger (`runner.report.prompts_lost`). They are a `Literal`
rather than an `Enum` so that the counts stay plain ``str``-keyed dicts (metric names, JSON checkpoints); the
counter refuses a string that is not listed here.

This module imports nothing of ours: the orchestrator, the rewards layer (its errors' ``reason``), the queue and the
runner all import it from the shared transports layer.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Literal, get_args

__all__ = ["DROP_REASONS", "NOT_LAUNCHED_DROPS", "DropCounter", "DropReason"]

logger = logging.getLogger(__name__)

WARN_EVERY = 100  # groups between two warnings for the same drop reason

DropReason = Literal[
    # the rollout queue and the end of a run (transports/queue.py, orchestrator, runner)
    "stale",  # older than max_staleness policy versions when the trainer took it (replayed groups exempt)
    "queue_timeout",  # the queue stayed full for the producer's whole put timeout
    "shutdown",  # in flight, scored but not in a full step batch, or waiting to be queued, when the producer stopped
    "unconsumed_at_end",  # still queued (or handed over but not trained) when the run ended
    # the dataset (runner, at load time: never launched)
    "prompt_too_long",  # the tokenized prompt is longer than max_prompt_length (left out of the dataset)
    # generation (orchestrator/rollout.py, env_rollout.py, orchestrator.py)
    "aborted",  # vLLM aborted a request (or a turn) of the group
    "tool_service_error",  # the tool service failed (not the tool): the conversation cannot go on
    "inference_unavailable",  # the vLLM server was not back within recovery_timeout_s
    "generation_error",  # a generation request failed (HTTP error, GenerationError)
    "rollout_error",  # any other exception in a rollout task
    # batch shaping (orchestrator.py)
    "zero_std",  # dynamic sampling: the group's weighted rewards all tie
    # scoring (transports/scorer.py RewardError subclasses, also re-raised from the reward service by rewards/remote.py)
    "reward_error",  # a reward function raised, its worker died, or the service failed
    "reward_bad_output",  # a reward function returned something other than G numbers or None
    "reward_timeout",  # the reward functions did not finish within the timeout
    # distillation (distillation/teacher.py: RewardError subclasses, handled as reward failures)
    "teacher_error",  # the teacher's server answered with an error or a malformed body after every retry
    "teacher_timeout",  # the teacher did not answer within teacher_timeout_s, after every retry
    # agents (agents/rollout.py)
    "agent_no_call",  # no episode of an agent rollout's group made a model call
    "agent_no_shared_prompt",  # the agent episodes' first prompts share no token (no group prompt to train under)
]
"""Every reason a group is dropped for; the value is the suffix of the metric ``dropped_groups/<reason>``."""

DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)
"""The members of :data:`DropReason`, in declaration order (for runtime checks)."""

NOT_LAUNCHED_DROPS: tuple[DropReason, ...] = ("prompt_too_long",)
"""Reasons counted when the dataset is loaded, not per launched group: the prompt ledger leaves them out."""


class DropCounter:
    """Thread-safe counts of dropped groups by reason (`DropReason`: e.g. `stale`,
    `reward_timeout`); the run's one ledger of drops, read by the metrics `dropped_groups/<reason>`."""

    def __init__(self) -> None:
        self._counts: collections.Counter[DropReason] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, reason: DropReason, n: int = 1) -> None:
        """Count `n` dropped groups under `reason` and log it (a warning for the first drop of each
        reason and every `WARN_EVERY`-th after it, debug otherwise, so a progress bar stays readable).

        Raises:
            ValueError: `reason` is not a `DropReason` (a misspelt reason would be a metric nobody watches).
        """
        if reason not in DROP_REASONS:
            raise ValueError(
                f"drop reason {reason!r} is not one of {DROP_REASONS}. Fix: use one of them, or add it to "
                "transports.drops.DropReason."
            )
        with self._lock:
            before = self._counts[reason]
            self._counts[reason] += n
            total = self._counts[reason]
        loud = before == 0 or before // WARN_EVERY != total // WARN_EVERY
        logger.log(logging.WARNING if loud else logging.DEBUG, "dropped %d group(s): %s (total %d)", n, reason, total)

    def snapshot(self) -> dict[DropReason, int]:
        """Copy of the counts (reason -> dropped groups)."""
        with self._lock:
            return dict(self._counts)

    def load_state_dict(self, counts: dict[str, int]) -> None:
        """Replace the counts with a `snapshot()` (checkpoint resume; taken as saved, not re-validated)."""
        with self._lock:
            self._counts = collections.Counter({k: int(v) for k, v in counts.items()})
