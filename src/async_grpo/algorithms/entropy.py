"""High-entropy token selection (``top_entropy_quantile``): train only on the "forking" tokens.

Mirrors TRL 1.16 ``GRPOTrainer.get_high_entropy_mask`` (Wang et al. 2025, "Beyond the 80/20 Rule:
High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning", arXiv 2506.01939). The threshold is
one quantile over the valid tokens handed in; the trainer hands in one micro-batch, as TRL does on one
rank (TRL also gathers the other ranks' micro-batches; with one trainer rank the two agree).

Shapes: ``B`` completions, ``T`` completion tokens (right padded). Entropies in nats.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["high_entropy_mask"]


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """Boolean mask of the valid tokens whose entropy is in the top ``top_entropy_quantile`` fraction.

    ``tau = quantile(H[mask], 1 - rho)`` (``torch.quantile``, linear interpolation, computed in float32
    as TRL does); a token is kept iff it is valid and ``H_t * mask_t >= tau``. ``rho = 1`` keeps every
    valid token (tau is the minimum); ``rho = 0`` keeps only the highest-entropy token(s) (tau is the
    maximum; ties are all kept). No valid token gives an all-False mask.

    Formula and tie/padding behaviour: TRL ``GRPOTrainer.get_high_entropy_mask`` called with
    ``threshold = 1 - top_entropy_quantile``; source: arXiv 2506.01939 (paper's rho = 0.2).

    Args:
        entropies: ``(B, T)`` per-token entropies of the policy's next-token distribution (nats, >= 0).
            Read without gradient.
        mask: ``(B, T)`` loss mask (1 trained token, 0 padding / masked), any dtype.
        top_entropy_quantile: rho in ``[0, 1]``, the fraction of valid tokens to keep.

    Returns:
        ``(B, T)`` bool tensor; False at every padding position.

    Raises:
        ValueError: shapes differ or ``top_entropy_quantile`` is outside ``[0, 1]``.
    """
    if entropies.shape != mask.shape or entropies.dim() != 2:
        raise ValueError(f"entropies {tuple(entropies.shape)} and mask {tuple(mask.shape)} must share one (B, T) shape")
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    entropies = entropies.detach()
    valid = mask.bool()  # (B, T)
    local = entropies[valid].float()  # (n_valid,)
    if local.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(local, 1.0 - top_entropy_quantile)  # 0-d float32
    keep = (entropies * mask.float()) >= threshold  # (B, T), TRL's comparison (padding reads as 0)
    return keep & valid
