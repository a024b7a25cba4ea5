"""How the trainer lays out its micro-batches: padding-free flattening and a token budget (axolotl names).

`MicroBatchFields` is a base of `sections.OptimConfig`, so these fields live in the optim section like any other
(`config.optim.batch_flattening`, flat key `batch_flattening`). They sit in their own module only to keep
`sections.py` short. TRL 1.16's GRPOConfig has neither (its `padding_free` is an SFTConfig option).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MicroBatchFields(BaseModel):
    """Padding-free micro-batches and token-budget micro-batches (trainer/microbatching.py, trainer/flattening.py).

    Raises (pydantic ValidationError, naming the field): max_tokens_per_microbatch < 1.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    batch_flattening: bool = Field(
        False,
        description="Padding-free micro-batches (axolotl `batch_flattening`; transformers "
        "DataCollatorWithFlattening; TRL SFT `padding_free`): each micro-batch's sequences (prompt + completion) are "
        "concatenated without padding, position_ids restarting at 0 per sequence, and transformers confines "
        "attention to each sequence: one (1, sum of lengths) row with flash attention, else (sdpa, eager: they "
        "compute a row's whole score matrix) rows no wider than the longest sequence, packed first fit. Same "
        "logprobs, loss and gradients as padding up to float rounding (tests/trainer/test_flattening.py); the MLP "
        "and LM-head work scales with the real tokens instead of rows x (longest prompt + longest completion), so "
        "it pays when completion lengths vary a lot.",
    )
    group_by_length: bool = Field(
        True,
        description="Order each step's completions by length before cutting the fixed micro-batches "
        "(per_device_train_batch_size completions each), and trim every micro-batch to its own longest prompt and "
        "completion (transformers `TrainingArguments.group_by_length`, which defaults to false there). The step's "
        "gradient does not change, because every micro-batch keeps the same number of completions and dapo / cispo "
        "divide by the step's token count. Less padding means fewer positions through the model: 1.2x the trainer's "
        "steps/s on benchmarks/trainer_precision.py --shape medium. Ignored for loss_type bnpo (its per-micro-batch "
        "token mean depends on which completions share a micro-batch: TRL's row order is kept). Completions with a "
        "zero advantage come first, so skip_zero_advantage_batches still finds whole micro-batches of them.",
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        description="Token budget per micro-batch, in prompt + completion tokens (axolotl-style token "
        "batching; no TRL equivalent). Consecutive completions join a micro-batch while rows x longest row (padded; "
        "each micro-batch is trimmed to its own longest row) or the sum of lengths (batch_flattening) stays within "
        "it; a longer single sequence gets a micro-batch of its own (metric oversized_microbatch_sequences), never "
        "split or dropped. None: per_device_train_batch_size completions per micro-batch. The step's gradient does "
        "not change: each micro-batch's loss weighs by its share of the completions (grpo, sapo, dr_grpo) or the "
        "step's token count (dapo, cispo); only bnpo's per-micro-batch token mean depends on the cut, by definition.",
    )

    @field_validator("max_tokens_per_microbatch")
    @classmethod
    def _positive_budget(cls, value: int | None) -> int | None:
        """Refuse a budget below one token (ValueError naming the fix)."""
        if value is not None and value < 1:
            raise ValueError(
                f"must be a positive number of tokens or null (got {value}). Fix: set it to at least "
                "max_prompt_length + max_completion_length (e.g. 4096), or null for "
                "per_device_train_batch_size completions per micro-batch"
            )
        return value
