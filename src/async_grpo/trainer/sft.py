"""A short supervised warm start on (prompt, completion) pairs, for the tiny demo model.

A randomly initialised model never earns a reward, so GRPO has nothing to work with; a few hundred
supervised steps on the builtin task's reference answers bring first-step rewards off zero. The
loss is next-token cross-entropy on completion tokens only (prompt tokens masked, as TRL's SFT
`completion_only_loss`).
"""

from __future__ import annotations

import logging
import random

import torch

logger = logging.getLogger(__name__)


def supervised_warm_start(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int = 32,
    pad_token_id: int = 0,
    seed: int = 0,
) -> float:
    """Train `model` in place for `steps` AdamW steps on tokenized (prompt_ids, completion_ids) pairs.

    Args:
        examples: pairs of token-id lists; completion_ids should end with EOS.
        steps: optimizer steps.
        learning_rate: AdamW learning rate.
        batch_size: pairs per step.

    Returns:
        The mean loss (nats/token) of the last 10 steps.

    Raises:
        ValueError: no examples.
    """
    if not examples:
        raise ValueError("supervised_warm_start: no examples. Fix: set warmup_sft_steps=0 or use a builtin task.")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, c) in enumerate(batch):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(c)
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    tail = losses[-10:]
    logger.info("warm start: %d steps, final loss %.3f", steps, sum(tail) / len(tail))
    return sum(tail) / len(tail)
