"""The builtin `guess` task: find a secret whole number by guessing, told "higher" or "lower" after each guess.

A multi-turn task for an environment (`environment: builtin:guess`, `environments.builtin.GuessEnvironment`):
the dataset row holds the secret (`answer`), the prompt states the range, and the model needs several turns unless
it guesses right at once; binary search over LOW..HIGH needs at most ceil(log2(16)) + 1 = 5. The game's rules
live here (the environment only wraps them) so that the warm start's reference conversations (`guess_transcript`)
answer exactly as the environment does.

The warm start demonstrates a noisy binary search (`EXPLORE`), not the optimal one: it teaches the rules (guess
inside the range the replies leave) and a lean toward the middle, and leaves GRPO a better strategy to find. A warm
start on the exact binary search left GRPO nothing: at 1e-3 it reached 0.76 of the 0.783 ceiling alone, at 3e-3
it converged on some seeds only, and in both the episodes of a group walked the same guesses (entropy 0.03-0.15
nats per token), so few groups carried an advantage (issue 48, docs/reproducibility.md).
"""

from __future__ import annotations

import random
import re
from typing import Any

from async_grpo.tasks.base import Task

LOW, HIGH = 1, 16
SOLVED_REPLY = "correct"
DISCOUNT = 0.9  # the reward of a win after k turns is DISCOUNT ** (k - 1): fewer turns, more reward
# Share of the warm start's guesses drawn uniformly from the range still open instead of its middle. Played to the
# end, the noisy search earns 0.715 in expectation (7% of its games need more than 5 turns), the binary search 0.783.
EXPLORE = 0.5
_NUMBER = re.compile(r"-?\d+")


def guess_prompt(low: int = LOW, high: int = HIGH) -> str:
    """The opening user message: the range and the rules."""
    return f"guess a number from {low} to {high}. reply with one number; i say higher or lower.\n"


def parse_guess(text: str) -> int | None:
    """The first whole number in `text` (a guess), or None when it holds none."""
    match = _NUMBER.search(text)
    return int(match.group()) if match else None


def guess_reply(secret: int, text: str, low: int = LOW, high: int = HIGH) -> tuple[str, bool]:
    """The game's answer to one turn: ("correct", True) for the secret, ("higher" | "lower", False) for another
    number, and a reminder of the rules (False) for a turn without a number."""
    guess = parse_guess(text)
    if guess is None:
        return f"reply with one number from {low} to {high}", False
    if guess == secret:
        return SOLVED_REPLY, True
    return ("higher" if guess < secret else "lower"), False


def guess_reward(solved: bool, turns: int) -> float:
    """DISCOUNT ** (turns - 1) for a win after `turns` model turns, 0.0 when not solved (a discounted return with
    one unit of reward at the end, the usual RL discount)."""
    return DISCOUNT ** (turns - 1) if solved else 0.0


def sample_guess(rng: random.Random) -> tuple[str, str, str]:
    """Draw (key, prompt, answer): a secret in LOW..HIGH; the key carries a random tag, since 16 secrets are too
    few to keep every row distinct (the secret is hidden, so repeated secrets leak nothing)."""
    secret = rng.randint(LOW, HIGH)
    return f"{secret}/{rng.getrandbits(48):x}", guess_prompt(), str(secret)


def guess_transcript(prompt: str, answer: str, rng: random.Random | None = None) -> list[dict]:
    """The reference conversation for a warm start: a noisy binary search to the secret, each reply the
    environment's own (`guess_reply`). Each guess is the middle of the range the replies leave open, or, with
    probability `EXPLORE`, a number drawn uniformly from that range with `rng`; rng None: always the middle (the
    exact binary search, at most 5 guesses; the most likely conversation, for the warm start's greedy check)."""
    secret, low, high = int(answer), LOW, HIGH
    conv: list[dict] = [{"role": "user", "content": prompt}]
    while True:
        if rng is not None and rng.random() < EXPLORE:
            guess = rng.randint(low, high)
        else:
            guess = (low + high) // 2
        reply, solved = guess_reply(secret, str(guess))
        conv.append({"role": "assistant", "content": str(guess)})
        if solved:
            return conv
        conv.append({"role": "user", "content": reply})
        low, high = (guess + 1, high) if reply == "higher" else (low, guess - 1)


def env_reward(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """The environment's reward for each completion (TRL reward signature): the `env_reward` keyword argument the
    environment rollout passes (the sum of the rewards its environment gave in `Observation.reward`), 0.0 where it
    gave none (an episode that ended by failure included).

    Raises:
        ValueError: no `env_reward` argument (the run has no `environment`), or the wrong length.
    """
    if "env_reward" not in kwargs:
        raise ValueError(
            "env_reward: needs the `env_reward` argument, which only an environment rollout passes. "
            "Fix: set `environment` (e.g. builtin:guess), or drop builtin:env_reward from reward_funcs."
        )
    rewards = list(kwargs["env_reward"])
    if len(rewards) != len(completions):
        raise ValueError(f"env_reward: got {len(completions)} completions but {len(rewards)} env_reward values.")
    return [0.0 if r is None else float(r) for r in rewards]


TASK = Task(
    name="guess",
    description="Guess a secret number from 1 to 16 over several turns, told higher or lower (environment: "
    "builtin:guess).",
    sample=sample_guess,
    reward_funcs={"env_reward": env_reward},
    train_size=2000,
    eval_size=64,
    chat=True,
    environment="builtin:guess",
    transcript=guess_transcript,
)
