"""Memory-lean per-token log-probability and entropy helpers (TRL ``trl.trainer.utils`` equivalents).

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary. Values in nats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["entropy_from_logits", "selective_log_softmax"]

# --------------------------------------------------------------------------------------------------
# Log-prob helpers
# --------------------------------------------------------------------------------------------------


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full log-softmax.

    Same algorithm as ``trl.trainer.utils.selective_log_softmax`` (CPU / non-Triton path): for fp32 /
    fp64 ``logit[index] - logsumexp(logits)`` with the logsumexp looped per row; for bf16 / fp16 a
    per-row ``log_softmax`` then gather (logsumexp is unstable in half precision).

    Args:
        logits: ``(B, T, V)`` unnormalised scores (any leading dims work).
        index: ``(B, T)`` int64 token ids in ``[0, V)``.

    Returns:
        ``(B, T)`` log-probabilities (nats), same dtype as ``logits``; differentiable.

    Raises:
        ValueError: ``index.shape != logits.shape[:-1]``.
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index shape {tuple(index.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}")
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)  # (B, T)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # (B, T), one row at a time
        return selected - lse
    out = []
    for row_logits, row_index in zip(logits, index, strict=True):  # row_logits (T, V)
        row_logps = F.log_softmax(row_logits, dim=-1)
        out.append(row_logps.gather(dim=-1, index=row_index.unsqueeze(-1)).squeeze(-1))  # (T,)
    return torch.stack(out)


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` along the last axis, chunked to save memory.

    Same algorithm as ``trl.trainer.utils.entropy_from_logits``: rows are flattened to ``(N, V)`` and
    processed ``chunk_size`` rows at a time, ``H = -sum(p * log p)``.

    Args:
        logits: ``(B, T, V)`` (any leading dims).
        chunk_size: rows per chunk (positive).

    Returns:
        ``(B, T)`` entropies, same dtype as ``logits``; differentiable.

    Raises:
        ValueError: ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    chunks = []
    for chunk in flat.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        chunks.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(chunks, dim=0).reshape(lead_shape)
