"""Resident memory of a run's processes, by role, for the per-step metrics and the memory benchmark.

A local run is one trainer process (the step loop and the orchestrator thread) and the processes it started: the
vLLM servers it launched (the API server and its engine core) and workers (the reward pool's spawned processes,
tool sandboxes). Memory that grows step after step in any of them ends a long run; logging each role's resident set
size (RSS) every logged step makes the slope visible in MLflow, and `benchmarks/memory.py` measures it.
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil

MB = 1024 * 1024
VLLM_MARKERS = ("vllm.entrypoints", "VLLM::")  # the API server's module, the engine core's process title


def role_of(cmdline: Sequence[str], name: str) -> str:
    """`vllm` for a vLLM server process (API server or engine core), else `workers`."""
    text = " ".join(cmdline) + " " + name
    return "vllm" if any(marker in text for marker in VLLM_MARKERS) else "workers"


def memory_metrics(process: psutil.Process | None = None) -> dict[str, float]:
    """Resident memory (MB, 2**20 bytes) of `process` (default: this one) and its descendants.

    Returns:
        `memory/rss_mb/trainer` (the process itself), `memory/rss_mb/vllm` (summed over the vLLM processes it
        started; 0 when it attached to servers elsewhere) and `memory/rss_mb/workers` (every other descendant,
        summed: reward workers, tool sandboxes). A descendant that exits while it is read is left out.
    """
    process = process or psutil.Process()
    out = {"memory/rss_mb/trainer": process.memory_info().rss / MB, "memory/rss_mb/vllm": 0.0}
    out["memory/rss_mb/workers"] = 0.0
    for child in process.children(recursive=True):
        try:
            rss = child.memory_info().rss
            role = role_of(child.cmdline(), child.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[f"memory/rss_mb/{role}"] += rss / MB
    return out


def slope_per_1000_steps(steps: Sequence[float], values: Sequence[float], warmup_fraction: float = 0.2) -> float:
    """Least-squares slope of `values` against `steps`, in units per 1,000 steps, over the samples after the first
    `warmup_fraction` of the steps (allocator pools, caches and compiled kernels fill up first).

    Raises:
        ValueError: lengths differ, or fewer than 3 samples after the warm-up.
    """
    if len(steps) != len(values):
        raise ValueError(f"slope_per_1000_steps: {len(steps)} steps but {len(values)} values")
    if not steps:
        raise ValueError("slope_per_1000_steps: no samples")
    start = min(steps) + warmup_fraction * (max(steps) - min(steps))
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if s >= start]
    if len(kept) < 3:
        raise ValueError(f"slope_per_1000_steps: {len(kept)} samples after the warm-up; need at least 3")
    mean_s = sum(s for s, _ in kept) / len(kept)
    mean_v = sum(v for _, v in kept) / len(kept)
    var = sum((s - mean_s) ** 2 for s, _ in kept)
    if var == 0:
        raise ValueError("slope_per_1000_steps: every sample after the warm-up is at one step")
    return 1000.0 * sum((s - mean_s) * (v - mean_v) for s, v in kept) / var
