"""Padding-free batch flattening: a micro-batch's sequences concatenated into rows, attention kept per sequence.

`flatten(mb)` turns a padded `PackedBatch` (N rows of P + T columns) into a `FlattenedBatch`: the same padded
tensors (the loss code keeps seeing (N, T) completion tensors) plus one (1, L) row holding every sequence's real
tokens, prompt then completion, with no padding (L = the sum of the real lengths) and `position_ids` restarting at
0 for each sequence. `flatten(mb, row_tokens=0)` instead packs the sequences (first fit, longest first) into R rows
no wider than the longest sequence, padded at their ends (the padding forms sequences of its own), for attention
kernels without variable-length support (sdpa, eager): they compute the full (L, L) score matrix of a row, masked
or not, so one long row costs O(L^2) attention, while rows as wide as the longest sequence never cost more than
padding (`flat_row_tokens` picks by the model's attention implementation). The model is called with
`attention_mask=None` and these `position_ids`: transformers' masking utilities
(`masking_utils.find_packed_sequence_indices`) then detect the packed sequences from the position resets and
confine attention to each one, for the sdpa and eager kernels alike (flash-attention reads the same
`position_ids`). This is what transformers' `DataCollatorWithFlattening` and axolotl's `batch_flattening`
feed the model; here the flattening happens after the micro-batch is cut, so nothing else changes.

The completion tokens' logprobs and entropies (and hidden states for the fused loss) are gathered from the flat
rows at the positions that predict them and scattered back into (N, T) with 0 on padding, so the objective
(`algorithms.objective`) sees the same tensors as on the padded path (parity: tests/trainer/test_flattening.py).
Compute and memory then scale with the real tokens (plus the rows' end padding) instead of N x (P + T); the
attention of sdpa / eager still scales with each row's width squared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from async_grpo.algorithms import entropy_from_logits, selective_log_softmax
from async_grpo.trainer import packing, prefix_sharing
from async_grpo.trainer.logprobs import chunked_token_logps
from async_grpo.trainer.packing import PackedBatch


@dataclass
class FlatLayout:
    """Where the sequences of a micro-batch sit in its flat row. L = real tokens, K = completion tokens.

    Attributes:
        input_ids: (R, W) the sequences' prompts then completions, without padding between them (R = 1: one row
            of W = L tokens; else R rows padded at their ends).
        position_ids: (R, W) 0, 1, ... restarting at each sequence (and at each row's end padding).
        source: (K,) positions in the flattened (R * W) rows whose next-token prediction is a completion token.
        rows, cols: (K,) where each of those completion tokens sits in the (N, T) completion tensors.
    """

    input_ids: Tensor
    position_ids: Tensor
    source: Tensor
    rows: Tensor
    cols: Tensor


class FlattenedBatch(PackedBatch):
    """A `PackedBatch` (its padded tensors unchanged, shapes in `PackedBatch`) that the model sees flattened.

    Attributes:
        layout: the flat row (`FlatLayout`), built by `flatten`.
    """

    layout: FlatLayout

    def to(self, device: torch.device) -> FlattenedBatch:
        """The same batch on `device` (the layout moves too)."""
        out = flatten_with(PackedBatch.to(self, device), _layout_to(self.layout, device))
        return out

    def slice(self, start: int, end: int) -> PackedBatch:
        """Not supported: flatten after cutting. Raises TypeError."""
        raise TypeError("a FlattenedBatch cannot be sliced: cut the PackedBatch first, then flatten each micro-batch")


def _layout_to(layout: FlatLayout, device: torch.device) -> FlatLayout:
    return FlatLayout(*(getattr(layout, f).to(device) for f in FlatLayout.__dataclass_fields__))


def flatten_with(mb: PackedBatch, layout: FlatLayout) -> FlattenedBatch:
    """`mb` as a `FlattenedBatch` with a given `layout` (no checks; use `flatten`)."""
    out = FlattenedBatch(*(getattr(mb, f) for f in PackedBatch.__dataclass_fields__))
    out.layout = layout
    return out


def flat_row_tokens(model: torch.nn.Module, sharded: bool = False) -> int | None:
    """The `row_tokens` of `flatten` for `model`: None (one row) when its attention implementation has
    variable-length kernels (flash attention: cost linear in the sequences' lengths) or when it is sharded with FSDP
    (only the one-row layout goes through the root module's forward, whose hooks gather and reduce the root's
    parameters: several rows run the decoder body and the LM head apart), else 0 (rows as wide as the longest
    sequence: sdpa and eager materialize a row's whole score matrix)."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return None if sharded or "flash" in impl else 0


def flatten(mb: PackedBatch, row_tokens: int | None = None) -> FlattenedBatch:
    """The padding-free layout of a padded micro-batch (axolotl `batch_flattening`).

    Args:
        mb: a padded micro-batch: N rows of left-padded prompt (P) + right-padded completion (T), as `pack_batch`.
        row_tokens: None: one row of every sequence; an int: rows of at most max(row_tokens, longest sequence)
            tokens, sequences packed first fit in decreasing length (never split).

    Returns:
        A `FlattenedBatch` whose `layout` holds the (R, W) rows (R = 1 and W = attention_mask.sum() for None).

    Raises:
        ValueError: a row without a prompt token (no position predicts its first completion token).
    """
    n, width = mb.input_ids.shape
    t = mb.completion_ids.size(1)
    p = width - t
    prompt_len = mb.attention_mask[:, :p].sum(1)  # (N,)
    comp_len = mb.attention_mask[:, p:].sum(1)  # (N,)
    if n and bool((prompt_len < 1).any()):
        raise ValueError(
            "batch_flattening needs at least one prompt token per sequence (the token before the first "
            "completion token predicts it). Fix: drop empty prompts from the dataset."
        )
    device = mb.input_ids.device
    real = mb.attention_mask.bool()
    lengths = prompt_len + comp_len
    cols_mask = torch.arange(t, device=device).unsqueeze(0) < comp_len.unsqueeze(1)  # (N, T)
    rows, cols = cols_mask.nonzero(as_tuple=True)
    if row_tokens is None:
        input_ids = mb.input_ids[real].unsqueeze(0)  # row-major: sequence 0's tokens, then sequence 1's, ...
        starts = torch.cumsum(lengths, 0) - lengths  # (N,) flat offset of each sequence
        position_ids = (
            torch.arange(int(lengths.sum()), device=device) - torch.repeat_interleave(starts, lengths)
        ).unsqueeze(0)
        source = starts[rows] + prompt_len[rows] - 1 + cols
        return flatten_with(mb, FlatLayout(input_ids, position_ids, source, rows, cols))
    starts, fills = _pack_rows(lengths.tolist(), max(row_tokens, int(lengths.max()) if n else 1))
    width = max(fills)
    input_ids = torch.zeros((len(fills), width), dtype=mb.input_ids.dtype, device=device)
    position_ids = torch.zeros((len(fills), width), dtype=torch.long, device=device)
    for i, start in enumerate(starts):
        r, c = divmod(start, width)
        input_ids[r, c : c + int(lengths[i])] = mb.input_ids[i][real[i]]
        position_ids[r, c : c + int(lengths[i])] = torch.arange(int(lengths[i]), device=device)
    for r, fill in enumerate(fills):  # end padding: a sequence of its own (positions restart), never attended to
        position_ids[r, fill:] = torch.arange(width - fill, device=device)
    offsets = torch.tensor(starts, dtype=torch.long, device=device)
    source = offsets[rows] + prompt_len[rows] - 1 + cols
    return flatten_with(mb, FlatLayout(input_ids, position_ids, source, rows, cols))


def _pack_rows(lengths: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """First fit, longest first: (each sequence's start in the flattened rows of width max(fills), each row's
    fill). Rows are first laid out with `capacity` as their width, then renumbered to the final width."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fills: list[int] = []
    place: dict[int, tuple[int, int]] = {}
    for i in order:
        row = next((r for r, f in enumerate(fills) if f + lengths[i] <= capacity), None)
        if row is None:
            row = len(fills)
            fills.append(0)
        place[i] = (row, fills[row])
        fills[row] += lengths[i]
    width = max(fills) if fills else 1
    return [place[i][0] * width + place[i][1] for i in range(len(lengths))], fills or [0]


def _unflatten(values: Tensor, mb: FlattenedBatch) -> Tensor:
    """(K, ...) values per completion token -> (N, T, ...) with 0 on padding (differentiable)."""
    n, t = mb.completion_ids.shape
    out = values.new_zeros((n, t, *values.shape[1:]))
    return out.index_put((mb.layout.rows, mb.layout.cols), values)


def _flat_hidden(model: torch.nn.Module, mb: FlattenedBatch) -> Tensor:
    """(K, H) decoder hidden states at the positions predicting the completion tokens."""
    body = model.get_decoder()
    out = body(input_ids=mb.layout.input_ids, attention_mask=None, position_ids=mb.layout.position_ids, use_cache=False)
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.size(-1))[mb.layout.source]


def completion_logps(
    model: torch.nn.Module,
    mb: PackedBatch,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    targets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`packing.completion_logps` for padded, flattened and shared-prompt (`trainer.prefix_sharing`) micro-batches.

    Args:
        targets: (N, T, J) token ids to score instead of `mb.completion_ids` (J per position: the sampled token and
            a teacher's top-k, `packing.scored_targets`); None: the completion ids.

    Returns:
        logps (N, T) (or (N, T, J) with `targets`) float32 with gradient, 0 on padding for a `FlattenedBatch`;
        entropies (N, T) or None.
        With `chunk_size=None` the model's own forward runs with `logits_to_keep` = the K predicting positions,
        so the LM head sees only the completion tokens; otherwise the decoder body runs and
        `chunked_token_logps` applies the head `chunk_size` tokens at a time.
    """
    if isinstance(mb, prefix_sharing.SharedPromptBatch):  # each distinct prompt once (share_prompt_prefix)
        return prefix_sharing.completion_logps(model, mb, with_entropy, chunk_size, temperature, targets)
    if not isinstance(mb, FlattenedBatch):
        return packing.completion_logps(
            model, mb, with_entropy=with_entropy, chunk_size=chunk_size, temperature=temperature, targets=targets
        )
    lay = mb.layout
    flat_targets = (mb.completion_ids if targets is None else targets)[lay.rows, lay.cols]  # (K,) or (K, J)
    if chunk_size is None:
        if lay.input_ids.size(0) == 1:  # the model's own head, on the K predicting positions only
            logits = model(
                input_ids=lay.input_ids,
                attention_mask=None,
                position_ids=lay.position_ids,
                logits_to_keep=lay.source,
                use_cache=False,
            ).logits  # (1, K, V)
        else:  # several rows: gather the K positions, then the head
            logits = model.get_output_embeddings()(_flat_hidden(model, mb)).unsqueeze(0)
        logits = logits.float() / temperature  # (1, K, V): one row, so the log-softmax loops once
        logps = selective_log_softmax(logits, flat_targets.unsqueeze(0))[0]
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = _unflatten(entropy_from_logits(logits.detach())[0], mb)
        return _unflatten(logps, mb), entropy
    hidden = _flat_hidden(model, mb).unsqueeze(0)  # (1, K, H)
    logps, entropy = chunked_token_logps(
        hidden, model.get_output_embeddings(), flat_targets.unsqueeze(0), chunk_size, with_entropy, temperature
    )
    return _unflatten(logps[0], mb), (None if entropy is None else _unflatten(entropy[0], mb))


def completion_hidden_states(model: torch.nn.Module, mb: PackedBatch) -> Tensor:
    """Decoder hidden states (N, T, H) at the positions predicting `mb.completion_ids` (0 on padding for a
    `FlattenedBatch`): `logprobs.completion_hidden_states` for padded, flattened and shared-prompt micro-batches."""
    if isinstance(mb, prefix_sharing.SharedPromptBatch):
        return prefix_sharing.completion_hidden_states(model, mb)
    if not isinstance(mb, FlattenedBatch):
        from async_grpo.trainer.logprobs import completion_hidden_states as padded

        return padded(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.completion_ids.size(1))
    return _unflatten(_flat_hidden(model, mb), mb)
