"""Builtin tools, named `builtin:<name>` in the config. Each is a typed function with a Google-style docstring, so
`transformers.utils.get_json_schema` describes it like any user tool.

    calculator  exact arithmetic on an expression (no code runs)
    python      model-written Python run in a bubblewrap sandbox (`tools.sandbox`)

This module imports nothing heavy: tool worker processes load it to run builtin tools.
"""

from __future__ import annotations

import ast
import operator
import signal
from collections.abc import Callable
from typing import Any

from async_grpo.tools.failures import MAX_ERROR_CHARS, ToolFailure
from async_grpo.tools.sandbox import SandboxResult, current_settings, run_python

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


NO_OUTPUT = "(no output: print() what you want to see)"
_ERROR_ROOM = MAX_ERROR_CHARS - len("error: ")


def _tail(head: str, output: str, label: str = "") -> str:
    """`head`, then (after `label`, when there is output) as much of the end of `output` as fits the error text (a
    traceback's last lines matter)."""
    output = output.rstrip()
    if not output:
        return head
    head = f"{head} {label}" if label else head
    room = _ERROR_ROOM - len(head) - 1
    return f"{head}\n{output[-room:]}" if room > 0 else head


def python_outcome(result: SandboxResult, cpu_seconds: float, memory_mb: int, timeout_s: float, cap: int) -> str:
    """The text `python` answers with for a finished run, or the `ToolFailure` a failed run raises.

    Args:
        result: the run.
        cpu_seconds, memory_mb, timeout_s, cap: the limits it ran under (seconds, MiB, seconds, bytes), quoted in
            the messages.

    Returns:
        The output (one trailing newline dropped), or NO_OUTPUT when the code printed nothing.

    Raises:
        ToolFailure: `sandbox` (the sandbox did not start), `timeout` (the wall clock), `output_limit` (the output
            cap), `crashed` (killed by a signal: the CPU limit's SIGXCPU/SIGKILL, or a MemoryError at the memory
            limit), `exception` (any other non-zero exit: the traceback's end follows).
    """
    rc, out = result.returncode, result.output
    if result.sandbox_error or (rc is None and not (result.timed_out or result.truncated)):
        raise ToolFailure("sandbox", f"the sandbox did not start: {result.sandbox_error or out}"[:_ERROR_ROOM])
    if result.timed_out:
        raise ToolFailure(
            "timeout", _tail(f"timeout after {timeout_s:g} s; the program was stopped.", out, "Its output:")
        )
    if result.truncated:
        head = f"output limit of {cap} bytes exceeded; the program was stopped. It began:\n"
        raise ToolFailure("output_limit", head + out[: max(_ERROR_ROOM - len(head), 0)])
    if rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        raise ToolFailure(
            "crashed", _tail(f"CPU time limit of {cpu_seconds:g} s exceeded; the program was killed.", out)
        )
    if rc and out.rstrip().endswith("MemoryError"):
        raise ToolFailure("crashed", _tail(f"memory limit of {memory_mb} MiB exceeded (MemoryError).", out))
    if rc and rc > 128:
        name = signal.Signals(rc - 128).name if rc - 128 in signal.valid_signals() else f"signal {rc - 128}"
        raise ToolFailure("crashed", _tail(f"the program was killed by {name} (exit code {rc}).", out))
    if rc:
        raise ToolFailure("exception", _tail(f"the program failed (exit code {rc}):", out))
    out = out[:-1] if out.endswith("\n") else out
    return out if out else NO_OUTPUT


def python(code: str) -> str:
    """Run a Python 3 program in a sandbox and return what it prints (stdout and stderr).

    Each call is a fresh process with no network, no files kept between calls, and limits on time, memory and
    output; use print() to see values.

    Args:
        code: the complete program, e.g. "print(sum(range(10)))".

    Returns:
        The program's output, or an error text (the traceback's end, or the limit it hit).
    """
    settings = current_settings()
    try:
        result = run_python(code, settings)
    except ValueError as err:  # not a string, or too long
        raise ToolFailure("bad_arguments", str(err)) from None
    return python_outcome(result, settings.cpu_seconds, settings.memory_mb, settings.timeout_s, settings.output_bytes)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
