"""The `data` section: the prompts a run trains and evaluates on (files, saved datasets, hub datasets with their
configuration and splits, `builtin:<task>`), their order, system prompt and chat-template arguments, when and on how
many held-out prompts the policy is evaluated, and the supervised warm start before GRPO."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant, volume_path


class DataConfig(Section):
    """Training and held-out prompts, evaluation, and the supervised warm start."""

    # Hub datasets, order, chat template and periodic validation (TRL / ScriptArguments names)
    dataset_config: str | None = Field(
        None,
        description="Configuration (subset) of a hub dataset (TRL ScriptArguments name), e.g. `main` for openai/gsm8k.",
        json_schema_extra=tenant(),
    )
    dataset_train_split: str = Field(
        "train",
        description="Split of `dataset` trained on (TRL ScriptArguments name; "
        "for a hub dataset or a saved DatasetDict).",
        json_schema_extra=tenant(),
    )
    dataset_test_split: str = Field(
        "test",
        description="Split of `dataset` used as held-out prompts when eval_dataset is None (TRL "
        "ScriptArguments name; hub datasets and saved DatasetDicts).",
        json_schema_extra=tenant(),
    )
    shuffle_dataset: bool = Field(
        True,
        description="Visit the training prompts in a seeded random order, "
        "reshuffled each epoch (TRL name); false keeps the dataset's order.",
        json_schema_extra=tenant(),
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra keyword arguments for the tokenizer's apply_chat_template on conversational "
        "prompts (TRL name), e.g. {enable_thinking: false} for Qwen3.",
        json_schema_extra=tenant(),
    )
    system_prompt: str | None = Field(
        None,
        description="A system message put before every prompt: a string prompt becomes [system, user], a "
        "conversational one without a system message gets it first. Rows with question/answer (GSM8K) or "
        "problem/solution (MATH) columns and no prompt column are turned into prompt + answer with it.",
        json_schema_extra=tenant(),
    )
    eval_strategy: Literal["no", "steps"] = Field(
        "no",
        description="`steps`: also measure the held-out reward every eval_steps optimizer steps during "
        "training, on the run's vLLM server between weight pushes, logged as eval/* at that step (TRL name; NeMo "
        "RL's val_period). The held-out reward is always measured before the first and after the last step.",
        json_schema_extra=tenant(),
    )
    eval_steps: float | None = Field(
        None,
        gt=0,
        description="With eval_strategy=steps: evaluate every this many steps; a value below 1 is a "
        "fraction of max_steps (TRL). None: logging_steps (TRL).",
        json_schema_extra=tenant(),
    )
    # The prompts, evaluation and the warm start
    dataset: str = Field(
        "builtin:reverse",
        description="Training prompts: a .jsonl/.json/.parquet file, a folder of them (the newest is read), a "
        "`datasets.save_to_disk` folder, or `builtin:<task>`. `{date}` in a path is today's UTC date (YYYY-MM-DD; in "
        "the pipeline, the run's scheduled date). Needs a `prompt` column (standard string or conversational "
        "messages); other columns are passed to reward functions as keyword arguments (as TRL does).",
        json_schema_extra=volume_path(),
    )
    eval_dataset: str | None = Field(
        None,
        description="Held-out prompts in the same formats as `dataset`. For `builtin:<task>` the "
        "task's held-out split is used when this is None.",
        json_schema_extra=volume_path(),
    )
    eval_num_prompts: int = Field(
        64, ge=1, description="Held-out prompts scored per evaluation.", json_schema_extra=tenant()
    )
    num_generations_eval: int = Field(
        4, ge=1, description="Completions sampled per held-out prompt (TRL name).", json_schema_extra=tenant()
    )
    eval_temperature: float | None = Field(
        None,
        ge=0.0,
        description="Sampling temperature for evaluation; None uses `temperature` (the policy GRPO "
        "optimizes), 0 gives greedy accuracy.",
        json_schema_extra=tenant(),
    )
    max_prompt_length: int = Field(
        256, ge=1, description="Prompts longer than this (tokens) are dropped and counted.", json_schema_extra=tenant()
    )
    warmup_sft_steps: int = Field(
        0,
        ge=0,
        description="Supervised steps on the task's reference answers before GRPO (builtin tasks only).",
        json_schema_extra=tenant(),
    )
    warmup_sft_learning_rate: float = Field(
        1e-3,
        gt=0.0,
        description="Learning rate of the warm-start pass (AdamW, constant). Too high a rate can leave the warm start "
        "unconverged for some seeds; the run logs `warmup/heldout_sequence_accuracy` (held-out reference turns "
        "reproduced exactly) and warns below 0.5.",
        json_schema_extra=tenant(),
    )

    @field_validator("eval_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        """`eval_strategy: no` (TRL's spelling) reads as the boolean False in YAML 1.1: take it as "no"."""
        return "no" if value is False else value
