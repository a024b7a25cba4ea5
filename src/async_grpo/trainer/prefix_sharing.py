"""Shared-prompt forward passes: each distinct prompt of a micro-batch goes through the model once, and its
completions attend to that one pass's keys and values instead of recomputing the prompt.

GRPO trains G completions of every prompt, and the padded path runs each completion's prompt again: N x (P + T)
positions per forward and backward. Here the U distinct prompts of a micro-batch run once (U x P positions, with
`use_cache=True`), each layer's keys and values are gathered to the N rows (`Cache.batch_select_indices`, an
indexing that autograd differentiates), and the completions run as the continuation of their prompts (N x T
positions, `past_key_values` = the gathered cache, the padded path's attention mask and position ids), as
transformers' `generate` continues a prompt. The position that predicts a completion's first token is its prompt's
last position, so the (N, T) logits are the prompt pass's last logits (gathered) followed by the completion pass's
first T - 1. The gradient reaches the prompt pass through the gathered keys and values, so logprobs, entropies,
the loss and the gradients equal the padded path's up to float rounding (tests/trainer/test_prefix_sharing.py),
while the work drops to U x P + N x T positions: with G = 8 and prompts three times as long as the completions,
about a third. This is the shared-prefix forward of PrefixGrouper (verl `actor.use_prefix_grouper`), done with the
model's own KV cache instead of a patched attention.

What it needs from the model (`check_model`, before the first step): a transformers model whose cache is made only
of full-attention `DynamicLayer`s (no sliding window, which would drop prompt keys that a completion still sees in
the padded path; no linear-attention or state-space layers, whose state is not a per-position key/value), and no
gradient checkpointing (transformers' `GradientCheckpointingLayer` sets `past_key_values=None` inside a
checkpointed layer, so the completions would silently lose their prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_grpo.algorithms import entropy_from_logits, selective_log_softmax
from async_grpo.trainer.logprobs import chunked_token_logps
from async_grpo.trainer.packing import PackedBatch


@dataclass
class PromptSharing:
    """The distinct prompts of a micro-batch of N rows (U of them, U < N) and which one each row continues.

    Attributes:
        prompt_ids: (U, P) the distinct prompts, left-padded as in the micro-batch.
        prompt_mask: (U, P) 1 on real prompt tokens.
        prompt_positions: (U, P) position ids, counted from each prompt's first real token.
        owner: (N,) long, row i's prompt is prompt_ids[owner[i]].
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    prompt_positions: Tensor
    owner: Tensor


class SharedPromptBatch(PackedBatch):
    """A `PackedBatch` (its padded tensors unchanged, shapes in `PackedBatch`) whose rows share prompts: the model sees
    each distinct prompt once (`completion_logps`, `completion_hidden_states` here).

    Attributes:
        sharing: the distinct prompts and each row's (`PromptSharing`), built by `share_prompts`.
    """

    sharing: PromptSharing

    def to(self, device: torch.device) -> SharedPromptBatch:
        """The same batch on `device` (the distinct prompts move too)."""
        moved = PackedBatch.to(self, device)
        sharing = PromptSharing(*(getattr(self.sharing, f).to(device) for f in PromptSharing.__dataclass_fields__))
        return _with_sharing(moved, sharing)

    def slice(self, start: int, end: int) -> PackedBatch:
        """Not supported: share after cutting. Raises TypeError."""
        raise TypeError("a SharedPromptBatch cannot be sliced: cut the PackedBatch first, then share each micro-batch")


def _with_sharing(mb: PackedBatch, sharing: PromptSharing) -> SharedPromptBatch:
    out = SharedPromptBatch(*(getattr(mb, f) for f in PackedBatch.__dataclass_fields__))
    out.sharing = sharing
    return out


def prompt_keys(mb: PackedBatch) -> tuple[Tensor, Tensor]:
    """(U, 2P) the distinct (prompt ids, prompt mask) rows of `mb` and (N,) the index of each row's among them.

    The mask is part of the key: two prompts that differ only in a leading real token equal to the pad id (e.g. an
    EOS that doubles as pad) are different prompts."""
    p = mb.input_ids.size(1) - mb.completion_ids.size(1)
    keys = torch.cat([mb.input_ids[:, :p], mb.attention_mask[:, :p]], dim=1)
    unique, owner = torch.unique(keys, dim=0, return_inverse=True)
    return unique, owner


def share_prompts(mb: PackedBatch) -> PackedBatch:
    """`mb` as a `SharedPromptBatch` when two or more of its rows have the same prompt, else `mb` itself.

    A micro-batch with an empty prompt (no real prompt token: nothing predicts its first completion token) is
    returned as it is, so it takes the padded path.
    """
    n = len(mb)
    if n < 2 or isinstance(mb, SharedPromptBatch):
        return mb
    p = mb.input_ids.size(1) - mb.completion_ids.size(1)
    if p < 1 or bool((mb.attention_mask[:, p - 1] == 0).any()):  # left padding: the last column is real if any is
        return mb
    unique, owner = prompt_keys(mb)
    if unique.size(0) == n:
        return mb
    prompt_ids, prompt_mask = unique[:, :p], unique[:, p:]
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as `pack_batch` counts them
    return _with_sharing(mb, PromptSharing(prompt_ids, prompt_mask, positions, owner))


def prompt_order(packed: PackedBatch) -> Tensor:
    """(N,) row order that puts completions of the same prompt next to each other, so that a micro-batch holds few
    distinct prompts: completions with a zero advantage first (as `microbatching.by_length`, so that
    skip_zero_advantage_batches still finds whole micro-batches of them), then by prompt length, then by prompt,
    then by completion length; stable."""
    t = packed.completion_ids.size(1)
    p = packed.input_ids.size(1) - t
    _, owner = prompt_keys(packed)
    order = torch.sort(packed.attention_mask[:, p:].sum(1), stable=True).indices  # completion length
    for key in (owner, packed.attention_mask[:, :p].sum(1), packed.carries_gradient().to(torch.int8)):
        order = order[torch.sort(key[order], stable=True).indices]  # least significant key first
    return order


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run shared-prompt passes (see the module docstring), with the fix, or None when it can:
    gradient checkpointing is on, the model has no transformers config, or its cache has a layer other than a
    full-attention `DynamicLayer` (sliding window, linear attention, state space)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if getattr(model, "is_gradient_checkpointing", False):
        return (
            "share_prompt_prefix needs gradient_checkpointing=false: transformers drops past_key_values inside a "
            "checkpointed layer, so completions would lose their prompt. Fix: set one of them to false."
        )
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return (
            f"share_prompt_prefix needs a transformers model with a config; got {type(model).__name__}. "
            "Fix: set share_prompt_prefix=false."
        )
    layers = DynamicCache(config=config).layers
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if other or not layers:
        return (
            f"share_prompt_prefix needs a cache of full-attention DynamicLayers; {config.model_type} has "
            f"{', '.join(other) or 'no cache layers'} (sliding-window or recurrent layers cannot continue a "
            "shared prompt exactly). Fix: set share_prompt_prefix=false."
        )
    return None


def check_model(model: torch.nn.Module) -> None:
    """Raise before training when `model` cannot run shared-prompt passes (`unsupported_reason`).

    Raises:
        ValueError: gradient checkpointing is on, the model has no transformers config, or its cache has a layer
            other than a full-attention `DynamicLayer` (sliding window, linear attention, state space); the message
            names the fix (share_prompt_prefix=false, or gradient_checkpointing=false).
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(reason)


def _gathered_cache(cache, owner: Tensor):
    """The prompt pass's cache with its batch dimension gathered from U prompts to N rows (in place)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise ValueError(
            f"share_prompt_prefix: the prompt pass returned a cache of {', '.join(kinds)}, not full-attention "
            "DynamicLayers. Fix: set share_prompt_prefix=false."
        )
    cache.batch_select_indices(owner)
    return cache


def _continued(mb: SharedPromptBatch, run: Callable[[dict, int], tuple[Tensor, Any]]) -> Tensor:
    """(N, T, D) outputs at the positions predicting `mb.completion_ids`: the prompt pass's last position gathered to
    the rows, then the completion pass's first T - 1, the completions continuing from the gathered cache.

    `run(inputs, keep)` runs the model (or its body) on `inputs` (`use_cache=True`) and returns its outputs at the
    last `keep` positions and the cache it filled."""
    sh = mb.sharing
    p = mb.input_ids.size(1) - mb.completion_ids.size(1)
    t = mb.completion_ids.size(1)
    prompt = {"input_ids": sh.prompt_ids, "attention_mask": sh.prompt_mask, "position_ids": sh.prompt_positions}
    last, cache = run({**prompt, "use_cache": True}, 1)
    head = last[sh.owner]  # (N, 1, D)
    if t == 1:
        return head
    continuation = {
        "input_ids": mb.completion_ids,
        "attention_mask": mb.attention_mask,
        "position_ids": mb.position_ids[:, p:],
        "past_key_values": _gathered_cache(cache, sh.owner),
        "use_cache": True,
    }
    rest, _ = run(continuation, t)  # (N, T, D)
    return torch.cat([head, rest[:, :-1]], dim=1)


def completion_logits(model: torch.nn.Module, mb: SharedPromptBatch) -> Tensor:
    """(N, T, V) logits (the model's dtype, before any temperature) at the positions predicting `mb.completion_ids`:
    the prompt pass's last logits gathered to the rows, then the completion pass's first T - 1. The model's own
    head (and any logit processing of its forward) computes them, on the U last prompt positions and N x T
    completion positions only (`logits_to_keep`)."""

    def run(inputs: dict, keep: int) -> tuple[Tensor, Any]:
        out = model(**inputs, logits_to_keep=keep)
        return out.logits, out.past_key_values

    return _continued(mb, run)


def completion_hidden_states(model: torch.nn.Module, mb: SharedPromptBatch) -> Tensor:
    """(N, T, H) decoder hidden states at the positions predicting `mb.completion_ids` (`model.get_decoder()`), the
    shared-prompt counterpart of `logprobs.completion_hidden_states`, for the fused loss and the chunked LM head."""
    body = model.get_decoder()

    def run(inputs: dict, keep: int) -> tuple[Tensor, Any]:
        out = body(**inputs)
        return out.last_hidden_state[:, -keep:], out.past_key_values

    return _continued(mb, run)


def completion_logps(
    model: torch.nn.Module,
    mb: SharedPromptBatch,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    targets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`packing.completion_logps` with each distinct prompt run once (`targets` (N, T, K), when given, are scored
    instead of `mb.completion_ids`, and the logprobs are (N, T, K)).

    Returns:
        logps (N, T) float32 with gradient (0-masked later by the completion mask, as on the padded path);
        entropies (N, T) without gradient, or None. Logits are divided by `temperature` (TRL). With `chunk_size`
        the decoder body runs and `chunked_token_logps` applies the LM head `chunk_size` positions at a time.
    """
    scored = mb.completion_ids if targets is None else targets  # (N, T) or (N, T, K)
    if chunk_size is not None:
        hidden = completion_hidden_states(model, mb)
        return chunked_token_logps(hidden, model.get_output_embeddings(), scored, chunk_size, with_entropy, temperature)
    logits = completion_logits(model, mb).float() / temperature
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return selective_log_softmax(logits, scored), entropy
