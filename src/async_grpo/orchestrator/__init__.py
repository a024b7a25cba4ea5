"""Orchestrator role: generate groups on vLLM through a `Rollout`, score them, stamp policy versions, fill the
rollout queue. `make_train_batch` is public for user `DataProducer`s (advantages and metrics over groups)."""

from async_grpo.orchestrator.batching import make_train_batch

__all__ = ["make_train_batch"]
