"""The top-level fields of `GRPOConfig` (no section): which policy to load and how (`model_name_or_path`,
`trust_remote_code`, `model_init_kwargs`), the seed, and the run folder.

`GRPOConfig` subclasses `RunFields`, so these read as `config.seed`. `model_init_kwargs` keys that would change the
trainer's float32 master weights, or that have a field of their own, are refused here (`_INIT_KWARGS_FIXES`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, tenant, volume_path

# model_init_kwargs keys that would change what the trainer holds (its weights must be float32 master weights on
# one device, unquantized) or that have their own field.
_INIT_KWARGS_FIXES = {
    "trust_remote_code": "set the field trust_remote_code instead",
    "device_map": "remove it: the launcher places the model (one device per trainer rank)",
    "quantization_config": "remove it: quantized training (QLoRA) is not supported yet",
    "load_in_4bit": "remove it: quantized training (QLoRA) is not supported yet",
    "load_in_8bit": "remove it: quantized training is not supported yet",
}


class RunFields(Section):
    """Top-level fields of `GRPOConfig` (not in a section)."""

    # How the policy is loaded (TRL names; before model_name_or_path in the field order)
    trust_remote_code: bool = Field(
        False,
        description="Allow models and tokenizers that ship their own Python code (TRL name): passed to "
        "transformers' from_pretrained and as `--trust-remote-code` to the vLLM server we launch. Leave it off "
        "unless you trust the model's repository.",
        json_schema_extra=code(),
    )
    model_init_kwargs: dict[str, Any] | None = Field(
        None,
        description="Keyword arguments for AutoModelForCausalLM.from_pretrained (TRL name), e.g. "
        "{attn_implementation: sdpa, revision: main}. The trainer keeps float32 master weights: a dtype / "
        "torch_dtype other than float32 is refused (use bf16 for bfloat16 compute).",
        json_schema_extra=code(),
    )
    # The policy, the seed and the run folder
    model_name_or_path: str = Field(
        "builtin:tiny",
        description="Local HF model folder, or `builtin:tiny` to build the tiny char-level "
        "Qwen2-style model under `<output_dir>/tiny-model` (no hub access needed).",
        json_schema_extra=volume_path(),
    )
    seed: int = Field(0, description="Seed for data order, model init and sampling.", json_schema_extra=tenant())
    full_determinism: bool = Field(
        False,
        description="Reproducible runs (TRL name): the trainer runs transformers' enable_full_determinism(seed) "
        "(deterministic torch algorithms), and the builtin orchestrator fixes by the schedule what timing decides "
        "otherwise: the i-th group is the i-th prompt of the seeded order, sampled with its own vLLM seed at exactly "
        "the policy version the schedule gives it (the trainer pushes the next version only once every group "
        "scheduled for this one is generated), and groups enter step batches in launch order. Two runs with the "
        "same seed and settings then log the same metrics, at any max_inflight_groups and max_staleness, on "
        "hardware whose kernels are deterministic (the CPU here; docs/reproducibility.md). Costs the trainer the "
        "wait for the async window's last group before each push. Not with dynamic_sampling or "
        "reroll_start_fraction < 1. A fault that regenerates groups (a vLLM recovery pushes a new version) or "
        "drops them keeps the run going but not the equality.",
        json_schema_extra=tenant(),
    )
    output_dir: str = Field(
        "runs/tiny", description="Run folder: model, logs, vLLM log, MLflow store.", json_schema_extra=volume_path()
    )

    @field_validator("model_init_kwargs")
    @classmethod
    def _check_init_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Refuse keys that change the trainer's weights or that have their own field (message names the fix)."""
        for key, fix in _INIT_KWARGS_FIXES.items():
            if value and key in value:
                raise ValueError(f"model_init_kwargs.{key}: {fix}.")
        for key in ("dtype", "torch_dtype"):
            if value and value.get(key) not in (None, "float32", "auto"):
                raise ValueError(
                    f"model_init_kwargs.{key}={value[key]!r}: the trainer keeps float32 master weights. "
                    "Fix: remove it, and set bf16: true for bfloat16 compute."
                )
        return value
