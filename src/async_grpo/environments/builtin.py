"""Builtin environments (`environment: builtin:<name>`).

guess   find a secret number from 1 to 16, told higher or lower (the rules: `tasks.guess`)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from async_grpo.environments.base import Environment, Observation
from async_grpo.tasks import guess


class GuessEnvironment:
    """The number-guessing game (`builtin:guess`; an `Environment`).

    The secret is the row's `answer` column (the builtin dataset `builtin:guess` has one), else drawn from a
    `random.Random` seeded with `seed` and the prompt's text, so each prompt has one fixed secret. After each turn
    the model reads "higher", "lower" or a reminder of the rules; a right guess ends the episode with reward
    `tasks.guess.guess_reward` (0.9 ** (turns - 1)); running out of turns (max_turns) ends it with no reward.

    Args:
        low, high: the secret's range (inclusive).
        seed: the seed of secrets drawn for rows without `answer`.
    """

    def __init__(self, low: int = guess.LOW, high: int = guess.HIGH, seed: int = 0):
        self.low, self.high, self.seed = low, high, seed

    async def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> Observation:
        """Pick the secret (state["secret"]); the dataset prompt opens the episode, so no messages.

        Raises:
            ValueError: the row's `answer` is not a whole number in the range.
        """
        if "answer" in row and row["answer"] is not None:
            secret = int(str(row["answer"]).strip())
        else:
            secret = random.Random(f"{self.seed}/{row.get('prompt')!r}").randint(self.low, self.high)
        if not self.low <= secret <= self.high:
            raise ValueError(f"guess: the secret {secret} is outside {self.low}..{self.high}")
        state["secret"], state["solved"] = secret, False
        return Observation([])

    async def step(self, action: str, state: dict[str, Any]) -> Observation:
        """Answer one guess: "correct" ends the episode with the reward, else "higher"/"lower"/the rules."""
        reply, solved = guess.guess_reply(state["secret"], action, self.low, self.high)
        if solved:
            state["solved"] = True
            return Observation([], reward=guess.guess_reward(True, int(state.get("turn", 1))), done=True)
        return Observation([{"role": "user", "content": reply}])


BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"guess": GuessEnvironment}
