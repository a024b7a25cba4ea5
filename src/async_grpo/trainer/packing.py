"""Packing a step batch into padded tensors, and the policy's per-token logprobs of the sampled tokens.

`pack_batch` turns the groups of a `TrainBatch` into one left-padded prompt + right-padded completion tensor per
completion, with the groups' per-token loss masks as the completion mask; `completion_logps` scores the sampled
tokens under a model at the sampling temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_grpo.algorithms.distillation import group_baselines
from async_grpo.trainer.logprobs import completion_logps_from_model
from async_grpo.transports.messages import TrainBatch


@dataclass
class PackedBatch:
    """A batch as padded tensors. N = completions, P = longest prompt, T = longest completion.

    Attributes:
        input_ids: (N, P + T) left-padded prompt followed by right-padded completion.
        attention_mask: (N, P + T) 1 on real tokens.
        position_ids: (N, P + T) positions counted from each sequence's first real token.
        completion_ids: (N, T) sampled tokens.
        completion_mask: (N, T) 1 on tokens that enter the loss (the groups' `loss_mask`), 0 on padding.
        sampling_logps: (N, T) vLLM sampling logprobs (0 on padding and on non-finite values, which are never in the
            loss).
        advantages: (N,) per-completion advantages.
        replayed: (N,) bool, True on rows of replayed groups.
        teacher_logps: (N, T) the teacher's logprobs of the sampled tokens (nats, `RolloutGroup.teacher_logprobs`;
            on-policy distillation), NaN where the teacher gave none: on padding, and everywhere when the run does
            not distill.
        teacher_baselines: (N,) each row's leave-one-out baseline for the distillation advantage (nats per token,
            `algorithms.distillation.group_baselines` over its group); 0 for a row of a group without a teacher.
        teacher_topk_ids: (N, T, K) the teacher's K most likely tokens at each completion position, by rank
            (`RolloutGroup.teacher_topk_ids`; `distillation_loss: forward_kl`); 0 where none. K = 0 when the run asks
            no top-k, so every slice of the batch handles it as any other per-token field.
        teacher_topk_logps: (N, T, K) their teacher logprobs (nats, temperature 1); NaN where none (padding, a
            position the teacher did not score, fewer than K entries).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logps: torch.Tensor
    advantages: torch.Tensor
    replayed: torch.Tensor
    teacher_logps: torch.Tensor
    teacher_baselines: torch.Tensor
    teacher_topk_ids: torch.Tensor
    teacher_topk_logps: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def to(self, device: torch.device) -> PackedBatch:
        """The same tensors on `device` (no copy when already there)."""
        return PackedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def slice(self, start: int, end: int) -> PackedBatch:
        """Rows [start, end) as a new PackedBatch (views)."""
        return PackedBatch(*(getattr(self, f)[start:end] for f in self.__dataclass_fields__))

    def carries_gradient(self) -> torch.Tensor:
        """(N,) bool: the rows whose loss has a policy gradient, i.e. a nonzero advantage or a token the teacher
        scored (on-policy distillation gives every scored token an advantage of its own). The rows
        `skip_zero_advantage_batches` may leave out are the others."""
        return (self.advantages != 0) | torch.isfinite(self.teacher_logps).any(dim=1)

    def scored_targets(self) -> torch.Tensor | None:
        """(N, T, 1 + K) the token ids the policy's forward pass scores at each completion position when the teacher
        gave a top-k: the sampled token first, then the teacher's K (`teacher_topk_ids`); None when K = 0 (only the
        sampled tokens are scored)."""
        if self.teacher_topk_ids.size(-1) == 0:
            return None
        return torch.cat([self.completion_ids.unsqueeze(-1), self.teacher_topk_ids], dim=-1)


def pack_batch(batch: TrainBatch, pad_token_id: int, mask_truncated: bool = False) -> PackedBatch:
    """Flatten the groups of `batch` into padded tensors (see `PackedBatch` for shapes).

    `completion_mask` is each completion's `RolloutGroup.loss_mask` (1 on tokens the policy sampled, 0 on tokens it
    did not, e.g. tool output) on its tokens and 0 on padding; with `mask_truncated`, all 0 for a truncated row.
    """
    rows = [
        (grp.prompt_ids, ids, lps, trunc, adv, grp.replayed, lmask, teacher, topk_ids, topk_lps)
        for grp in batch.groups
        for ids, lps, trunc, adv, lmask, teacher, topk_ids, topk_lps in zip(
            grp.completion_ids,
            grp.sampling_logprobs,
            grp.truncated,
            grp.advantages,
            grp.loss_mask,
            grp.teacher_logprobs or [[]] * grp.size,
            grp.teacher_topk_ids or [[]] * grp.size,
            grp.teacher_topk_logprobs or [[]] * grp.size,
            strict=True,
        )  # fmt: skip
    ]
    p = max(len(r[0]) for r in rows)
    t = max(max(len(r[1]) for r in rows), 1)
    # padded Python lists, then one tensor each: a per-row torch.tensor + slice assignment costs ~0.2 ms a row
    input_ids = torch.tensor(
        [[pad_token_id] * (p - len(r[0])) + list(r[0]) + list(r[1]) + [pad_token_id] * (t - len(r[1])) for r in rows],
        dtype=torch.long,
    )
    attention_mask = torch.tensor(
        [[0] * (p - len(r[0])) + [1] * (len(r[0]) + len(r[1])) + [0] * (t - len(r[1])) for r in rows],
        dtype=torch.long,
    )
    completion_mask = torch.tensor(
        [[0.0] * t if (mask_truncated and r[3]) else list(r[6]) + [0.0] * (t - len(r[6])) for r in rows],
        dtype=torch.float32,
    )
    sampling_logps = torch.tensor([list(r[2]) + [0.0] * (t - len(r[2])) for r in rows], dtype=torch.float32)
    # non-finite logprobs sit only on tokens outside the loss (RolloutGroup masks them); 0 there, like padding, so
    # that no inf/NaN reaches a masked product (inf * 0 is NaN)
    sampling_logps = torch.where(torch.isfinite(sampling_logps), sampling_logps, torch.zeros_like(sampling_logps))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor([r[4] for r in rows], dtype=torch.float32)
    replayed = torch.tensor([r[5] for r in rows], dtype=torch.bool)
    nan = float("nan")
    teacher_logps = torch.tensor(
        [list(r[7]) + [nan] * (t - len(r[7])) if r[7] else [nan] * t for r in rows], dtype=torch.float32
    )
    teacher_topk_ids, teacher_topk_logps = _pack_topk(rows, t)
    baselines = [
        b
        for grp in batch.groups
        for b in (
            group_baselines(grp.teacher_logprobs, grp.sampling_logprobs, grp.loss_mask)
            if grp.teacher_logprobs
            else [0.0] * grp.size
        )
    ]
    return PackedBatch(
        input_ids, attention_mask, position_ids, input_ids[:, p:], completion_mask, sampling_logps, advantages,
        replayed, teacher_logps, torch.tensor(baselines, dtype=torch.float32), teacher_topk_ids, teacher_topk_logps,
    )  # fmt: skip


def _pack_topk(rows: list[tuple], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, t, K) top-k ids (0 where none) and logprobs (NaN where none) from each row's `teacher_topk_ids` (index 8)
    and `teacher_topk_logprobs` (index 9), padded as lists and made one tensor each (as `pack_batch` does); K is the
    rows' (0 when no row has a top-k)."""
    k = max((len(pos) for r in rows for pos in r[8][:1]), default=0)
    no_ids, no_logps = [[0] * k], [[float("nan")] * k]
    ids = [list(r[8]) + no_ids * (t - len(r[8])) for r in rows]  # a row without a top-k: all padding
    logps = [list(r[9]) + no_logps * (t - len(r[9])) for r in rows]
    return (
        torch.tensor(ids, dtype=torch.long).reshape(len(rows), t, k),
        torch.tensor(logps, dtype=torch.float32).reshape(len(rows), t, k),
    )


def completion_logps(
    model: torch.nn.Module,
    mb: PackedBatch,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    targets: torch.Tensor | None = None,
):
    """Per-token logprobs (N, T) of `mb.completion_ids` under `model`, and optionally entropies (N, T).

    `chunk_size=None` materializes only the last T+1 positions' logits (`logits_to_keep`); an int applies
    the LM head `chunk_size` positions at a time (see `trainer.logprobs`). Logits are divided by the sampling
    `temperature` (TRL), so the logprobs compare with vLLM's processed sampling logprobs. `targets` (N, T, K), when
    given, are scored instead of the completion ids (`scored_targets`): the logprobs are then (N, T, K).
    """
    return completion_logps_from_model(
        model,
        mb.input_ids,
        mb.attention_mask,
        mb.position_ids,
        mb.completion_ids,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        temperature=temperature,
        targets=targets,
    )
