"""Per-token logprobs of sampled tokens, optionally without ever materializing (N, T, V) logits.

The full path runs the LM head on all T positions at once. The chunked path runs the decoder body,
then applies the LM head to `chunk_size` positions at a time inside `torch.utils.checkpoint`, so the
forward keeps only one (N, chunk, V) block alive and the backward recomputes each block. Peak memory
then scales with the chunk, not with T x V (measured in `benchmarks/chunked_logprobs.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from async_grpo.algorithms import entropy_from_logits, selective_log_softmax


def _block(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float = 1.0) -> Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (N, C, V)
    return selective_log_softmax(logits, targets)


def chunked_token_logps(
    hidden: Tensor,
    lm_head: torch.nn.Linear,
    targets: Tensor,
    chunk_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of `targets` under `lm_head(hidden)`, `chunk_size` positions at a time.

    Args:
        hidden: (N, T, H) decoder hidden states; position t predicts targets[:, t].
        lm_head: the output projection (weight (V, H), optional bias (V,)).
        targets: (N, T) token ids, or (N, T, K): K ids per position (the sampled token and a teacher's top-k).
        chunk_size: positions per block (>= 1).
        with_entropy: also return per-token entropies (N, T), computed without gradient.
        temperature: the logits are divided by it first, so the logprobs are those of the sampling
            distribution vLLM reports (`processed_logprobs`) and TRL scores (`logits / temperature`).

    Returns:
        (logps (N, T) (or (N, T, K), the shape of `targets`) float32 with gradient to `hidden` and `lm_head`,
        entropy (N, T) or None).

    Raises:
        ValueError: chunk_size < 1 or mismatched shapes.
    """
    if chunk_size < 1:
        raise ValueError(f"logprob_chunk_size={chunk_size} must be >= 1. Fix: use e.g. 64, or None for full logits.")
    if hidden.shape[:2] != targets.shape[:2]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on (N, T)")
    logps, entropies = [], []
    for start in range(0, hidden.size(1), chunk_size):
        h = hidden[:, start : start + chunk_size]
        t = targets[:, start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or lm_head.weight.requires_grad):
            logps.append(checkpoint(_block, h, lm_head.weight, lm_head.bias, t, temperature, use_reentrant=False))
        else:
            logps.append(_block(h, lm_head.weight, lm_head.bias, t, temperature))
        if with_entropy:
            with torch.no_grad():
                entropies.append(entropy_from_logits(lm_head(h.detach()).float() / temperature))
    return torch.cat(logps, dim=1), (torch.cat(entropies, dim=1) if with_entropy else None)


def completion_logps_from_model(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    completion_ids: Tensor,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    temperature: float = 1.0,
    targets: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token logprobs (N, T) of `completion_ids`, the last T tokens of `input_ids` (N, P + T).

    `targets` (N, T, K), when given, are scored instead of `completion_ids` (K ids per position, e.g. the sampled
    token then a teacher's top-k): the logprobs are then (N, T, K). With `chunk_size=None` the model's own head runs on the last T+1 positions (`logits_to_keep`);
    otherwise the decoder body runs once and `chunked_token_logps` applies the head in blocks. Logits are
    divided by `temperature` (TRL `_get_per_token_logps_and_entropies`).
    """
    t = completion_ids.size(1)
    scored = completion_ids if targets is None else targets  # (N, T) or (N, T, K)
    if chunk_size is None:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=t + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :].float() / temperature  # (N, T, V): position j predicts completion token j
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
        return selective_log_softmax(logits, scored), entropy
    body = model.get_decoder()
    hidden = body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state[:, -(t + 1) : -1, :]  # (N, T, H)
    return chunked_token_logps(hidden, model.get_output_embeddings(), scored, chunk_size, with_entropy, temperature)


def completion_hidden_states(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, num_completion_tokens: int
) -> Tensor:
    """Decoder hidden states (N, T, H) at the positions that predict the last T tokens of `input_ids`.

    The body forward of `completion_logps_from_model`'s chunked path: `model.get_decoder()` on (N, P + T)
    inputs, then `last_hidden_state[:, -(T + 1):-1]`. Feed it to `async_grpo.algorithms.fused_grpo_loss` with
    `model.get_output_embeddings()`.

    Raises:
        ValueError: num_completion_tokens < 1 or not below the sequence length.
    """
    t = num_completion_tokens
    if not 1 <= t < input_ids.size(1):
        raise ValueError(
            f"num_completion_tokens={t} must be in [1, {input_ids.size(1) - 1}] for input_ids "
            f"{tuple(input_ids.shape)} (at least one prompt token precedes the completion)."
        )
    body = model.get_decoder()
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, -(t + 1) : -1, :]
