"""Start a test's trainer ranks from a fork server that has already imported torch, transformers and the trainer.

A rank started with `spawn` is a fresh interpreter: it imports torch, transformers (which pulls in scikit-learn) and
`async_grpo.trainer` (which pulls in vLLM's weight-transfer types) before it runs a line of the test, about 8 s on
one core. A two-rank test on a pytest-xdist worker's one core so paid about 16 s before its first step, and the
suite's nine rank launches about 140 s (2026-11-29, 2 cores). Python's `forkserver` start method imports the
`PRELOAD` modules once, in a server process per pytest worker, and forks every later rank from it: a fresh process
(no state of the test process, as with `spawn`) that starts in well under a second.

The fork server is started by the first launch and lives until the pytest worker exits (it ends when its parent's
end of a pipe closes). It keeps the environment and CPU affinity the worker had then: a rank that needs variables
sets them itself (as the `_rank_main` functions here set WORLD_SIZE, RANK and MASTER_PORT).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

START_METHOD = "forkserver"
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "async_grpo.trainer.distributed",
    "async_grpo.trainer.trainer",
]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2, join: bool = True) -> Any:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join)` with ranks forked from the preloaded fork
    server; `fn(rank, *args)` must be importable (a module-level function), as with `spawn`.

    Returns:
        None when `join`, else the `ProcessContext` (join it, or terminate its processes, yourself).

    Raises:
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a rank failed (when `join`).
    """
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=START_METHOD)
