"""Build the demo's reward model: a tiny sequence-classification model trained on synthetic preference pairs for the
builtin `reverse` task, so a GRPO run can learn from it instead of from the task's verifier.

Pairs are (prompt, chosen, rejected) with the chosen completion the word spelled backwards. The rejected one is,
half the time, the right letters in a wrong order (the word as given, two neighbours swapped, shuffled, rotated:
`order_miss`), else another near miss (a letter dropped or added, another word's reversal) or what a drifting
policy writes (random letters, from the word or not: `near_miss`). Order negatives are the point: reward models
trained mostly on the others learned length and which letters appear, not their order, and the policy drifted to
permutations of the right letters (docs/rewards.md, "Measured: a tiny reward model alone is hacked").
The model (`tiny_model.build_tiny_reward_model`, 4 layers: comparing each letter with its mirror image and pooling
the result into the last token takes several) is trained with the Bradley-Terry loss
(`rewards.pairwise.train_reward_model_on_pairs`) and saved where `examples/reward_model_cpu.yaml` reads it. It prints
its accuracy on held-out pairs, per kind of negative. Nothing is downloaded. About 17 minutes (one thread, 2 cores).

    .venv/bin/python examples/reward_model/build_reverse_reward_model.py runs/reverse-reward-model
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict

import torch

from async_grpo.rewards.pairwise import pair_rewards, train_reward_model_on_pairs
from async_grpo.tasks.reverse import sample_reverse
from async_grpo.tiny_model import build_tiny_reward_model

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ORDER_KINDS = ("copy", "swap", "shuffle", "rotate")


def near_miss(word: str, other: str, rng: random.Random) -> str:
    """A completion that is not `word` reversed but looks like an attempt at it, or what a drifting policy writes."""
    answer = list(word[::-1])
    kind = rng.randrange(8)
    if kind >= 5:  # what a policy drifts to: letters of the word (or any) at random, runs of one letter
        pool = word if kind == 5 else LETTERS
        wrong = "".join(rng.choice(pool) for _ in range(rng.randint(3, 8)))
        return wrong if wrong != word[::-1] else word
    if kind == 0:
        return word
    if kind == 1:
        i = rng.randrange(len(answer) - 1)
        answer[i], answer[i + 1] = answer[i + 1], answer[i]
    elif kind == 2:
        del answer[rng.randrange(len(answer))]
    elif kind == 3:
        answer.insert(rng.randrange(len(answer) + 1), rng.choice(LETTERS))
    else:
        return other[::-1]
    wrong = "".join(answer)
    return wrong if wrong != word[::-1] else word


def order_miss(word: str, rng: random.Random) -> tuple[str, str]:
    """The right letters in a wrong order, and which kind (one of ORDER_KINDS): the word as given, two neighbours
    of its reversal swapped, its reversal shuffled or rotated. A draw that happens to be the reversal is the word."""
    answer = list(word[::-1])
    kind = rng.randrange(len(ORDER_KINDS))
    if kind == 0:
        wrong = word
    elif kind == 1:
        i = rng.randrange(len(answer) - 1)
        answer[i], answer[i + 1] = answer[i + 1], answer[i]
        wrong = "".join(answer)
    elif kind == 2:
        rng.shuffle(answer)
        wrong = "".join(answer)
    else:
        r = rng.randrange(1, len(answer))
        wrong = "".join(answer[r:] + answer[:r])
    return (wrong if wrong != word[::-1] else word), ORDER_KINDS[kind]


def make_pairs(n: int, seed: int, order_fraction: float = 0.7) -> list[tuple[str, str, str, str]]:
    """Up to `n` (prompt, chosen, rejected, kind) tuples for the reverse task: `order_fraction` of the negatives from
    `order_miss`, the rest from `near_miss` (kind "near"). Palindromes (no wrong completion) are skipped."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        word, prompt, answer = sample_reverse(rng)
        other, _, _ = sample_reverse(rng)
        if rng.random() < order_fraction:
            rejected, kind = order_miss(word, rng)
        else:
            rejected, kind = near_miss(word, other, rng), "near"
        if rejected != answer:
            pairs.append((prompt, answer, rejected, kind))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--order-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # faster than the default on a shared 2-core machine
    folder = build_tiny_reward_model(args.out_dir, seed=args.seed, hidden_size=128, num_layers=args.layers,
                                     num_heads=4, intermediate_size=256)  # fmt: skip
    pairs = [p[:3] for p in make_pairs(args.pairs, args.seed, args.order_fraction)]
    losses = train_reward_model_on_pairs(folder, pairs, steps=args.steps, lr=args.lr, batch_size=args.batch_size)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    held_out = make_pairs(3000, args.seed + 1, order_fraction=0.5)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, tokenizer, [p[:3] for p in held_out])
    right = (chosen > rejected).tolist()
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for pair, ok in zip(held_out, right, strict=True):
        by_kind[pair[3]].append(ok)
    kinds = ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in sorted(by_kind.items()))
    print(f"wrote {folder}: final loss {sum(losses[-50:]) / len(losses[-50:]):.3f}, held-out pair accuracy "
          f"{sum(right) / len(right):.3f} ({len(held_out)} pairs; by negative: {kinds})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
