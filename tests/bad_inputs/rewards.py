"""Reward functions (and one data-producer name) for the bad-input corpus: each breaks TRL's contract one way."""

from __future__ import annotations

import time


def good(prompts, completions, completion_ids, **kwargs):
    """A valid reward: 1.0 per completion."""
    return [1.0 for _ in completions]


def one_arg(x):
    """Wrong signature: TRL calls f(prompts=..., completions=..., completion_ids=..., **columns)."""
    return [0.0]


def positional_only(prompts, completions, /):
    """Wrong signature: TRL passes keywords."""
    return [0.0 for _ in completions]


def needs_answer(prompts, completions, completion_ids, answer, **kwargs):
    """Needs a dataset column `answer` that the dataset does not have."""
    return [float(c == a) for c, a in zip(completions, answer)]


def raises(prompts, completions, completion_ids, **kwargs):
    """Fails on the empty completion TRL can produce."""
    return [1.0 / len(c) for c in completions]


def wrong_length(prompts, completions, completion_ids, **kwargs):
    """One value for the whole group instead of one per completion."""
    return [1.0]


def returns_dict(prompts, completions, completion_ids, **kwargs):
    """Not a list of numbers."""
    return {"reward": 1.0}


def returns_strings(prompts, completions, completion_ids, **kwargs):
    """Strings instead of numbers."""
    return ["1.0" for _ in completions]


def returns_inf(prompts, completions, completion_ids, **kwargs):
    """A non-finite reward."""
    return [float("inf") for _ in completions]


def hangs(prompts, completions, completion_ids, **kwargs):
    """Never returns in time."""
    time.sleep(3600)
    return [0.0 for _ in completions]


NOT_CALLABLE = 3
