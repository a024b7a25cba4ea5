"""The `compute` section: how the learner computes a step, without changing its update beyond float rounding: the
micro-batch layout (length grouping, padding-free flattening, a token budget, a shared prompt prefix;
`trainer.microbatching`, `trainer.flattening`, `trainer.prefix_sharing`), memory savers (gradient checkpointing, a
chunked LM head), skipped zero-advantage work, precision (bf16 autocast), parallelism (FSDP) and threads, and the
policy's dropout.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant


class ComputeConfig(Section):
    """How the learner lays out and computes a step: micro-batches, memory, precision, parallelism, threads."""

    # Micro-batch layout (axolotl names for flattening and token budgets; trainer/microbatching.py,
    # trainer/flattening.py). TRL 1.16's GRPOConfig has neither (its `padding_free` is an SFTConfig option).
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
        json_schema_extra=tenant(),
    )
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
        json_schema_extra=tenant(),
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
        json_schema_extra=tenant(),
    )
    share_prompt_prefix: bool | Literal["auto"] = Field(
        "auto",
        description="Run each distinct prompt of a micro-batch through the model once and continue its completions "
        "from that pass's keys and values (the model's KV cache), instead of repeating the prompt in every "
        "completion's row (trainer/prefix_sharing.py; verl's `actor.use_prefix_grouper` does the same with the "
        "PrefixGrouper library; TRL has no equivalent). Same logprobs, loss and gradients as the padded path up to "
        "float rounding (tests/trainer/test_prefix_sharing.py); the forward and backward cover U x P + N x T "
        "positions instead of N x (P + T) (U distinct prompts, N completions), so it pays when prompts are long "
        "next to completions: 2.06x the trainer's step on the demo (G = 8, 37-token prompts, <= 12 completion "
        "tokens; benchmarks/trainer_precision.py --shape demo), about even when completions are 4x the prompt. "
        "With group_by_length the completions of a prompt are kept in the same micro-batch. true needs a model "
        "whose cache is all full-attention layers (no sliding window, no linear attention), and not "
        "gradient_checkpointing, batch_flattening or fsdp (all checked before training). auto (the default): "
        "where the model and those settings allow it, each step's batch is planned both ways and shared when that "
        "covers at least 10 % fewer model positions, else padded (trainer/microbatching.py AUTO_MIN_SAVING; the "
        "metric shared_prompt_microbatches counts each step's shared micro-batches); elsewhere the padded layout, without "
        "an error.",
        json_schema_extra=tenant(),
    )
    # memory, skipped work, precision, parallelism, threads (transformers / TRL names where they exist)
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (transformers' gradient_checkpointing_enable, non-reentrant): same gradients, less memory, about "
        "one more forward of compute (TRL name; TRL's default is true).",
        json_schema_extra=tenant(),
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None,
        description="Arguments of gradient_checkpointing_enable (transformers name); None: {use_reentrant: false}.",
        json_schema_extra=tenant(),
    )
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        description="Apply the LM head this many completion positions at a time (with activation "
        "checkpointing), so (batch, seq, vocab) logits are never materialized. None: full logits.",
        json_schema_extra=tenant(),
    )
    skip_zero_advantage_batches: bool = Field(
        False,
        description="Skip the forward/backward of completions with a zero advantage (they carry no policy "
        "gradient; no TRL equivalent). With loss_type dapo or cispo (divided by the step's token count, counted "
        "before the skip) and top_entropy_quantile=1 single completions are dropped before the micro-batch cut "
        "(metric skipped_zero_adv_completions); otherwise only micro-batches whose advantages are all 0 are skipped "
        "(metric skipped_zero_adv_microbatches). Same update up to float rounding; entropy, sampling/* and clip "
        "metrics then average over the completions that ran. Needs beta=0, since a skipped completion would also "
        "lose its KL term.",
        json_schema_extra=tenant(),
    )
    bf16: bool = Field(
        False,
        description="Run the trainer's forward passes under bfloat16 autocast (TRL name), with float32 master "
        "weights, gradients and AdamW state, and float32 logits for the log-softmax. On CPU it needs bfloat16 support "
        "(avx512_bf16 / AMX); on GPU any Ampere or newer. The IS ratio then also sees the trainer's bf16 rounding "
        "(docs/algorithms.md).",
        json_schema_extra=tenant(),
    )
    fsdp: bool = Field(
        False,
        description="With several trainer ranks, shard parameters, gradients and AdamW state across them with "
        "FSDP2 (`fully_shard` per decoder layer and at the root), as accelerate's FSDP2 plugin does, instead of a "
        "full replica per rank. Same update (tests/trainer/test_streaming_reuse_distributed.py). Needs "
        "logprob_chunk_size=None, use_liger_kernel=false and skip_zero_advantage_batches=false. No effect on one rank.",
        json_schema_extra=tenant(),
    )
    torch_num_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads for the trainer's torch (None: torch's default). On a small CPU "
        "machine shared with the vLLM worker, 1 avoids contention.",
        json_schema_extra=tenant(),
    )
    disable_dropout: bool = Field(
        False, description="Set every dropout probability of the policy to 0 (TRL name).", json_schema_extra=tenant()
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
