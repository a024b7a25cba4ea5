"""Errors shared by the roles, and how the command line shows a user error."""

from __future__ import annotations

import sys


class RunFailedError(RuntimeError):
    """The run cannot go on because something it depends on failed for good (the inference server could not be
    recovered, the reward service stayed down). Its message names what failed and the fix; the CLI prints it without
    a traceback and exits 1 (the failure is logged with its traceback where it happened)."""


def print_user_error(err: BaseException) -> int:
    """Print a user error (bad config, dataset, path or service) as `error: ...` lines on stderr, one per problem,
    without a traceback; returns the exit code 2 (every `async-grpo` subcommand uses it)."""
    lines = str(err).splitlines() or [type(err).__name__]
    if len(lines) > 1 and lines[0].rstrip().endswith(":"):  # "invalid config:" then one indented line per field
        print(f"error: {lines[0]}", file=sys.stderr)
        lines = [line.strip() for line in lines[1:]]
    for line in lines:
        print(f"error: {line}" if line.strip() else "", file=sys.stderr)
    return 2
