"""Repo-wide test fixtures (seen by tests/ and components/*/tests alike)."""

from __future__ import annotations

import os
import sys
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


@pytest.fixture(autouse=True)
def _mlflow_environment_is_per_test():
    """Each test starts and ends with the session's MLFLOW_* variables and tracking URI: MLflow exports
    MLFLOW_TRACKING_URI when a tracking URI is set, and a leaked one would send a later run (and its subprocesses)
    into another test's store. Here for components/*/tests too: with two test workers (`make test`) any module may
    run before any other."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    if "mlflow" in sys.modules:  # the fluent API's URI, which set_tracking_uri keeps beside the variable
        sys.modules["mlflow"].set_tracking_uri(saved.get("MLFLOW_TRACKING_URI"))
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        if key not in saved:
            del os.environ[key]
    os.environ.update(saved)


@pytest.fixture
def child_pids() -> Callable[[], set[int]]:
    """Call it before and after the code under test; the difference is what that code left running."""
    return live_child_pids
