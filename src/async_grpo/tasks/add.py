"""The builtin `add` task: add two two-digit numbers.

A second verifiable task with a different answer alphabet (digits) and a carry, so pipelines are not
tested against string reversal alone; there are only 8,100 operand pairs, so splits are kept smaller.
"""

from __future__ import annotations

import random
import string
from typing import Any

from async_grpo.tasks.base import Task, answers_from_kwargs, completion_text, shaped_match


def add_prompt(a: int, b: int) -> str:
    """The prompt for a + b: ``"add: <a>+<b>\\n"`` (a standard, non-chat prompt)."""
    return f"add: {a}+{b}\n"


def sample_add(rng: random.Random) -> tuple[str, str, str]:
    """Draw (key, prompt, answer) for two operands in 10..99; the key is ``"a+b"``."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}", add_prompt(a, b), str(a + b)


def add_exact_match(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """1.0 where ``completion.strip() == answer`` else 0.0 (TRL reward signature; needs column `answer`).

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("add_exact_match", kwargs, len(completions))
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answers, strict=True)]


def add_format(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """Shaped partial credit in [0, 1] (TRL signature): 0.2 x fraction of digits + 0.3 x length
    closeness + 0.5 x fraction of correct digit positions (see `tasks.base.shaped_match`).

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("add_format", kwargs, len(completions))
    return [
        shaped_match(completion_text(c).strip(), a, string.digits) for c, a in zip(completions, answers, strict=True)
    ]


TASK = Task(
    name="add",
    description="Add two two-digit numbers: 'add: 12+34\\n' -> '46'.",
    sample=sample_add,
    reward_funcs={"add_exact_match": add_exact_match, "add_format": add_format},
    train_size=3000,
    eval_size=200,
)
