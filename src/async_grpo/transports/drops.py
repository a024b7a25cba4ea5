"""Why a group was dropped: the one list of drop reasons (:data:`DropReason`), shared by every role that drops.

A group that is not trained is never lost silently: whoever drops it counts it under one of these reasons in
the run's `transports.queue.DropCounter`. The same strings are the MLflow metrics ``dropped_groups/<reason>``
(`runner.report.pipeline_metrics`), the keys of ``RunSummary.dropped_groups`` and of the checkpointed
``TrainState.drops``, and the terms of the prompt ledger (`runner.report.prompts_lost`). They are a `Literal`
rather than an `Enum` so that the counts stay plain ``str``-keyed dicts (metric names, JSON checkpoints); the
counter refuses a string that is not listed here.

This module imports nothing: the orchestrator, the rewards layer (its errors' ``reason``), the queue and the
runner all import it from the shared transports layer.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DROP_REASONS", "NOT_LAUNCHED_DROPS", "DropReason"]

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
]
"""Every reason a group is dropped for; the value is the suffix of the metric ``dropped_groups/<reason>``."""

DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)
"""The members of :data:`DropReason`, in declaration order (for runtime checks)."""

NOT_LAUNCHED_DROPS: tuple[DropReason, ...] = ("prompt_too_long",)
"""Reasons counted when the dataset is loaded, not per launched group: the prompt ledger leaves them out."""
