"""The `peft` section of `GRPOConfig`: LoRA training (TRL `ModelConfig` names: `use_peft`, `lora_r`,
`lora_alpha`, `lora_dropout`, `lora_target_modules`) and how the policy reaches vLLM (axolotl's
`vllm_lora_sync`), with the `vllm serve` flags an adapter-only push needs (`lora_server_args`) and the cross-field
checks that involve the section. `trainer.peft` implements the training side and `transports.weights.lora` the
adapter-only push (docs/deploy.md, "LoRA").
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

# vLLM 0.32 `LoRAConfig.max_lora_rank` takes only these values (`MaxLoRARanks`); the server is started with the
# smallest one >= lora_r
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters vLLM keeps loaded at once with vllm_lora_sync: the current one and the previous one (requests sent just
# before a push still name it); vLLM evicts the least recently used beyond `--max-cpu-loras`.
VLLM_MAX_LORAS = 2


class PeftConfig(Section):
    """LoRA (Hu et al. 2021, arXiv 2106.09685) on the policy, and what a weight push sends to vLLM."""

    use_peft: bool = Field(
        False,
        description="Train low-rank adapters instead of the whole policy (TRL ModelConfig `use_peft`): the "
        "policy is wrapped with peft's LoraConfig built from the lora_* fields and AdamW sees only the adapter "
        "parameters. The KL reference (beta > 0) is the initial policy, as without LoRA. Without vllm_lora_sync each "
        "push sends merged weights W + (lora_alpha / lora_r) B A under the base model's parameter names; the final "
        "model (`final-model/`) is the merged Hugging Face model and its adapter is saved in `final-model/adapter/`. "
        "Not with fsdp.",
        json_schema_extra=tenant(),
    )
    lora_r: int = Field(
        16,
        ge=1,
        description="LoRA rank r: A is (r, in_features), B is (out_features, r) (TRL "
        "ModelConfig `lora_r`; peft `r`). With vllm_lora_sync at most 512 (vLLM's largest "
        "--max-lora-rank).",
        json_schema_extra=tenant(),
    )
    lora_alpha: int = Field(
        32,
        ge=1,
        description="LoRA scaling numerator: the update is (lora_alpha / lora_r) B A "
        "(Hu et al. 2021 eq. 3; TRL ModelConfig `lora_alpha`; peft `lora_alpha`).",
        json_schema_extra=tenant(),
    )
    lora_dropout: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="Dropout probability on the LoRA branch's input "
        "during training steps (TRL ModelConfig `lora_dropout`; peft `lora_dropout`). "
        "disable_dropout=true also zeroes it, as TRL does. vLLM samples without dropout, so "
        "above 0 the IS ratio also sees the dropout noise.",
        json_schema_extra=tenant(),
    )
    lora_target_modules: list[str] | str | None = Field(
        None,
        description="Module names that get adapters (TRL ModelConfig `lora_target_modules`; peft "
        "`target_modules`): a list of names matched as suffixes (e.g. [q_proj, v_proj]), `all-linear` (every linear "
        "layer but the LM head), another string is a regex matched against full module names (peft); None: peft's "
        "default for the architecture (q_proj and v_proj for Qwen2 / Llama). Names that match no module fail the "
        "run's setup with the module names the model has.",
        json_schema_extra=tenant(),
    )
    vllm_lora_sync: bool = Field(
        False,
        description="Push only the adapter to vLLM (axolotl `vllm_lora_sync`): each push saves the adapter "
        "(peft safetensors, a few MB instead of the full model) under `<output_dir>/lora_sync/` and loads it into the "
        "server as adapter `policy-v<version>` through vLLM's runtime LoRA loading (/v1/load_lora_adapter); "
        "generation requests name the adapter of the version they are stamped with, and the previous adapter is "
        "unloaded one push later. The first push after the trainer connects also sends the base weights once "
        "(full transfer), so vLLM's base is the trainer's (warm start, resume). The launched server gets "
        "--enable-lora --max-lora-rank --max-loras 2 and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; an attached server (vllm_url) needs those too and must read "
        "output_dir at the same path (on Kubernetes both pods mount the workspace PVC). Needs use_peft.",
        json_schema_extra=tenant(),
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _check_targets(cls, value: list[str] | str | None) -> list[str] | str | None:
        """A list must be non-empty, without blank names."""
        if isinstance(value, list) and (not value or any(not name.strip() for name in value)):
            raise ValueError(
                "lora_target_modules must name at least one module and no blank ones. Fix: e.g. "
                "[q_proj, v_proj], all-linear, or remove it for peft's default."
            )
        if isinstance(value, str) and not value.strip():
            raise ValueError("lora_target_modules is blank. Fix: a list of module names, all-linear, or remove it.")
        return value


def vllm_max_lora_rank(lora_r: int) -> int:
    """The `--max-lora-rank` for adapters of rank `lora_r`: the smallest value vLLM 0.32 accepts that is >= lora_r.

    Raises:
        ValueError: lora_r is above 512.
    """
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= lora_r:
            return rank
    raise ValueError(
        f"lora_r={lora_r} is above 512, vLLM's largest --max-lora-rank. Fix: lora_r <= 512, or "
        "vllm_lora_sync=false (merged weights are pushed then)."
    )


def lora_server_args(config: Any) -> list[str]:
    """The `vllm serve` flags a run with vllm_lora_sync needs (none otherwise): --enable-lora, --max-lora-rank (see
    `vllm_max_lora_rank`), --max-loras and --max-cpu-loras (`VLLM_MAX_LORAS`: the current and the previous
    adapter)."""
    peft = config.peft
    if not peft.vllm_lora_sync:
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(vllm_max_lora_rank(peft.lora_r)),
        "--max-loras",
        str(VLLM_MAX_LORAS),
        "--max-cpu-loras",
        str(VLLM_MAX_LORAS),
    ]
