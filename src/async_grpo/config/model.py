"""`GRPOConfig`: the top-level fields, the nineteen sections, the flat-key mapper, the validator that runs the
cross-field rules (`config.rules`) and the values derived from several sections."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from async_grpo.config.keys import ALIASES, FIELDS, flatten_mapping, nest_mapping
from async_grpo.config.rules import check_rules
from async_grpo.config.sections import (
    SECTIONS,
    AgentsConfig,
    BatchConfig,
    BatchShapingConfig,
    CheckpointConfig,
    ComputeConfig,
    DataConfig,
    DataProducerConfig,
    DistillationConfig,
    EnvironmentsConfig,
    InferenceConfig,
    LossConfig,
    OffPolicyConfig,
    OptimConfig,
    PeftConfig,
    RewardsConfig,
    RunFields,
    SamplingConfig,
    ToolsConfig,
    TrackingConfig,
    WeightSyncConfig,
)
from async_grpo.config.trl_names import adapt_trl_keys


def _section(model: type) -> Any:
    return Field(default_factory=model, description=(model.__doc__ or "").strip())


class GRPOConfig(RunFields):
    """Everything one async GRPO run needs: five top-level fields and one model per section.

    Construct it flat (`GRPOConfig(learning_rate=1e-5)`, TRL names), nested
    (`GRPOConfig(optim={"learning_rate": 1e-5})`), dotted (`{"optim.learning_rate": 1e-5}`) or mixed;
    read it nested (`config.optim.learning_rate`). Unknown keys are rejected (typos fail early).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    data: DataConfig = _section(DataConfig)
    sampling: SamplingConfig = _section(SamplingConfig)
    batch: BatchConfig = _section(BatchConfig)
    optim: OptimConfig = _section(OptimConfig)
    compute: ComputeConfig = _section(ComputeConfig)
    loss: LossConfig = _section(LossConfig)
    off_policy: OffPolicyConfig = _section(OffPolicyConfig)
    batch_shaping: BatchShapingConfig = _section(BatchShapingConfig)
    rewards: RewardsConfig = _section(RewardsConfig)
    producer: DataProducerConfig = _section(DataProducerConfig)
    inference: InferenceConfig = _section(InferenceConfig)
    weight_sync: WeightSyncConfig = _section(WeightSyncConfig)
    tracking: TrackingConfig = _section(TrackingConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    tools: ToolsConfig = _section(ToolsConfig)
    environments: EnvironmentsConfig = _section(EnvironmentsConfig)
    agents: AgentsConfig = _section(AgentsConfig)
    peft: PeftConfig = _section(PeftConfig)
    distillation: DistillationConfig = _section(DistillationConfig)

    @model_validator(mode="before")
    @classmethod
    def _map_flat_keys(cls, data: Any) -> Any:
        """Flat TRL keys, aliases and `section.name` keys -> their sections (see `keys.flatten_mapping`).

        TRL-only names go through `trl_names.adapt_trl_keys` first (converted, refused with the reason, or
        accepted as no-ops). Input that is already in shape (only top-level fields and sections, as `validate_assignment`
        passes it) goes through untouched, so section instances are kept as they are; an empty section there
        (None: `peft:` in YAML) is its defaults, as the mapper reads it."""
        if isinstance(data, Mapping) and not all(
            key in cls.model_fields and _in_shape(key, value) for key, value in data.items()
        ):  # also TRL's `optim: adamw_torch`
            return nest_mapping(flatten_mapping(adapt_trl_keys(data, FIELDS)))
        if isinstance(data, Mapping) and any(key in SECTIONS and value is None for key, value in data.items()):
            # an empty section (`peft:` in YAML) is its defaults, as the flat-key mapper reads it beside other keys
            return {key: {} if key in SECTIONS and value is None else value for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> GRPOConfig:
        """The cross-field rules (`config.rules.RULES`); the first problem is raised, naming the fields and the fix."""
        check_rules(self)
        return self

    # ------------------------------------------------------------------ derived values (across sections)
    @property
    def groups_per_step(self) -> int:
        """Prompt groups consumed per optimizer step (single trainer rank)."""
        return (
            self.batch.per_device_train_batch_size
            * self.batch.gradient_accumulation_steps
            // self.sampling.num_generations
        )

    @property
    def rollout_reuse(self) -> int:
        """Optimizer steps taken per step batch produced: mini_epochs x num_iterations."""
        return self.producer.mini_epochs * self.producer.num_iterations

    @property
    def reroll_start_step(self) -> int | None:
        """Trainer step from which deferred re-roll runs, ceil(reroll_start_fraction x max_steps); None when off
        (fraction 1.0: the run would end first)."""
        if self.batch_shaping.reroll_start_fraction >= 1.0:
            return None
        return math.ceil(self.batch_shaping.reroll_start_fraction * self.batch.max_steps)

    @property
    def epsilon_high_value(self) -> float:
        """Upper clip range, `epsilon_high` or `epsilon` (TRL behaviour)."""
        return self.loss.epsilon if self.loss.epsilon_high is None else self.loss.epsilon_high

    @property
    def vllm_serve_args(self) -> list[str]:
        """Flags for the vLLM server we launch beyond the launcher's own: `vllm_extra_args`, then the TRL knobs
        `vllm_gpu_memory_utilization` (--gpu-memory-utilization), `vllm_tensor_parallel_size`
        (--tensor-parallel-size) and `trust_remote_code` (--trust-remote-code). The platform policy checks these."""
        args = list(self.inference.vllm_extra_args)
        if self.inference.vllm_gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.inference.vllm_gpu_memory_utilization)]
        if self.inference.vllm_tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.inference.vllm_tensor_parallel_size)]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        return args

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking URI in effect: `mlflow_tracking_uri`, else the standard `MLFLOW_TRACKING_URI`
        environment variable (KFP's MLflow integration sets it), else sqlite under output_dir."""
        if self.tracking.mlflow_tracking_uri:
            return self.tracking.mlflow_tracking_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{Path(self.output_dir).resolve() / 'mlflow.db'}"

    # ------------------------------------------------------------------ flat names on copies and reads
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> GRPOConfig:
        """A copy with `update` applied and validated. Keys may be flat (`reward_url`), dotted
        (`rewards.reward_url`) or sections given as mappings (merged into the section); they win over
        this config's values. (pydantic's own `model_copy` would store a flat key as a stray attribute.)

        Raises:
            pydantic.ValidationError: the updated config is invalid.
        """
        if not update:
            return super().model_copy(deep=deep)
        data = {ref.name: value for ref, value in _flat_items(self)}
        data.update(flatten_mapping(update))
        return type(self).model_validate(data)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # pydantic's: private attributes
        except AttributeError:
            raise _moved(name, "read") or AttributeError(f"'GRPOConfig' object has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        error = _moved(name, "set")
        if error is not None:
            raise error
        super().__setattr__(name, value)


def _in_shape(key: str, value: Any) -> bool:
    """False for a section name given a field's value (`tools: [...]` is the field `tools.tools`), or a mapping holding
    a key that is not its own field (a field's former section, `optim: {max_steps: 5}`, or a typo: the mapper moves
    or reports it)."""
    if key not in SECTIONS or value is None or isinstance(value, BaseModel):
        return True
    return isinstance(value, Mapping) and all(sub in SECTIONS[key].model_fields for sub in value)


def _moved(name: str, verb: str) -> AttributeError | None:
    """The error for a flat name used as an attribute of GRPOConfig: it names the field's section."""
    ref = FIELDS.get(ALIASES.get(name, name))
    if ref is None or ref.section is None:
        return None
    return AttributeError(
        f"'GRPOConfig' object has no attribute {name!r}: the field is in section "
        f"{ref.section!r}. Fix: {verb} config.{ref.path}."
    )


def _flat_items(config: GRPOConfig, mode: str = "python", exclude_defaults: bool = False):
    """(field, value) for every field of `config`, in FIELDS order (top level first, then by section)."""
    dumped = config.model_dump(mode=mode, exclude_defaults=exclude_defaults)
    for ref in FIELDS.values():
        source = dumped if ref.section is None else dumped.get(ref.section, {})
        if ref.name in source:
            yield ref, source[ref.name]
