"""Builtin tools, named `builtin:<name>` in the config. Each is a typed function with a Google-style docstring, so
`transformers.utils.get_json_schema` describes it like any user tool.

This module imports nothing heavy: tool worker processes load it to run builtin tools.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # `**` with a larger exponent is refused (a 10**10**9 would hang the worker)
MAX_DIGITS = 200  # results with more digits are refused

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported syntax {ast.unparse(node)!r}: only numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "1234*5678".

    Returns:
        The value as text: an integer without a decimal point, otherwise up to 12 significant digits.

    Raises:
        ValueError: the expression is empty, too long, not arithmetic, or divides by zero.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string such as '12*34'")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.12g}"
    return str(value)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
