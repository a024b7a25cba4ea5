"""Errors shared by the roles."""

from __future__ import annotations


class RunFailedError(RuntimeError):
    """The run cannot go on because something it depends on failed for good (the inference server could not be
    recovered, the reward service stayed down). Its message names what failed and the fix; the CLI prints it without
    a traceback and exits 1 (the failure is logged with its traceback where it happened)."""
