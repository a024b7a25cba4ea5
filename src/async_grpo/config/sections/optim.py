"""The `optim` section: AdamW and its learning-rate schedule (`LR_SCHEDULERS`), the optimizer step's batch geometry
(completions per micro-batch, accumulation, steps or epochs), how the trainer lays out its micro-batches
(padding-free flattening, length grouping, a token budget; `trainer.microbatching`, `trainer.flattening`), and how
the learner computes (threads, chunked LM head, FSDP, bf16 autocast, gradient checkpointing, skipped
zero-advantage micro-batches).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

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


class OptimConfig(Section):
    """The optimizer, the step's batch geometry and how the learner computes it."""

    # Padding-free micro-batches and token-budget micro-batches (axolotl names; trainer/microbatching.py,
    # trainer/flattening.py). TRL 1.16's GRPOConfig has neither (its `padding_free` is an SFTConfig option).
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
    share_prompt_prefix: bool = Field(
        False,
        description="Run each distinct prompt of a micro-batch through the model once and continue its completions "
        "from that pass's keys and values (the model's KV cache), instead of repeating the prompt in every "
        "completion's row (trainer/prefix_sharing.py; verl's `actor.use_prefix_grouper` does the same with the "
        "PrefixGrouper library; TRL has no equivalent). Same logprobs, loss and gradients as the padded path up to "
        "float rounding (tests/trainer/test_prefix_sharing.py); the forward and backward cover U x P + N x T "
        "positions instead of N x (P + T) (U distinct prompts, N completions), so it pays when prompts are long "
        "next to completions: 2.06x the trainer's step on the demo (G = 8, 37-token prompts, <= 12 completion "
        "tokens; benchmarks/trainer_precision.py --shape demo), about even when completions are 4x the prompt. With group_by_length the completions of a prompt are kept in the same micro-batch. "
        "Needs a model whose cache is all full-attention layers (no sliding window, no linear attention), and "
        "not together with gradient_checkpointing, batch_flattening or fsdp (all checked before training).",
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
    # AdamW betas, the learning-rate schedule, epochs and memory savers (transformers / TRL names)
    num_train_epochs: float = Field(
        3.0,
        gt=0.0,
        description="With max_steps=-1: train for this many passes over the training prompts, i.e. "
        "max_steps = ceil(num_train_epochs x prompts / prompts per step) (TRL name and default). Ignored when "
        "max_steps > 0.",
        json_schema_extra=tenant(),
    )
    lr_scheduler_type: Literal[LR_SCHEDULERS] = Field(  # type: ignore[valid-type]
        "linear",
        description="Learning-rate schedule over max_steps, transformers.get_scheduler (TRL name and "
        "default: linear decay to 0). `constant` keeps learning_rate.",
        json_schema_extra=tenant(),
    )
    lr_scheduler_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra arguments of the schedule (transformers `scheduler_specific_kwargs`), e.g. "
        "{min_lr_rate: 0.1} for cosine_with_min_lr.",
        json_schema_extra=tenant(),
    )
    warmup_steps: float = Field(
        0,
        ge=0,
        description="Linear warm-up from 0 to learning_rate over this many steps; a value below 1 is a "
        "fraction of max_steps (transformers 5 semantics).",
        json_schema_extra=tenant(),
    )
    warmup_ratio: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Warm-up as a fraction of max_steps (the transformers 4 name, kept for "
        "older TRL configs); not together with warmup_steps > 0.",
        json_schema_extra=tenant(),
    )
    adam_beta1: float = Field(
        0.9, ge=0.0, lt=1.0, description="AdamW beta1 (transformers name).", json_schema_extra=tenant()
    )
    adam_beta2: float = Field(
        0.999, ge=0.0, lt=1.0, description="AdamW beta2 (transformers name).", json_schema_extra=tenant()
    )
    adam_epsilon: float = Field(
        1e-8, gt=0.0, description="AdamW epsilon (transformers name).", json_schema_extra=tenant()
    )
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
    disable_dropout: bool = Field(
        False, description="Set every dropout probability of the policy to 0 (TRL name).", json_schema_extra=tenant()
    )
    # AdamW, the step's batch geometry and how the learner computes
    learning_rate: float = Field(
        1e-6,
        ge=0.0,
        description="AdamW learning rate (TRL name; TRL default 1e-6). 0 trains nothing: a control run that keeps its "
        "starting weights (e.g. to check that the promotion gate does not promote an unchanged model).",
        json_schema_extra=tenant(),
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.", json_schema_extra=tenant())
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.", json_schema_extra=tenant())
    per_device_train_batch_size: int = Field(
        8,
        ge=1,
        description="Completions per micro-batch on each trainer rank (TRL semantics).",
        json_schema_extra=tenant(),
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step. Completions per step = "
        "per_device_train_batch_size x gradient_accumulation_steps x world size, and must be a "
        "multiple of num_generations (whole groups per step).",
        json_schema_extra=tenant(),
    )
    max_steps: int = Field(
        50,
        ge=-1,
        description="Optimizer steps to run; -1: num_train_epochs passes over the training prompts (TRL).",
        json_schema_extra=tenant(),
    )
    torch_num_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads for the trainer's torch (None: torch's default). On a small CPU "
        "machine shared with the vLLM worker, 1 avoids contention.",
        json_schema_extra=tenant(),
    )
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        description="Apply the LM head this many completion positions at a time (with activation "
        "checkpointing), so (batch, seq, vocab) logits are never materialized. None: full logits.",
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

    @field_validator("max_steps")
    @classmethod
    def _no_zero_steps(cls, value: int) -> int:
        """max_steps is a step count (>= 1) or -1 (epochs); 0 would train nothing."""
        if value == 0:
            raise ValueError("max_steps=0 trains nothing. Fix: give a step count, or -1 for num_train_epochs passes.")
        return value
