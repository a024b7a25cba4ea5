"""A user-defined tool file for examples/tools_gpu.yaml: plain typed functions with Google-style docstrings.

Each function becomes a tool the model may call (its JSON schema comes from transformers.utils.get_json_schema).
They run in sandboxed worker processes (tool_timeout_s, tool_cpu_seconds, tool_memory_mb), so a slow or crashing
call costs only itself; whatever they raise is shown to the model as `error: ...`.
"""

from __future__ import annotations

from fractions import Fraction


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def add(numbers: list[int]) -> int:
    """Add a list of integers exactly.

    Args:
        numbers: the integers to add, e.g. [12, 30, -5].
    """
    return sum(numbers)


def divide(numerator: int, denominator: int) -> str:
    """Divide two integers exactly, as a reduced fraction (or an integer when it divides evenly).

    Args:
        numerator: the number divided.
        denominator: the number divided by (not zero).
    """
    value = Fraction(numerator, denominator)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
