"""The `Learner` protocol: everything the runner asks of a trainer, whatever its parallelism.

Three learners meet it: `GRPOLearner` (one process, or one replica/shard on a rank), `DataParallelLearner`
(rank 0 driving the other ranks through typed commands, `transports.ranks`) with replicas or FSDP2 shards. The
runner holds a `Learner` and never checks which one it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from vllm.distributed.weight_transfer import WeightSource

from async_grpo.transports.messages import TrainBatch


@dataclass(frozen=True)
class AdapterPush:
    """What a LoRA adapter push (vllm_lora_sync, `transports.weights.lora.LoRAAdapterPusher`) sends.

    Attributes:
        base: the base weights W alone (adapters left out) under their HF names, as vLLM's `WeightSource`: sent once
            per setup, so the server's base is the trainer's.
        save_adapter: writes the adapter files (peft `save_pretrained`) into the folder it is given and returns
            their bytes.
    """

    base: WeightSource
    save_adapter: Callable[[Path], int]


@runtime_checkable
class Learner(Protocol):
    """A policy and its optimizer, trained one optimizer step per call.

    Attributes:
        model: the policy (a transformers causal LM; on rank 0 under FSDP, this rank's shards). Read-only for
            callers: a `DataProducer` may generate with it, never step it.
    """

    model: torch.nn.Module

    def step(self, batch: Any, *, old_logps: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on every completion of `batch` (a `TrainBatch`, or an iterable of streamed chunks of
        one); returns the step's loss metrics (TRL names: loss, grad_norm, entropy, clip ratios, IS metrics...).

        Args:
            batch: the step's groups with advantages filled.
            old_logps: pi_old per micro-batch from `old_logps(batch)` when the batch is trained more than once;
                None: the current policy is pi_old (ratio 1).
        """

    def old_logps(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The current policy's per-token logprobs of `batch`, one (n_i, T) tensor per micro-batch (no grad)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training bit-identically: model weights, optimizer (and scheduler)
        state and counters, as CPU tensors and plain values (a collective under FSDP: rank 0 gets the full state)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (on every rank).

        Raises:
            KeyError / RuntimeError: the state does not match this model or optimizer.
        """

    def named_parameters_for_push(self) -> WeightSource:
        """The full, unsharded (name, tensor) parameters to send to vLLM, as vLLM's `WeightSource` (metadata plus
        a re-iterable stream; iterating it is a collective under FSDP)."""

    def adapter_for_push(self) -> AdapterPush:
        """What an adapter-only push sends (vllm_lora_sync): the base weights and the adapter's writer.

        Raises:
            TypeError: the policy has no LoRA adapter (use_peft is off); the message names the fix.
        """

    def save_pretrained(self, path: Path) -> None:
        """Write the policy as a Hugging Face model folder (loadable by transformers and `vllm serve`)."""

    def forget(self, batch: TrainBatch) -> None:
        """The rollout holding `batch` is done: drop anything cached for it."""

    def close(self) -> None:
        """Release other ranks, if any (they return from their command loop)."""
