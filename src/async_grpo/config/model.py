"""`GRPOConfig`: the top-level fields, the fourteen sections, the flat-key mapper, cross-field checks and
the values derived from several sections."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from async_grpo.config.keys import ALIASES, FIELDS, flatten_mapping, nest_mapping
from async_grpo.config.sections import (
    SECTIONS,
    BatchShapingConfig,
    CheckpointConfig,
    DataConfig,
    DataProducerConfig,
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
    check_environments,
    check_peft,
    check_tools,
)
from async_grpo.config.sections.rewards import MAX_GUIDED_JUDGE_SCORE
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
    optim: OptimConfig = _section(OptimConfig)
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
    peft: PeftConfig = _section(PeftConfig)

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
        """Cross-field checks; each error names the fields (flat names) and the fix."""
        sampling, optim, loss, off, shaping = self.sampling, self.optim, self.loss, self.off_policy, self.batch_shaping
        rewards, producer = self.rewards, self.producer
        completions = optim.per_device_train_batch_size * optim.gradient_accumulation_steps
        if completions % sampling.num_generations != 0:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions per step "
                f"is not a multiple of num_generations={sampling.num_generations}; every step must hold whole "
                f"groups. Fix: set per_device_train_batch_size to a multiple of {sampling.num_generations}."
            )
        if rewards.reward_weights is not None and len(rewards.reward_weights) != len(rewards.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(rewards.reward_weights)} entries but reward_funcs has "
                f"{len(rewards.reward_funcs)}. Fix: give one weight per reward function, or drop reward_weights."
            )
        judged = "builtin:llm_judge" in rewards.reward_funcs
        if judged and not (rewards.judge_url or rewards.judge_model_name_or_path):
            raise ValueError(
                "reward_funcs has builtin:llm_judge but judge_url is not set. Fix: set judge_url to the judge's "
                "OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1, or judge_model_name_or_path to a model "
                "the launcher serves as the judge."
            )
        if rewards.judge_url and rewards.judge_model_name_or_path:
            raise ValueError(
                "judge_url and judge_model_name_or_path are both set. Fix: give judge_url for a judge that is "
                "already served, or judge_model_name_or_path for one the launcher serves, not both."
            )
        if judged:
            missing = [p for p in ("{prompt}", "{completion}") if p not in rewards.judge_rubric]
            if missing:
                raise ValueError(
                    f"judge_rubric has no {' or '.join(missing)}. Fix: put both placeholders in the rubric."
                )
            if rewards.judge_guided_score and (
                rewards.judge_max_score != int(rewards.judge_max_score)
                or rewards.judge_max_score > MAX_GUIDED_JUDGE_SCORE
            ):
                raise ValueError(
                    f"judge_max_score={rewards.judge_max_score:g} with judge_guided_score: the scale must be whole "
                    f"numbers up to {MAX_GUIDED_JUDGE_SCORE}. Fix: set judge_max_score to an integer, or judge_guided_score: false."
                )
        if off.vllm_importance_sampling_clip_min is not None and (
            off.vllm_importance_sampling_clip_min >= off.vllm_importance_sampling_cap
        ):
            raise ValueError(
                "vllm_importance_sampling_clip_min must be below vllm_importance_sampling_cap. "
                "Fix: lower clip_min or raise the cap."
            )
        if (
            loss.use_liger_kernel
            and loss.importance_sampling_level == "sequence"
            and loss.loss_type in ("cispo", "sapo")
        ):
            raise ValueError(
                f"use_liger_kernel: liger-kernel 0.8.5 has no sequence-level importance sampling for "
                f"loss_type={loss.loss_type}. Fix: set use_liger_kernel=false or importance_sampling_level=token."
            )
        if optim.fsdp and (
            optim.logprob_chunk_size is not None or loss.use_liger_kernel or optim.skip_zero_advantage_batches
        ):
            raise ValueError(
                "fsdp shards the LM head and runs the same passes on every rank, so it cannot combine with "
                "logprob_chunk_size, use_liger_kernel or skip_zero_advantage_batches. Fix: unset those, or set "
                "fsdp=false."
            )
        if optim.share_prompt_prefix:
            clashes = [
                name
                for name, on in (
                    ("gradient_checkpointing", optim.gradient_checkpointing),
                    ("batch_flattening", optim.batch_flattening),
                    ("fsdp", optim.fsdp),
                )
                if on
            ]
            if clashes:
                raise ValueError(
                    f"share_prompt_prefix cannot combine with {', '.join(clashes)} (transformers drops the shared "
                    "prompt's KV cache inside checkpointed layers; flattening is another micro-batch layout; fsdp is "
                    f"not supported with it yet). Fix: set share_prompt_prefix=false, or {', '.join(clashes)}=false."
                )
        if loss.loss_type == "cispo" and self.epsilon_high_value < 1.0:
            raise ValueError(
                f"loss_type=cispo caps the importance ratio itself at epsilon_high (epsilon_max of ScaleRL, "
                f"arXiv 2510.13786), but epsilon_high is {self.epsilon_high_value}: every on-policy ratio of 1 would "
                "be clamped, which only shrinks the learning rate. Fix: set epsilon_high, e.g. 5.0 (ScaleRL's and "
                "TRL's recommendation)."
            )
        if optim.skip_zero_advantage_batches and loss.beta > 0:
            raise ValueError(
                "skip_zero_advantage_batches needs beta=0: a skipped micro-batch would lose its KL term. "
                "Fix: set beta=0 or skip_zero_advantage_batches=false."
            )
        if shaping.replay_buffer_size > 0 and shaping.dynamic_sampling:
            raise ValueError(
                "replay_buffer_size > 0 has no effect with dynamic_sampling=true: dynamic sampling never lets a "
                "zero-std group into a batch, so there is nothing to replace. Fix: set replay_buffer_size=0 or "
                "dynamic_sampling=false."
            )
        if producer.streaming_min_groups is not None:
            k, g = producer.streaming_min_groups, sampling.num_generations
            problems = []
            if self.groups_per_step % k:
                problems.append(f"groups_per_step={self.groups_per_step} is not a multiple of it")
            if (k * g) % optim.per_device_train_batch_size:
                problems.append(
                    f"a chunk of {k * g} completions is not a multiple of per_device_train_batch_size="
                    f"{optim.per_device_train_batch_size} (micro-batches would straddle chunks)"
                )
            if rewards.scale_rewards == "batch":
                problems.append("scale_rewards=batch needs the whole step's rewards before any advantage")
            if rewards.multi_objective_aggregation == "normalize_then_sum":
                problems.append("normalize_then_sum z-scores across the whole step")
            if self.rollout_reuse > 1:
                problems.append("steps_per_generation/mini_epochs/num_iterations > 1 reuse a complete rollout")
            if problems:
                raise ValueError(
                    f"streaming_min_groups={k}: " + "; ".join(problems) + ". Fix: pick a divisor of groups_per_step "
                    "whose completions fill whole micro-batches, and group scaling without reuse, or unset "
                    "streaming_min_groups."
                )
        if producer.streaming_min_groups is not None and self.inference.resource_sharing == "time_slice":
            raise ValueError(
                "streaming_min_groups overlaps training with generation, and resource_sharing=time_slice "
                "pauses generation while the trainer computes. Fix: set resource_sharing: overlap (or "
                "auto), or unset streaming_min_groups."
            )
        if producer.data_producer is not None and (
            shaping.dynamic_sampling
            or shaping.replay_buffer_size
            or shaping.reroll_start_fraction < 1.0
            or producer.streaming_min_groups
        ):
            raise ValueError(
                "data_producer replaces the builtin orchestrator, which is where dynamic_sampling, "
                "replay_buffer_size, reroll_start_fraction and streaming_min_groups live. Fix: turn those off or "
                "implement them in your producer."
            )
        if self.full_determinism and (shaping.dynamic_sampling or shaping.reroll_start_fraction < 1.0):
            raise ValueError(
                "full_determinism with dynamic_sampling or reroll_start_fraction < 1: which prompt is launched next "
                "would depend on when earlier groups finished scoring. Fix: set dynamic_sampling=false and "
                "reroll_start_fraction=1.0, or full_determinism=false."
            )
        self._check_trl_fields()
        if sampling.max_completion_length + 8 > self.inference.vllm_max_model_len:
            raise ValueError(
                f"max_completion_length={sampling.max_completion_length} leaves no room for a prompt within "
                f"vllm_max_model_len={self.inference.vllm_max_model_len}. Fix: raise vllm_max_model_len."
            )
        if self.checkpoint.on_collapse == "rollback" and not self.checkpoint.save_steps:
            raise ValueError(
                "on_collapse=rollback goes back to a checkpoint, but save_steps is 0 (none is written). Fix: set "
                "save_steps (e.g. the eval_steps), or on_collapse: stop."
            )
        if self.checkpoint.on_collapse == "rollback" and self.full_determinism:
            raise ValueError(
                "on_collapse=rollback with full_determinism: the restored run would replay the same schedule into the "
                "same collapse. Fix: on_collapse: stop (and look at the collapsing schedule), or full_determinism: false."
            )
        check_tools(self)
        check_environments(self)
        check_peft(self)
        return self

    def _check_trl_fields(self) -> None:
        """Cross-field checks of the TRL knobs (`sections/optim.py`, `sections/rewards.py`); each error names the fields
        and the fix."""
        optim, rewards = self.optim, self.rewards
        if optim.warmup_ratio and optim.warmup_steps:
            raise ValueError(
                f"warmup_ratio={optim.warmup_ratio} and warmup_steps={optim.warmup_steps} are both "
                "set. Fix: keep one (warmup_steps below 1 is a fraction of max_steps)."
            )
        overlong = "builtin:soft_overlong_penalty" in rewards.reward_funcs
        if overlong != (rewards.overlong_buffer_len is not None):
            raise ValueError(
                "builtin:soft_overlong_penalty and overlong_buffer_len go together (DAPO's soft overlong "
                "punishment). Fix: set both, or neither."
            )
        if overlong and rewards.overlong_buffer_len >= self.sampling.max_completion_length:
            raise ValueError(
                f"overlong_buffer_len={rewards.overlong_buffer_len} must be below max_completion_length="
                f"{self.sampling.max_completion_length}. Fix: e.g. a quarter of max_completion_length."
            )

    # ------------------------------------------------------------------ derived values (across sections)
    @property
    def groups_per_step(self) -> int:
        """Prompt groups consumed per optimizer step (single trainer rank)."""
        return (
            self.optim.per_device_train_batch_size
            * self.optim.gradient_accumulation_steps
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
        return math.ceil(self.batch_shaping.reroll_start_fraction * self.optim.max_steps)

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
    """False for a section name given a field's value: `tools: [...]` is the field `tools.tools`."""
    return key not in SECTIONS or value is None or isinstance(value, (Mapping, BaseModel))


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
