"""The kinds of failed tool calls, and the exception a tool raises to fail with one of them.

Kept apart from `tools.executor` so that builtin tools (`tools.builtin`) can raise `ToolFailure` without importing
the executor (which resolves tools through `tools.loading`, which imports the builtins).
"""

from __future__ import annotations

MAX_ERROR_CHARS = 300  # a failed call's text, `error: ...` included, is cut to this many characters
FAILURE_KINDS = (
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "exception",
    "timeout",
    "crashed",
    "output_limit",
    "sandbox",
)


class ToolFailure(Exception):
    """Raised by a tool to fail with a given kind and exactly this message (the model reads `error: <message>`),
    instead of the generic `exception` outcome `<tool> raised <ExceptionType>: ...` (e.g. `builtin:python`'s
    `timeout`, `output_limit`, `sandbox`).

    Args:
        kind: one of FAILURE_KINDS.
        message: what the model reads after `error: ` (cut to MAX_ERROR_CHARS with it).

    Raises:
        ValueError: `kind` is not one of FAILURE_KINDS.
    """

    def __init__(self, kind: str, message: str):
        if kind not in FAILURE_KINDS:
            raise ValueError(f"ToolFailure kind {kind!r} is not one of {FAILURE_KINDS}")
        super().__init__(message)
        self.kind, self.message = kind, message
