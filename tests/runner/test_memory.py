"""Per-role resident memory (issue 28, flat memory): the roles are read off real child processes, and the slope is
the least-squares one, after the warm-up, in MB per 1,000 steps."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from async_grpo.runner.memory import memory_metrics, role_of, slope_per_1000_steps

PARENT = """
import subprocess, sys, time
hog = "import time; x = bytearray(200 * 1024 * 1024); time.sleep(60)"  # 200 MB resident
child = subprocess.Popen([sys.executable, "-c", hog])
print(child.pid, flush=True)
try:
    time.sleep(60)
finally:
    child.kill()
"""


def test_children_are_counted_under_their_role():
    """A stand-in trainer (a fresh process, so none of this test runner's own children count) with one 200 MB
    child: the child is a worker, nothing is vLLM."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 20
        while child.memory_info().rss < 200 * 1024 * 1024 and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = memory_metrics(psutil.Process(parent.pid))
    finally:
        parent.kill()
        parent.wait(timeout=10)
        child.kill()
    assert 200.0 <= metrics["memory/rss_mb/workers"] < 400.0
    assert 1.0 < metrics["memory/rss_mb/trainer"] < 200.0 and metrics["memory/rss_mb/vllm"] == 0.0
    assert role_of(["python", "-m", "vllm.entrypoints.openai.api_server"], "python") == "vllm"
    assert role_of([], "VLLM::EngineCore") == "vllm"
    assert role_of(["python", "-c", "from multiprocessing.spawn import spawn_main"], "python") == "workers"


def test_the_slope_is_least_squares_after_the_warm_up():
    steps = list(range(0, 1001, 10))
    values = [500.0 + (300.0 if s < 200 else 0.0) + 0.004 * s for s in steps]  # a warm-up bump, then 4 MB / 1000
    assert slope_per_1000_steps(steps, values, warmup_fraction=0.2) == pytest.approx(4.0, abs=1e-9)
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if s >= 200]
    expected = 1000 * np.polyfit([s for s, _ in kept], [v for _, v in kept], 1)[0]
    assert slope_per_1000_steps(steps, values) == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match="need at least 3"):
        slope_per_1000_steps([0, 1, 2], [1.0, 2.0, 3.0], warmup_fraction=0.9)
    with pytest.raises(ValueError, match="2 steps but 1 values"):
        slope_per_1000_steps([0, 1], [1.0])
