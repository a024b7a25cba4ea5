"""Shared test setup: GPU tests skip cleanly without CUDA; one tiny model folder per session (built locally, no
hub access) for the unit tests that train it; and, under pytest-xdist, each worker's share of the cores and the order
in which test modules are handed to the workers.

Cores: each worker computes on its own share of the machine's cores (two workers on two cores: one core each), set as
the worker's CPU affinity, which every process a test starts (vLLM, trainer, reward workers) inherits and which the
product reads to size its thread pools (`runner.resource_sharing`, vLLM's OpenMP threads). Without it, two workers' runs
each sized their pools for the whole machine: a torch pool of 2 threads beside another busy process took 0.47 s per
warm-start step against 0.27 s on 1 thread (OpenMP threads spin waiting for a descheduled peer), and the suite took
28.4 minutes against 24.0 pinned (2026-11-29, 2 cores). A benchmark that binds processes to cores of its own
(`benchmarks/overlap.py`) time-slices the worker's one core in its reduced form.

Order: `pytest_collection_modifyitems` puts the modules with the longest tests first (`slow(seconds=...)`, measured
on 2 cores), so that the last module a worker starts is a short one and both workers finish together (with
`--no-loadscope-reorder`, which keeps this order; xdist's default hands out the modules with the most tests first).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from async_grpo.tiny_model import build_tiny_model

DEFAULT_SLOW_SECONDS = 60.0  # a `slow` test without its measured seconds
INTEGRATION_SECONDS = 10.0  # an integration test's usual cost (a short real run against a shared server)


def worker_cores() -> set[int] | None:
    """This pytest-xdist worker's share of the cores (`PYTEST_XDIST_WORKER` gwN of `PYTEST_XDIST_WORKER_COUNT`):
    contiguous, equal shares of the cores the run was given (read before `pytest_configure` pins the worker); None
    outside xdist, with one worker, or with fewer cores than workers (the workers then share every core)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cores) < count:
        return None
    share = len(cores) // count
    index = int(worker.removeprefix("gw"))
    return set(cores[index * share : (index + 1) * share])


def pytest_configure(config):
    share = worker_cores()
    if share is None:
        return
    import torch

    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def expected_seconds(item: pytest.Item) -> float:
    """A test's expected cost, for ordering: its `slow(seconds=...)`, else DEFAULT_SLOW_SECONDS for `slow`,
    INTEGRATION_SECONDS for `integration`, else 0."""
    slow = item.get_closest_marker("slow")
    if slow is not None:
        return float(slow.kwargs.get("seconds", DEFAULT_SLOW_SECONDS))
    return INTEGRATION_SECONDS if item.get_closest_marker("integration") is not None else 0.0


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A freshly built tiny byte-level Qwen2 model (seed 0)."""
    return build_tiny_model(tmp_path_factory.mktemp("trainer-tiny") / "model", seed=0)


@pytest.fixture
def tiny_model(tiny_model_path):
    """A fresh float32 copy of the tiny model for one test (tests may train it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def pytest_collection_modifyitems(config, items):
    # modules by their summed expected cost, longest first; the tests of a module keep their order
    cost: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        cost[module] = cost.get(module, 0.0) + expected_seconds(item)
    items.sort(key=lambda item: -cost[item.nodeid.split("::", 1)[0]])
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: GPU tests cannot run either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
