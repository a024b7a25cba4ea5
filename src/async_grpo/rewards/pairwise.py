"""Train a reward model on preference pairs with the Bradley-Terry loss, in plain torch on CPU.

The loss is InstructGPT's (Ouyang et al. 2022, eq. 1) and TRL's `RewardTrainer.compute_loss` without a margin:
loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), averaged over pairs, where r is the model's single logit on
the text `rewards.reward_model.render_texts` builds, so training and scoring see the same inputs. Meant for tiny
models in tests and examples (a few hundred pairs, seconds on a CPU), not a replacement for TRL's RewardTrainer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from async_grpo.rewards.reward_model import max_length, render_texts

Pair = tuple[Any, Any, Any]  # (prompt, chosen completion, rejected completion), TRL's preference columns


def pair_rewards(model: Any, tokenizer: Any, pairs: Sequence[Pair]) -> tuple[Any, Any]:
    """(r_chosen, r_rejected), each a float tensor of shape (P,), with gradients."""
    prompts = [p for p, _, _ in pairs]
    texts = render_texts(tokenizer, prompts * 2, [c for _, c, _ in pairs] + [r for _, _, r in pairs])
    batch = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        padding_side="right",
        add_special_tokens=False,
        truncation=True,
        max_length=max_length(tokenizer, model.config),
    )
    logits = model(**batch).logits[:, 0]  # (2P,)
    return logits[: len(pairs)], logits[len(pairs) :]


def train_reward_model_on_pairs(
    model_dir: str | os.PathLike,
    pairs: Sequence[Pair],
    steps: int = 50,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> list[float]:
    """Train the sequence-classification model in `model_dir` (num_labels=1) to score chosen above rejected, and
    save it back there (model weights only; the tokenizer is unchanged).

    Args:
        model_dir: a folder save_pretrained wrote, e.g. `tiny_model.build_tiny_reward_model`.
        pairs: (prompt, chosen, rejected) triples; strings, or message lists for conversational prompts.
        steps: optimizer steps (AdamW), each on `batch_size` pairs drawn without replacement per epoch.
        lr: learning rate.
        seed: seeds the pair order and torch.

    Returns:
        The loss of each step.

    Raises:
        ValueError: no pairs, or steps < 1.
    """
    if not pairs or steps < 1:
        raise ValueError(f"train_reward_model_on_pairs: {len(pairs)} pairs, {steps} steps. Fix: give both >= 1.")
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    losses: list[float] = []
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        order: list[int] = []
        for _ in range(steps):
            if len(order) < min(batch_size, len(pairs)):
                order += rng.sample(range(len(pairs)), len(pairs))
            batch, order = [pairs[i] for i in order[:batch_size]], order[batch_size:]
            chosen, rejected = pair_rewards(model, tokenizer, batch)
            loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    model.eval()
    model.save_pretrained(folder)
    return losses
