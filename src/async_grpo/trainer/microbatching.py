"""Cutting a packed step batch into micro-batches: a fixed number of completions, or a token budget; padded or
flattened.

`MicroBatching.cut` yields the micro-batches of one packed chunk, in order and without splitting a sequence:

- fixed (`max_tokens_per_microbatch=None`, the default): `micro_batch_size` completions each (TRL
  `per_device_train_batch_size`). With `group_by_length` (the default) the chunk's completions are first ordered
  by length and each micro-batch is trimmed to its own longest prompt and completion; without it (and always for
  bnpo, whose micro-batch token mean depends on which completions share a micro-batch) they stay in row order and
  every micro-batch is as wide as the chunk (P + T columns), as TRL cuts them.
- token budget (`max_tokens_per_microbatch=B`, axolotl-style): the chunk's completions are ordered by length
  (prompt + completion, stable), then consecutive ones are added while the
  micro-batch's cost stays within B tokens, where the cost is the padded size rows x (longest prompt + longest
  completion of the micro-batch) on the padded path, and the sum of the real lengths (prompt + completion) with
  `batch_flattening`. Each padded micro-batch is trimmed to its own longest prompt and completion, so similar
  lengths share a micro-batch and little padding is left. A sequence longer than B gets a micro-batch of its own
  (counted in `oversized`, never dropped).

Ordering by length puts the completions with a zero advantage first (`skip_zero_advantage_batches` can then
still skip whole micro-batches of them), each part ordered by length. With `batch_flattening` each micro-batch is
then flattened (`trainer.flattening`).

The loss normalization does not depend on the cut (`accumulation`): dapo / cispo divide by the step's token count
anyway; grpo / sapo / dr_grpo / bnpo divide each micro-batch's loss by the number of micro-batches, which under a
token budget becomes "the step's completions (per rank) / this micro-batch's completions", i.e. each micro-batch
weighs by its share of the completions. For grpo, sapo and dr_grpo this gives exactly the gradient of fixed
micro-batches of equal size; bnpo's micro-batch token mean depends on the cut by definition (TRL).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from async_grpo.trainer.flattening import flatten
from async_grpo.trainer.packing import PackedBatch
from async_grpo.trainer.prefix_sharing import prompt_order, share_prompts

logger = logging.getLogger(__name__)


class MicroBatching:
    """How `GRPOLearner` cuts a packed batch into micro-batches.

    Args:
        micro_batch_size: completions per micro-batch when there is no token budget (TRL
            `per_device_train_batch_size`, >= 1).
        max_tokens_per_microbatch: token budget per micro-batch (prompt + completion tokens; padded size on the
            padded path, real tokens with flattening), or None for `micro_batch_size` completions. Axolotl's
            token-budget batching; TRL has no equivalent.
        batch_flattening: concatenate each micro-batch's sequences without padding (axolotl
            `batch_flattening`; transformers `DataCollatorWithFlattening`).
        flat_row_tokens: `flatten`'s row_tokens: None, one row; 0, rows as wide as the longest sequence
            (`flattening.flat_row_tokens(model)` picks by attention implementation).
        group_by_length: order the fixed path's completions by length and trim each micro-batch (transformers
            `TrainingArguments.group_by_length`; 1.2x the trainer's steps/s on benchmarks/trainer_precision.py's
            medium shape). Same gradient for every loss but bnpo (pass False there). The token budget always
            orders by length.
        share_prompt_prefix: run each micro-batch's distinct prompts once (`trainer.prefix_sharing`); the
            completions of a prompt are then kept next to each other (`prefix_sharing.prompt_order` instead of
            `by_length`, wherever the completions are reordered) so a micro-batch holds few distinct prompts.
            Not with batch_flattening.

    Raises:
        ValueError: micro_batch_size < 1, max_tokens_per_microbatch < 1, or share_prompt_prefix with
            batch_flattening.
    """

    def __init__(
        self,
        micro_batch_size: int,
        max_tokens_per_microbatch: int | None = None,
        batch_flattening: bool = False,
        flat_row_tokens: int | None = None,
        group_by_length: bool = False,
        share_prompt_prefix: bool = False,
    ):
        if share_prompt_prefix and batch_flattening:
            raise ValueError(
                "share_prompt_prefix and batch_flattening are two layouts of a micro-batch; only one applies. "
                "Fix: set one of them to false."
            )
        if micro_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size={micro_batch_size} must be >= 1. Fix: use e.g. 8.")
        if max_tokens_per_microbatch is not None and max_tokens_per_microbatch < 1:
            raise ValueError(
                f"max_tokens_per_microbatch={max_tokens_per_microbatch} must be >= 1 or None. Fix: use "
                "e.g. 4096, or null for per_device_train_batch_size completions per micro-batch."
            )
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_microbatch
        self.batch_flattening = batch_flattening
        self.flat_row_tokens = flat_row_tokens
        self.group_by_length = group_by_length or self.by_tokens
        self.share_prompt_prefix = share_prompt_prefix
        self.oversized = 0  # cumulative: sequences longer than the budget, trained in a micro-batch of their own

    @property
    def by_tokens(self) -> bool:
        """True when micro-batches are cut by the token budget (then `accumulation` weighs by completions)."""
        return self.max_tokens is not None

    def cut(self, packed: PackedBatch) -> Iterator[PackedBatch]:
        """The micro-batches of `packed` (one chunk: N rows of P + T columns), in row order, or in order of length
        (`group_by_length`, token budget).

        Yields:
            `PackedBatch` slices (row order), trimmed slices (by length), `FlattenedBatch`es (flattening), or
            `SharedPromptBatch`es (share_prompt_prefix, where rows share a prompt).
        """
        if self.group_by_length:  # similar lengths together (the loss does not depend on the order: `accumulation`)
            packed = take(packed, prompt_order(packed) if self.share_prompt_prefix else by_length(packed))
        spans = (
            self._spans(packed)
            if self.by_tokens
            else [
                (start, min(start + self.micro_batch_size, len(packed)))
                for start in range(0, len(packed), self.micro_batch_size)
            ]
        )
        for start, end in spans:
            mb = packed.slice(start, end)
            if self.group_by_length and not self.batch_flattening:
                mb = trim(mb)
            if self.batch_flattening:
                yield flatten(mb, self.flat_row_tokens)
            else:
                yield share_prompts(mb) if self.share_prompt_prefix else mb

    def _spans(self, packed: PackedBatch) -> list[tuple[int, int]]:
        """Row ranges [start, end) whose cost stays within the budget (a longer single row stands alone)."""
        t = packed.completion_ids.size(1)
        p = packed.input_ids.size(1) - t
        prompt_len = packed.attention_mask[:, :p].sum(1).tolist()
        comp_len = packed.attention_mask[:, p:].sum(1).tolist()
        spans: list[tuple[int, int]] = []
        start = 0
        max_p = max_c = total = 0
        for i, (pl, cl) in enumerate(zip(prompt_len, comp_len, strict=True)):
            new_p, new_c, new_total = max(max_p, pl), max(max_c, cl), total + pl + cl
            cost = new_total if self.batch_flattening else (i + 1 - start) * (new_p + new_c)
            if i > start and cost > self.max_tokens:  # close the micro-batch before row i
                spans.append((start, i))
                start, new_p, new_c, new_total = i, pl, cl, pl + cl
            if i == start and pl + cl > self.max_tokens:
                if not self.oversized:  # once per run; the metric oversized_microbatch_sequences counts them all
                    logger.warning(
                        "a sequence of %d tokens exceeds max_tokens_per_microbatch=%d: trained in a micro-batch of "
                        "its own (warned once; the metric oversized_microbatch_sequences counts every one). Fix: "
                        "raise max_tokens_per_microbatch to at least max_prompt_length + max_completion_length.",
                        pl + cl,
                        self.max_tokens,
                    )
                self.oversized += 1
            max_p, max_c, total = new_p, new_c, new_total
        if start < len(prompt_len):
            spans.append((start, len(prompt_len)))
        return spans

    def completions_per_rank(
        self, micro: list, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], world_size: int
    ) -> float:
        """The step's completions summed over the ranks by `all_reduce_sum`, / world_size (0.0 without a token
        budget, where it is not needed and no collective runs). `micro`: this rank's micro-batches."""
        if not self.by_tokens:
            return 0.0
        return float(all_reduce_sum(torch.tensor(float(sum(map(len, micro)))))) / world_size

    def accumulation(self, mb: PackedBatch, step_accumulation: float, completions_per_rank: float) -> float:
        """The `gradient_accumulation_steps` that `mb`'s loss is divided by (grpo / sapo / dr_grpo / bnpo).

        Args:
            mb: the micro-batch (N completions).
            step_accumulation: the fixed path's value (real micro-batches of all ranks / world size).
            completions_per_rank: the step's completions over all ranks / world size (token budget only).

        Returns:
            `step_accumulation` without a token budget; else completions_per_rank / N, so that the micro-batches'
            losses sum to the completion-weighted mean, as equal fixed micro-batches give.
        """
        if not self.by_tokens:
            return step_accumulation
        return completions_per_rank / max(len(mb), 1)


def by_length(packed: PackedBatch) -> torch.Tensor:
    """(N,) row order: completions without a policy gradient (`PackedBatch.carries_gradient`: a zero advantage and
    no teacher-scored token) first, then the others, each part by length (prompt + completion tokens), stable."""
    order = torch.sort(packed.attention_mask.sum(1), stable=True).indices
    nonzero = packed.carries_gradient()[order].to(torch.int8)
    return order[torch.sort(nonzero, stable=True).indices]


def take(packed: PackedBatch, index: torch.Tensor) -> PackedBatch:
    """Rows `index` (a (M,) long tensor) of `packed`, in that order."""
    return PackedBatch(*(getattr(packed, f)[index] for f in PackedBatch.__dataclass_fields__))


def trim(mb: PackedBatch) -> PackedBatch:
    """`mb` without the columns that are padding in every row (left of the longest prompt, right of the longest
    completion): (N, p + t) with p, t the micro-batch's own longest prompt and completion (t >= 1)."""
    t_all = mb.completion_ids.size(1)
    p_all = mb.input_ids.size(1) - t_all
    p = int(mb.attention_mask[:, :p_all].sum(1).max())
    t = max(int(mb.attention_mask[:, p_all:].sum(1).max()), 1)
    cols = slice(p_all - p, p_all + t)
    return PackedBatch(
        mb.input_ids[:, cols],
        mb.attention_mask[:, cols],
        mb.position_ids[:, cols],
        mb.completion_ids[:, :t],
        mb.completion_mask[:, :t],
        mb.sampling_logps[:, :t],
        mb.advantages,
        mb.replayed,
        mb.teacher_logps[:, :t],
        mb.teacher_baselines,
        mb.teacher_topk_ids[:, :t],
        mb.teacher_topk_logps[:, :t],
    )


def accumulate_metrics(sums: dict[str, float], weights: dict[str, float], metrics: dict[str, float], w: float) -> None:
    """Fold one micro-batch's `metrics` (weight `w`, its loss tokens) into the step's token-weighted running sums
    `sums` / `weights` (in place; the mean is sums[k] / weights[k]); "/min" and "/max" keys keep the extreme."""
    for k, v in metrics.items():
        v = float(v)
        if k.endswith(("/min", "/max")):
            sums[k] = (min if k.endswith("/min") else max)(sums.get(k, v), v)
            weights[k] = 1.0
        else:
            sums[k] = sums.get(k, 0.0) + v * w
            weights[k] = weights.get(k, 0.0) + w
