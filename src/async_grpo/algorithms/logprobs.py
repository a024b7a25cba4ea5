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
        index: ``(B, T)`` int64 token ids in ``[0, V)``, one per position; or ``(B, T, K)``, K ids per position
            (on-policy distillation's top-k: the sampled token and the teacher's K most likely, in one pass).

    Returns:
        ``(B, T)`` (or ``(B, T, K)``) log-probabilities (nats), same dtype as ``logits``; differentiable.

    Raises:
        ValueError: ``index.shape`` is neither ``logits.shape[:-1]`` nor ``logits.shape[:-1] + (K,)``.
    """
    lead = tuple(logits.shape[:-1])
    per_position = tuple(index.shape) == lead
    if not per_position and not (index.dim() == logits.dim() and tuple(index.shape[:-1]) == lead):
        raise ValueError(
            f"index shape {tuple(index.shape)} must equal logits.shape[:-1] {lead} or add one trailing K dimension"
        )
    gather_index = index.unsqueeze(-1) if per_position else index  # (B, T, K), K = 1 for one id per position
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=gather_index)  # (B, T, K)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # (B, T), one row at a time
        out = selected - lse.unsqueeze(-1)
    else:
        rows = []
        for row_logits, row_index in zip(logits, gather_index, strict=True):  # row_logits (T, V), row_index (T, K)
            rows.append(F.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_index))  # (T, K)
        out = torch.stack(rows)
    return out.squeeze(-1) if per_position else out


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
