"""The one run configuration: a pydantic model in sections, loaded from YAML, overridable from the CLI.

Sections (prime-rl style). `GRPOConfig` has five top-level fields (`model_name_or_path`, `seed`,
`output_dir`, `trust_remote_code`, `model_init_kwargs`) and nineteen sections, one pydantic model each (`sections/`, a
module per section), in the order below:

    data           training / held-out prompts, evaluation, supervised warm start
    sampling       group size, completion length, temperature, top_p, top_k
    batch          completions per micro-batch, accumulation, max_steps or epochs
    optim          AdamW, gradient clipping, the learning-rate schedule
    compute        how the learner computes a step: micro-batch layout, memory savers, bf16, FSDP, threads
    loss           the GRPO objective: loss_type, clipping, KL, token masks, liger
    off_policy     vLLM importance-sampling correction, OPSM, max_staleness
    batch_shaping  dynamic sampling, replay buffer, deferred re-roll (the orchestrator)
    rewards        reward functions, where they run, advantage scaling
    producer       the rollout source: reuse, prefetch, warm-up, in-flight limit, streaming
    inference      the vLLM server
    weight_sync    trainer -> vLLM weight pushes
    tracking       MLflow
    checkpoint     what the run saves
    tools          tool calling
    environments   multi-turn environments the model acts in
    agents         an unmodified agent (a function or a program) trained on its own episodes
    peft           LoRA training and adapter-only weight sync

A field that moved to another section keeps its old dotted and nested spellings (`sections.FORMER_SECTIONS`:
`optim.max_steps` is `batch.max_steps`); its flat name never changes.

Code reads fields through their section: `config.optim.learning_rate`, `config.loss.loss_type`.
Values that combine sections stay on `GRPOConfig` (`groups_per_step`, `rollout_reuse`,
`reroll_start_step`, `epsilon_high_value`, `tracking_uri`).

Flat keys. Field names inside sections are TRL's ``GRPOConfig`` names wherever TRL has the knob, and
every name is unique across sections, so a TRL user's flat YAML still loads: a `mode="before"`
validator (`keys.flatten_mapping` + `keys.nest_mapping`) moves each flat key, TRL alias
(`vllm_importance_sampling_clip_max`) or dotted key (`optim.learning_rate`) into its section. Flat,
nested and dotted keys mix freely; the same field given twice with different values is an error naming
both. The same holds for keyword construction (`GRPOConfig(learning_rate=1e-5)`), for `key=value`
overrides (`learning_rate=1e-5`, `optim.learning_rate=1e-5`) and for `GRPOConfig.model_copy(update=...)`.
Unknown keys fail with the closest valid spelling ("did you mean `optim.learning_rate`?").

Out: `dump_config` writes nested YAML (every field), which `load_config` reads back to an equal config;
`flat_dump` / `flat_params` give {flat name: value} (MLflow params keep their flat names).

This package does not import torch: the launcher, the KFP components and the CLI validate a config
before anything expensive starts.
"""

from async_grpo.config.io import (
    config_from_mapping,
    dump_config,
    flat_dump,
    flat_params,
    format_validation_error,
    load_config,
)
from async_grpo.config.keys import (
    ALIASES,
    FIELDS,
    ConfigError,
    FieldRef,
    flatten_mapping,
    lookup_field,
    nest_mapping,
)
from async_grpo.config.model import GRPOConfig
from async_grpo.config.sections import (
    SECTIONS,
    BatchConfig,
    BatchShapingConfig,
    CheckpointConfig,
    ComputeConfig,
    DataConfig,
    DataProducerConfig,
    InferenceConfig,
    ISMode,
    LossConfig,
    LossType,
    OffPolicyConfig,
    OptimConfig,
    RewardsConfig,
    RunFields,
    SamplingConfig,
    TrackingConfig,
    WeightSyncConfig,
)

__all__ = [
    "ALIASES",
    "FIELDS",
    "SECTIONS",
    "BatchConfig",
    "BatchShapingConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DataConfig",
    "DataProducerConfig",
    "FieldRef",
    "GRPOConfig",
    "ISMode",
    "InferenceConfig",
    "LossConfig",
    "LossType",
    "OffPolicyConfig",
    "OptimConfig",
    "RewardsConfig",
    "RunFields",
    "SamplingConfig",
    "TrackingConfig",
    "WeightSyncConfig",
    "config_from_mapping",
    "dump_config",
    "flat_dump",
    "flat_params",
    "flatten_mapping",
    "format_validation_error",
    "load_config",
    "lookup_field",
    "nest_mapping",
]
