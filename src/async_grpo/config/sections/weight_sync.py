"""The `weight_sync` section: pushing the trainer's weights to vLLM: over which data plane (nccl, gloo), the timeout
of one push, and how many optimizer steps pass between pushes (with the staleness bound, how far behind vLLM
samples)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant


class WeightSyncConfig(Section):
    """Pushing the trainer's weights to vLLM: how often and over which data plane."""

    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Weight-transfer data plane: nccl on GPU, gloo on CPU; auto picks by device.",
        json_schema_extra=tenant(),
    )
    weight_sync_timeout_s: float = Field(
        300.0, gt=0.0, description="Timeout for one weight push (seconds).", json_schema_extra=tenant()
    )
    vllm_sync_interval: int = Field(
        1, ge=1, description="Push weights to vLLM every this many optimizer steps.", json_schema_extra=tenant()
    )
    weight_sync_mode: Literal["full", "delta"] = Field(
        "full",
        description="full: every push sends every weight. delta (TRL's name; gloo data plane only): after the "
        "first push, each weight travels as its changed elements against the last push (indices or a bit mask, "
        "and the values, whichever is smallest; whole when that is smaller), and vLLM rebuilds it bit for bit "
        "from a snapshot of the last push, so it serves exactly what a full push would load. Costs one copy of "
        "the pushed weights in the trainer and in each vLLM worker; pays off for bfloat16 pushes at small "
        "learning rates, where most elements keep their bits (weight_sync/bytes against "
        "weight_sync/dense_bytes shows the saving).",
        json_schema_extra=tenant(),
    )

    weight_sync_overlap: bool = Field(
        False,
        description="Run each weight push on a background thread beside the trainer's next optimizer step, from a "
        "copy of the weights taken when the push starts (PipelineRL's in-flight weight update), instead of making "
        "the trainer wait for vLLM's pause, the wire, vLLM's load and its resume. The policy version still moves "
        "only once vLLM serves the new weights; the trainer may be one step further ahead of it. The push is "
        "waited for before the next push, a held-out evaluation, a checkpoint and the end of the run. Costs one "
        "copy of the pushed weights (in the pushed dtype) in the trainer. Takes effect with one trainer rank, "
        "full-weight pushes (not vllm_lora_sync), without full_determinism and when vLLM is not paused for "
        "training (resource_sharing other than time_slice); otherwise the run logs why it is off and pushes in "
        "the step. runner/overlapped_push.py; docs/performance.md.",
        json_schema_extra=tenant(),
    )

    @model_validator(mode="after")
    def _delta_needs_gloo(self) -> WeightSyncConfig:
        if self.weight_sync_mode == "delta" and self.weight_sync_backend == "nccl":
            raise ValueError(
                "weight_sync_mode=delta needs the gloo data plane, and weight_sync_backend is nccl (a GPU "
                "target sets it). Fix: weight_sync_mode: full, or weight_sync_backend: gloo."
            )
        return self
