"""Builtin verifiable tasks, looked up by name: `builtin:<task>` datasets and `builtin:<reward>` functions.

The registry is a fixed table built at import (no setters, no plugins), and importing it pulls in
neither torch nor datasets, so reward worker processes resolve builtin rewards cheaply.
"""

from __future__ import annotations

from async_grpo.tasks import add, calc, guess, math_reasoning, reverse
from async_grpo.tasks.base import RewardFunc, Task

TASKS: dict[str, Task] = {t.name: t for t in (reverse.TASK, add.TASK, calc.TASK, guess.TASK)}


def get_task(name: str) -> Task:
    """The builtin task called `name` (e.g. "reverse").

    Raises:
        KeyError: unknown name; the message lists the builtin tasks.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown builtin task {name!r}. Fix: use one of {sorted(TASKS)}.") from None


def builtin_reward_funcs() -> dict[str, RewardFunc]:
    """Every builtin reward function by name: the builtin tasks' (e.g. "reverse_exact_match") and the real-task
    ones of `math_reasoning` ("math_accuracy", "think_answer_format", "soft_overlong_penalty")."""
    funcs = {name: fn for task in TASKS.values() for name, fn in task.reward_funcs.items()}
    return {**funcs, **math_reasoning.REWARD_FUNCS}


def get_reward_func(name: str) -> RewardFunc:
    """The builtin reward function called `name` (without the `builtin:` prefix).

    Raises:
        KeyError: unknown name; the message lists the builtin reward functions.
    """
    funcs = builtin_reward_funcs()
    try:
        return funcs[name]
    except KeyError:
        raise KeyError(f"unknown builtin reward function {name!r}. Fix: use one of {sorted(funcs)}.") from None


__all__ = ["TASKS", "Task", "builtin_reward_funcs", "get_reward_func", "get_task"]
