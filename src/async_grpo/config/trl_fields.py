"""The TRL `GRPOConfig` / `ScriptArguments` knobs we implement, as fields mixed into their sections.

Each class below is the base of one section of `sections.py` (`OptimConfig(OptimTRLFields)`, ...), so these
fields live in that section like any other (`config.optim.lr_scheduler_type`, flat key `lr_scheduler_type`).
They sit in their own module only to keep `sections.py` short. Names, meanings and defaults are TRL 1.16's
(transformers 5 `TrainingArguments` for the optimizer and scheduler) unless a description says otherwise;
`trl_names.py` lists what we do with every other TRL field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# transformers 5 `SchedulerType` values that `get_scheduler` can build from a step count alone
# (`reduce_lr_on_plateau` needs a metric and `greedy` a loss trace, neither of which a GRPO run has).
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
# Request fields the rollout sets itself; `generation_kwargs` may not override them (the named field, or the
# IS correction's logprobs / token ids, would silently stop meaning what they say).
RESERVED_GENERATION_KEYS = {
    "n": "num_generations",
    "max_tokens": "max_completion_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "logprobs": None,
    "prompt": None,
    "model": None,
    "stream": None,
    "echo": None,
    "return_token_ids": None,
    "skip_special_tokens": None,
    "prompt_logprobs": None,
}
# model_init_kwargs keys that would change what the trainer holds (its weights must be float32 master weights on
# one device, unquantized) or that have their own field.
_INIT_KWARGS_FIXES = {
    "trust_remote_code": "set the field trust_remote_code instead",
    "device_map": "remove it: the launcher places the model (one device per trainer rank)",
    "quantization_config": "remove it: quantized training (QLoRA) is not supported yet",
    "load_in_4bit": "remove it: quantized training (QLoRA) is not supported yet",
    "load_in_8bit": "remove it: quantized training is not supported yet",
}


class _Mixin(BaseModel):
    """Base of the mixins: the same model config as `sections.Section` (unknown keys refused, assignments
    validated)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunTRLFields(_Mixin):
    """How the policy is loaded (TRL names; top-level fields, beside `model_name_or_path`)."""

    trust_remote_code: bool = Field(
        False,
        description="Allow models and tokenizers that ship their own Python code (TRL name): passed to "
        "transformers' from_pretrained and as `--trust-remote-code` to the vLLM server we launch. Leave it off "
        "unless you trust the model's repository.",
    )
    model_init_kwargs: dict[str, Any] | None = Field(
        None,
        description="Keyword arguments for AutoModelForCausalLM.from_pretrained (TRL name), e.g. "
        "{attn_implementation: sdpa, revision: main}. The trainer keeps float32 master weights: a dtype / "
        "torch_dtype other than float32 is refused (use bf16 for bfloat16 compute).",
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


class DataTRLFields(_Mixin):
    """Hub datasets, order, chat template and periodic validation (TRL / ScriptArguments names)."""

    dataset_config: str | None = Field(
        None,
        description="Configuration (subset) of a hub dataset (TRL ScriptArguments name), e.g. `main` for openai/gsm8k.",
    )
    dataset_train_split: str = Field(
        "train",
        description="Split of `dataset` trained on (TRL ScriptArguments name; "
        "for a hub dataset or a saved DatasetDict).",
    )
    dataset_test_split: str = Field(
        "test",
        description="Split of `dataset` used as held-out prompts when eval_dataset is None (TRL "
        "ScriptArguments name; hub datasets and saved DatasetDicts).",
    )
    shuffle_dataset: bool = Field(
        True,
        description="Visit the training prompts in a seeded random order, "
        "reshuffled each epoch (TRL name); false keeps the dataset's order.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra keyword arguments for the tokenizer's apply_chat_template on conversational "
        "prompts (TRL name), e.g. {enable_thinking: false} for Qwen3.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before every prompt: a string prompt becomes [system, user], a "
        "conversational one without a system message gets it first. Rows with question/answer (GSM8K) or "
        "problem/solution (MATH) columns and no prompt column are turned into prompt + answer with it.",
    )
    eval_strategy: Literal["no", "steps"] = Field(
        "no",
        description="`steps`: also measure the held-out reward every eval_steps optimizer steps during "
        "training, on the run's vLLM server between weight pushes, logged as eval/* at that step (TRL name; NeMo "
        "RL's val_period). The held-out reward is always measured before the first and after the last step.",
    )
    eval_steps: float | None = Field(
        None,
        gt=0,
        description="With eval_strategy=steps: evaluate every this many steps; a value below 1 is a "
        "fraction of max_steps (TRL). None: logging_steps (TRL).",
    )


class SamplingTRLFields(_Mixin):
    """Further vLLM sampling parameters (TRL names)."""

    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Min-p sampling (TRL name): drop tokens below min_p x the top token's "
        "probability. Like top_p it truncates the distribution the trainer scores, so the IS ratio measures it.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description="vLLM repetition penalty (TRL name); 1.0 disables it. It changes the sampling "
        "distribution, so the IS ratio measures it too.",
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra vLLM sampling parameters added to every generation request (TRL name), e.g. "
        "{stop: ['</answer>'], presence_penalty: 0.5}. Keys with a field of their own (n, max_tokens, "
        "temperature, top_p, top_k, min_p, repetition_penalty, seed) or that the IS correction relies on "
        "(logprobs, return_token_ids, ...) are refused.",
    )

    @field_validator("generation_kwargs")
    @classmethod
    def _check_generation_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Refuse keys the rollout sets itself, naming the field to use instead."""
        for key in value or {}:
            if key in RESERVED_GENERATION_KEYS:
                field = RESERVED_GENERATION_KEYS[key]
                fix = f"set {field} instead" if field else "remove it (the rollout sets it for the IS correction)"
                raise ValueError(f"generation_kwargs.{key}: {fix}.")
        return value


class OptimTRLFields(_Mixin):
    """AdamW betas, the learning-rate schedule, epochs and memory savers (transformers / TRL names)."""

    num_train_epochs: float = Field(
        3.0,
        gt=0.0,
        description="With max_steps=-1: train for this many passes over the training prompts, i.e. "
        "max_steps = ceil(num_train_epochs x prompts / prompts per step) (TRL name and default). Ignored when "
        "max_steps > 0.",
    )
    lr_scheduler_type: Literal[LR_SCHEDULERS] = Field(  # type: ignore[valid-type]
        "linear",
        description="Learning-rate schedule over max_steps, transformers.get_scheduler (TRL name and "
        "default: linear decay to 0). `constant` keeps learning_rate.",
    )
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra arguments of the schedule (transformers `scheduler_specific_kwargs`), e.g. "
        "{min_lr_rate: 0.1} for cosine_with_min_lr.",
    )
    warmup_steps: float = Field(
        0,
        ge=0,
        description="Linear warm-up from 0 to learning_rate over this many steps; a value below 1 is a "
        "fraction of max_steps (transformers 5 semantics).",
    )
    warmup_ratio: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Warm-up as a fraction of max_steps (the transformers 4 name, kept for "
        "older TRL configs); not together with warmup_steps > 0.",
    )
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1 (transformers name).")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2 (transformers name).")
    adam_epsilon: float = Field(1e-8, gt=0.0, description="AdamW epsilon (transformers name).")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (transformers' gradient_checkpointing_enable, non-reentrant): same gradients, less memory, about "
        "one more forward of compute (TRL name; TRL's default is true).",
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None,
        description="Arguments of gradient_checkpointing_enable (transformers name); None: {use_reentrant: false}.",
    )
    disable_dropout: bool = Field(False, description="Set every dropout probability of the policy to 0 (TRL name).")

    @field_validator("max_steps", check_fields=False)
    @classmethod
    def _no_zero_steps(cls, value: int) -> int:
        """max_steps is a step count (>= 1) or -1 (epochs); 0 would train nothing."""
        if value == 0:
            raise ValueError("max_steps=0 trains nothing. Fix: give a step count, or -1 for num_train_epochs passes.")
        return value


class OffPolicyTRLFields(_Mixin):
    """NeMo RL's sequence-level trainer/vLLM mismatch gate."""

    seq_logprob_error_threshold: float | None = Field(
        None,
        gt=1.0,
        description="Mask the policy term of sequences whose multiplicative probability error, the "
        "mean over their tokens of exp(|trainer old logp - vLLM sampling logp|), exceeds this (NeMo RL "
        "`seq_logprob_error_threshold` and `seq_mult_prob_error`; about 1 + the mean absolute logprob gap for "
        "small gaps; NeMo's examples use 2.0). Counted as sampling/seq_logprob_error_masked. None: measure only.",
    )


class RewardsTRLFields(_Mixin):
    """DAPO's soft overlong penalty (`builtin:soft_overlong_penalty`)."""

    overlong_buffer_len: int | None = Field(
        None,
        ge=1,
        description="DAPO soft overlong punishment (arXiv 2503.14476 eq. 13; verl `overlong_buffer.len`): "
        "with builtin:soft_overlong_penalty in reward_funcs, a completion longer than max_completion_length - "
        "overlong_buffer_len tokens gets -(excess / overlong_buffer_len) x overlong_penalty_factor, down to "
        "-overlong_penalty_factor at max_completion_length.",
    )
    overlong_penalty_factor: float = Field(
        1.0,
        ge=0.0,
        description="Largest soft overlong penalty (verl "
        "`overlong_buffer.penalty_factor`; TRL's get_soft_overlong_punishment: 1).",
    )


class InferenceTRLFields(_Mixin):
    """vLLM server resources (TRL names; flags of the server we launch)."""

    vllm_gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="`--gpu-memory-utilization` of the vLLM server we launch (TRL name; TRL "
        "applies it to a colocated engine, ours is a separate server). None: vLLM's default (0.9). No effect on "
        "the CPU build.",
    )
    vllm_tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="`--tensor-parallel-size` of the vLLM server we launch (TRL name): the server needs "
        "that many GPUs.",
    )


class TrackingTRLFields(_Mixin):
    """Which tracker, completion tables and system metrics (TRL / transformers names)."""

    report_to: Literal["mlflow", "none"] = Field(
        "mlflow",
        description="Where metrics go (transformers name): `mlflow`, or `none` (no tracking; not with "
        "the pipeline, which registers the model from the MLflow run). TRL's list form is accepted: [] or "
        "['none'] is none, ['mlflow'] or 'all' is mlflow; other trackers are refused.",
    )
    log_completions: bool = Field(
        True,
        description="Log a table of sample completions every log_completions_steps "
        "steps (TRL name; TRL's default is false).",
    )
    log_system_metrics: bool = Field(
        False,
        description="Also record CPU, memory, disk, network and GPU use in the MLflow run (MLflow system "
        "metrics; needs psutil, and pynvml for GPUs). MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true turns it on too.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_from_trl(cls, value: Any) -> Any:
        """TRL's forms: a list of integrations, "all", "none", None -> "mlflow" or "none"; others refused."""
        items = [value] if isinstance(value, str) or value is None else list(value)
        names = {str(v).lower() for v in items if v is not None} - {"none"}
        if not names:
            return "none"
        if names <= {"mlflow", "all"}:
            return "mlflow"
        raise ValueError(
            f"report_to={value!r}: only mlflow (or none) is supported, not {sorted(names - {'mlflow', 'all'})}. "
            "Fix: report_to: mlflow."
        )
