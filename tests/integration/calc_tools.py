"""Calculators that misbehave, each presented to the model as `calculator` (the name the warm-started model calls)."""

from __future__ import annotations

import time


def hanging(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "1234*5678".
    """
    time.sleep(3600)
    return expression


def raising(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "1234*5678".
    """
    raise ZeroDivisionError("the abacus broke")


hanging.__name__ = raising.__name__ = "calculator"  # the model knows the tool by that name
