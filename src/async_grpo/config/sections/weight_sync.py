"""The `weight_sync` section: pushing the trainer's weights to vLLM: over which data plane (nccl, gloo), the timeout
of one push, and how many optimizer steps pass between pushes (with the staleness bound, how far behind vLLM
samples)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section


class WeightSyncConfig(Section):
    """Pushing the trainer's weights to vLLM: how often and over which data plane."""

    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Weight-transfer data plane: nccl on GPU, gloo on CPU; auto picks by device."
    )
    weight_sync_timeout_s: float = Field(300.0, gt=0.0, description="Timeout for one weight push (seconds).")
    vllm_sync_interval: int = Field(1, ge=1, description="Push weights to vLLM every this many optimizer steps.")
