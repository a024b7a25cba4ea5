"""Repo-wide test fixtures (seen by tests/ and components/*/tests alike)."""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil
import pytest


def live_child_pids() -> set[int]:
    """PIDs of live (non-zombie) descendants of this test process, ignoring multiprocessing's shared
    resource tracker (one per interpreter, it outlives every pool by design)."""
    pids = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any("resource_tracker" in a for a in p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


@pytest.fixture
def child_pids() -> Callable[[], set[int]]:
    """Call it before and after the code under test; the difference is what that code left running."""
    return live_child_pids
