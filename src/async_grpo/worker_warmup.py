"""Start a pebble pool's spawned workers, and have each import its user code, before the first request comes.

A spawned worker starts a Python, imports this package and then, on its first task, the user's reward functions or
tools. That costs seconds on an idle machine and much longer on a loaded one (a 2-core CI runner with other tests
beside it: over 12 s, measured as 504s and 503s on the reward service's very first requests). The reward service
counts the wait for a free worker inside each request's time limit, so a cold pool fails the first requests that a
warm one scores at once. `warm_workers` pays that start-up once, before the service reports itself ready
(`rewards.server`: /health answers 503 "starting" until then, which is what its readiness probe reads).

pebble hands a task to whichever worker is free, so one warm-up task per worker does not reach every worker: a
worker that finished importing takes the tasks of those still starting. The warm-up therefore repeats rounds of
one task per worker, each answering with its process id, until it has heard from `num_workers` distinct workers,
the deadline passes or the caller stops it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import Any

from pebble import ProcessPool

logger = logging.getLogger(__name__)

ROUND_PAUSE_S = 0.1  # between rounds, while some workers are still starting (seconds)


def import_in_worker(resolve: Callable[[str], Any], specs: Sequence[str]) -> int:
    """The warm-up task, run in a worker: call `resolve` (the pool's cached, module-level resolver) on every spec, so the
    worker imports the user code now; returns the worker's process id."""
    for spec in specs:
        resolve(spec)
    return os.getpid()


def warm_workers(
    pool: ProcessPool,
    resolve: Callable[[str], Any],
    specs: Sequence[str],
    num_workers: int,
    timeout_s: float,
    stopped: Callable[[], bool],
) -> int:
    """Have `num_workers` distinct workers of `pool` run `import_in_worker(resolve, specs)`; returns how many did.

    Args:
        pool: the pebble pool to warm (its workers start on the first task).
        resolve: the pool's worker-side resolver of a spec (module-level and cached, so pickled by reference and
            imported once per worker).
        specs: the spec strings the workers resolve (picklable: strings, not functions).
        num_workers: the pool's `max_workers`.
        timeout_s: seconds for the whole warm-up; each task also runs under it (pebble kills a worker whose import
            hangs).
        stopped: polled between tasks; True (the pool is closing) ends the warm-up at once.

    Returns:
        The number of distinct workers that ran the task (== num_workers when the pool is warm; fewer after the
        deadline, a stop, or a task that raised: the cause is logged, and requests then pay the rest of the
        start-up, as without a warm-up).
    """
    deadline = time.monotonic() + timeout_s
    ready: set[int] = set()
    while len(ready) < num_workers and not stopped():
        try:
            futures = [
                pool.schedule(import_in_worker, args=(resolve, tuple(specs)), timeout=timeout_s)
                for _ in range(num_workers)
            ]
        except RuntimeError:  # the pool was stopped meanwhile
            return len(ready)
        for future in futures:
            while not future.done() and not stopped() and time.monotonic() < deadline:
                wait([future], timeout=ROUND_PAUSE_S)
            if not future.done():
                for f in futures:
                    f.cancel()
                if not stopped():
                    logger.warning(
                        "only %d of %d workers started within %g s; requests pay the rest of the start-up",
                        len(ready),
                        num_workers,
                        timeout_s,
                    )
                return len(ready)
            if future.cancelled():
                return len(ready)
            error = future.exception()
            if error is not None:
                logger.warning("a worker failed to load the user code while warming up: %r", error)
                return len(ready)
            ready.add(future.result())
        if len(ready) < num_workers:
            time.sleep(ROUND_PAUSE_S)
    return len(ready)
