"""The builtin `reverse` task: spell a short random lowercase word backwards.

It is verifiable by string equality and learnable by a 0.5M-parameter byte-level model in minutes on
CPU: the prompt ends right after the word, so the k-th answer character always sits 2k+2 positions
after its source character, whatever the word length.
"""

from __future__ import annotations

import random
import string
from typing import Any

from async_grpo.tasks.base import Task, answers_from_kwargs, completion_text, shaped_match

MIN_LEN = 3
MAX_LEN = 6
ALPHABET = string.ascii_lowercase


def reverse_prompt(word: str) -> str:
    """The prompt for `word`: ``"reverse: <word>\\n"`` (a standard, non-chat prompt)."""
    return f"reverse: {word}\n"


def sample_reverse(rng: random.Random) -> tuple[str, str, str]:
    """Draw (word, prompt, answer): a 3-6 letter random lowercase non-palindrome and its reverse."""
    while True:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        if word != word[::-1]:
            return word, reverse_prompt(word), word[::-1]


def reverse_exact_match(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """1.0 where ``completion.strip() == answer`` else 0.0 (TRL reward signature; needs column `answer`).

    Returns:
        One float per completion (length G).

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("reverse_exact_match", kwargs, len(completions))
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answers, strict=True)]


def reverse_format(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """Shaped partial credit in [0, 1] for the stripped completion against `answer` (TRL signature).

    0.2 x fraction of lowercase letters + 0.3 x length closeness + 0.5 x fraction of correct
    positions (see `tasks.base.shaped_match`); exactly 1.0 only for the right answer, 0.0 for an
    empty completion.

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("reverse_format", kwargs, len(completions))
    return [shaped_match(completion_text(c).strip(), a, ALPHABET) for c, a in zip(completions, answers, strict=True)]


TASK = Task(
    name="reverse",
    description="Reverse a random 3-6 letter lowercase word: 'reverse: abcd\\n' -> 'dcba'.",
    sample=sample_reverse,
    reward_funcs={"reverse_exact_match": reverse_exact_match, "reverse_format": reverse_format},
)
