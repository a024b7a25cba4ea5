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
from dataclasses import dataclass, field
from typing import Literal

import torch

from async_grpo.trainer.flattening import flatten
from async_grpo.trainer.packing import PackedBatch
from async_grpo.trainer.prefix_sharing import SharedPromptBatch, prompt_keys, prompt_order, share_prompts

logger = logging.getLogger(__name__)


AUTO_MIN_SAVING = 0.10
"""`share_prompt_prefix: auto` runs a chunk's micro-batches with shared prompts only when that layout covers at most
(1 - AUTO_MIN_SAVING) of the model positions the padded layout would: the shared layout's own cost (a second model
call per micro-batch, gathering the prompt's keys and values to the rows) was within the timing noise at 1.5 % fewer
positions on the medium shape of benchmarks/trainer_precision.py, so a 10 % saving is a clear gain."""


@dataclass
class CutPlan:
    """One way to cut a packed chunk: its rows in training order, the micro-batches' row ranges and what they cost.

    Attributes:
        packed: the chunk, reordered (`by_length` or `prefix_sharing.prompt_order`) or as it came.
        spans: [start, end) row ranges of `packed`, one per micro-batch.
        shared: the micro-batches run each distinct prompt once (`prefix_sharing.share_prompts`).
        positions: model positions the micro-batches cover (rows x (prompt + completion) columns padded; distinct
            prompts x prompt columns + rows x completion columns shared); 0 when not estimated.
        oversized: (prompt + completion) lengths, in tokens, of the sequences longer than the token budget.
    """

    packed: PackedBatch
    spans: list[tuple[int, int]]
    shared: bool
    positions: int = 0
    oversized: list[int] = field(default_factory=list)


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
        share_prompt_prefix: True runs each micro-batch's distinct prompts once (`trainer.prefix_sharing`); the
            completions of a prompt are then kept next to each other (`prefix_sharing.prompt_order` instead of
            `by_length`, wherever the completions are reordered) so a micro-batch holds few distinct prompts.
            "auto" plans each chunk both ways and shares when that saves at least `AUTO_MIN_SAVING` of the model
            positions (`CutPlan.positions`). Not with batch_flattening (True raises; "auto" leaves the flattened
            layout alone).

    Attributes:
        oversized: cumulative count of sequences longer than the token budget (metric
            oversized_microbatch_sequences).
        shared_microbatches: cumulative count of micro-batches run with shared prompts (the trainer logs each
            step's share as the metric shared_prompt_microbatches).

    Raises:
        ValueError: micro_batch_size < 1, max_tokens_per_microbatch < 1, share_prompt_prefix not True, False or
            "auto", or share_prompt_prefix=True with batch_flattening.
    """

    def __init__(
        self,
        micro_batch_size: int,
        max_tokens_per_microbatch: int | None = None,
        batch_flattening: bool = False,
        flat_row_tokens: int | None = None,
        group_by_length: bool = False,
        share_prompt_prefix: bool | Literal["auto"] = False,
    ):
        if share_prompt_prefix not in (True, False, "auto"):
            raise ValueError(f"share_prompt_prefix={share_prompt_prefix!r} must be true, false or 'auto'.")
        if share_prompt_prefix is True and batch_flattening:
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
        self.share_prompt_prefix = False if batch_flattening else share_prompt_prefix
        self.oversized = 0
        self.shared_microbatches = 0

    @property
    def by_tokens(self) -> bool:
        """True when micro-batches are cut by the token budget (then `accumulation` weighs by completions)."""
        return self.max_tokens is not None

    def plan(self, packed: PackedBatch) -> CutPlan:
        """How `cut` cuts `packed` (one chunk: N rows of P + T columns): padded, shared, or under "auto" whichever
        covers fewer model positions (shared only when it saves `AUTO_MIN_SAVING` of the padded positions)."""
        if self.share_prompt_prefix != "auto":
            return self._plan(packed, bool(self.share_prompt_prefix), estimate=False)
        padded = self._plan(packed, False, estimate=True)
        shared = self._plan(packed, True, estimate=True)
        return shared if shared.positions <= (1 - AUTO_MIN_SAVING) * padded.positions else padded

    def cut(self, packed: PackedBatch) -> Iterator[PackedBatch]:
        """The micro-batches of `packed` (one chunk: N rows of P + T columns), in row order, or in order of length
        (`group_by_length`, token budget), as `plan` cuts them.

        Yields:
            `PackedBatch` slices (row order), trimmed slices (by length), `FlattenedBatch`es (flattening), or
            `SharedPromptBatch`es (share_prompt_prefix, where rows share a prompt).
        """
        plan = self.plan(packed)
        if plan.oversized and not self.oversized:  # once per run; the metric counts every one
            logger.warning(
                "a sequence of %d tokens exceeds max_tokens_per_microbatch=%d: trained in a micro-batch of "
                "its own (warned once; the metric oversized_microbatch_sequences counts every one). Fix: "
                "raise max_tokens_per_microbatch to at least max_prompt_length + max_completion_length.",
                plan.oversized[0],
                self.max_tokens,
            )
        self.oversized += len(plan.oversized)
        for start, end in plan.spans:
            mb = plan.packed.slice(start, end)
            if self.group_by_length and not self.batch_flattening:
                mb = trim(mb)
            if self.batch_flattening:
                yield flatten(mb, self.flat_row_tokens)
            elif plan.shared:
                mb = share_prompts(mb)
                self.shared_microbatches += isinstance(mb, SharedPromptBatch)
                yield mb
            else:
                yield mb

    def _plan(self, packed: PackedBatch, shared: bool, estimate: bool) -> CutPlan:
        """The plan for one layout; `estimate` fills `CutPlan.positions`."""
        if self.group_by_length:  # similar lengths together (the loss does not depend on the order: `accumulation`)
            packed = take(packed, prompt_order(packed) if shared else by_length(packed))
        if self.by_tokens:
            spans, oversized = self._spans(packed)
        else:
            n = len(packed)
            spans, oversized = [(s, min(s + self.micro_batch_size, n)) for s in range(0, n, self.micro_batch_size)], []
        plan = CutPlan(packed, spans, shared, oversized=oversized)
        if estimate:
            plan.positions = self._positions(plan)
        return plan

    def _positions(self, plan: CutPlan) -> int:
        """Model positions `plan`'s micro-batches cover (`CutPlan.positions`), each trimmed as `cut` trims it; a
        micro-batch that `share_prompts` would leave padded (no repeated prompt, an empty prompt) counts padded."""
        packed = plan.packed
        t_all = packed.completion_ids.size(1)
        p_all = packed.input_ids.size(1) - t_all
        prompt_len = packed.attention_mask[:, :p_all].sum(1)
        comp_len = packed.attention_mask[:, p_all:].sum(1)
        owner = prompt_keys(packed)[1] if plan.shared else None
        total = 0
        for start, end in plan.spans:
            n = end - start
            p, t = p_all, t_all
            if self.group_by_length:
                p, t = int(prompt_len[start:end].max()), max(int(comp_len[start:end].max()), 1)
            distinct = n
            if owner is not None and n > 1 and p > 0 and bool((prompt_len[start:end] > 0).all()):
                distinct = int(owner[start:end].unique().numel())
            total += n * (p + t) if distinct == n else distinct * p + n * t
        return total

    def _spans(self, packed: PackedBatch) -> tuple[list[tuple[int, int]], list[int]]:
        """Row ranges [start, end) whose cost stays within the budget (a longer single row stands alone), and the
        lengths of the rows longer than the budget."""
        t = packed.completion_ids.size(1)
        p = packed.input_ids.size(1) - t
        prompt_len = packed.attention_mask[:, :p].sum(1).tolist()
        comp_len = packed.attention_mask[:, p:].sum(1).tolist()
        spans: list[tuple[int, int]] = []
        oversized: list[int] = []
        start = 0
        max_p = max_c = total = 0
        for i, (pl, cl) in enumerate(zip(prompt_len, comp_len, strict=True)):
            new_p, new_c, new_total = max(max_p, pl), max(max_c, cl), total + pl + cl
            cost = new_total if self.batch_flattening else (i + 1 - start) * (new_p + new_c)
            if i > start and cost > self.max_tokens:  # close the micro-batch before row i
                spans.append((start, i))
                start, new_p, new_c, new_total = i, pl, cl, pl + cl
            if i == start and pl + cl > self.max_tokens:
                oversized.append(pl + cl)
            max_p, max_c, total = new_p, new_c, new_total
        if start < len(prompt_len):
            spans.append((start, len(prompt_len)))
        return spans, oversized

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
