"""The sections of `GRPOConfig`: one pydantic model per concern, one module per section, fields named as in TRL's
``GRPOConfig``.

Each module holds everything about its section: all its fields (TRL-named or not), its validators, and the
constants and helpers that belong to it. `base.Section` is the base of them all; `run.RunFields` holds the
top-level fields. Every other field lives in exactly one section, and its flat name (the field name) is unique
across all sections, so a flat key maps to one place. (One field shares its section's name: `tools`, TRL's key, in
section `tools`; a list value is the field, a mapping the section.)

TRL names, meanings and defaults are TRL 1.16's (transformers 5 `TrainingArguments` for the optimizer and
scheduler) unless a field's description says otherwise; `trl_names.py` lists what we do with every other TRL field.
Within a section the fields keep one fixed order, which `dump_config`, `train --help`, docs/trl.md and the MLflow
params follow.
"""

from __future__ import annotations

from async_grpo.config.sections.agents import AgentsConfig
from async_grpo.config.sections.base import Section
from async_grpo.config.sections.batch import BatchConfig
from async_grpo.config.sections.batch_shaping import BatchShapingConfig
from async_grpo.config.sections.checkpoint import CheckpointConfig
from async_grpo.config.sections.compute import ComputeConfig
from async_grpo.config.sections.data import DataConfig
from async_grpo.config.sections.distillation import DistillationConfig
from async_grpo.config.sections.environments import EnvironmentsConfig
from async_grpo.config.sections.inference import InferenceConfig, ResourceSharing
from async_grpo.config.sections.loss import LossConfig, LossType
from async_grpo.config.sections.off_policy import ISMode, OffPolicyConfig
from async_grpo.config.sections.optim import LR_SCHEDULERS, OptimConfig
from async_grpo.config.sections.peft import (
    VLLM_MAX_LORA_RANKS,
    VLLM_MAX_LORAS,
    PeftConfig,
    lora_server_args,
    vllm_max_lora_rank,
)
from async_grpo.config.sections.producer import DataProducerConfig
from async_grpo.config.sections.rewards import RewardsConfig
from async_grpo.config.sections.run import RunFields
from async_grpo.config.sections.sampling import RESERVED_GENERATION_KEYS, SamplingConfig
from async_grpo.config.sections.tools import ToolsConfig
from async_grpo.config.sections.tracking import TrackingConfig
from async_grpo.config.sections.weight_sync import WeightSyncConfig

# Section name in GRPOConfig -> its model, in the order `dump_config` and `train --help` show them.
SECTIONS: dict[str, type[Section]] = {
    "data": DataConfig,
    "sampling": SamplingConfig,
    "batch": BatchConfig,
    "optim": OptimConfig,
    "compute": ComputeConfig,
    "loss": LossConfig,
    "off_policy": OffPolicyConfig,
    "batch_shaping": BatchShapingConfig,
    "rewards": RewardsConfig,
    "producer": DataProducerConfig,
    "inference": InferenceConfig,
    "weight_sync": WeightSyncConfig,
    "tracking": TrackingConfig,
    "checkpoint": CheckpointConfig,
    "tools": ToolsConfig,
    "environments": EnvironmentsConfig,
    "agents": AgentsConfig,
    "peft": PeftConfig,
    "distillation": DistillationConfig,
}

__all__ = [
    "LR_SCHEDULERS",
    "RESERVED_GENERATION_KEYS",
    "FORMER_SECTIONS",
    "SECTIONS",
    "VLLM_MAX_LORAS",
    "VLLM_MAX_LORA_RANKS",
    "AgentsConfig",
    "BatchConfig",
    "BatchShapingConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "DataConfig",
    "DataProducerConfig",
    "DistillationConfig",
    "EnvironmentsConfig",
    "ISMode",
    "InferenceConfig",
    "LossConfig",
    "LossType",
    "OffPolicyConfig",
    "OptimConfig",
    "PeftConfig",
    "ResourceSharing",
    "RewardsConfig",
    "RunFields",
    "SamplingConfig",
    "Section",
    "ToolsConfig",
    "TrackingConfig",
    "WeightSyncConfig",
    "lora_server_args",
    "vllm_max_lora_rank",
]

# Fields that moved to another section, by flat name -> the section that held them before. Their old dotted and nested
# spellings keep loading (`optim.max_steps`, `optim: {max_steps: 5}`); code and `dump_config` use the new place.
FORMER_SECTIONS: dict[str, str] = {
    **{name: "optim" for name in BatchConfig.model_fields},  # issue 49: `optim` held the batch geometry and
    **{name: "optim" for name in ComputeConfig.model_fields},  # how the learner computes, beside AdamW
}
