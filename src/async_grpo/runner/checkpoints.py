"""Periodic checkpoints, their rotation, and checkpointing on a stop signal (the folders' layout, and which one a
resume means: `async_grpo.checkpoint_layout`). What a checkpoint keeps of the prompt order is the producer's
(`orchestrator.progress`).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_grpo.checkpoint_layout import META_FILE, PREFIX, STATE_FILE, checkpoint_dir, complete_checkpoints

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ folders
def rotate_checkpoints(output_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (None: keep all), and leftover temporary folders
    of interrupted writes. Call it only after the newest checkpoint is complete. Returns the deleted folders."""
    root = Path(output_dir)
    deleted = []
    if root.is_dir():
        for tmp in root.glob(f".{PREFIX}*.tmp-*"):  # an interrupted write (ours finished before rotating)
            shutil.rmtree(tmp, ignore_errors=True)
    if keep is None:
        return deleted
    for _step, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `meta.json` (step, policy_version, mlflow_run_id), read without torch."""
    return json.loads((Path(path) / META_FILE).read_text())


def save_every(save_steps: int | float, max_steps: int) -> int:
    """Steps between periodic checkpoints: `save_steps`, or below 1 that fraction of `max_steps` (HF), at least
    1; 0 means none."""
    if not save_steps:
        return 0
    if save_steps < 1:
        return max(1, int(save_steps * max_steps + 0.5))
    return int(save_steps)


def resumed_run_id(path: Path | None) -> str | None:
    """The MLflow run id a resumed run continues (from the checkpoint's meta.json); None for a fresh run."""
    return read_meta(path)["mlflow_run_id"] if path is not None else None


class Checkpointer:
    """One run's periodic checkpoints (`save_steps`, rotated by `save_total_limit`) and its checkpoint on a stop
    signal (`checkpoint_on_signal`).

    Args:
        out_dir: the run folder; checkpoints go to `<out_dir>/checkpoint-<step>`.
        save_steps: steps between checkpoints (below 1: that fraction of `max_steps`; 0: none), HF's name.
        save_total_limit: newest complete checkpoints kept (None: all).
        checkpoint_on_signal: write one when a stop signal ends the run between steps.
        max_steps: the run's optimizer steps.
        save: writes the run's `TrainState` and policy into a folder and returns it (`GRPORecipe.save_checkpoint`).
        guard: the run's `StopGuard` (a checkpoint is written only between steps).
    """

    def __init__(
        self,
        *,
        out_dir: Path,
        save_steps: int | float,
        save_total_limit: int | None,
        checkpoint_on_signal: bool,
        max_steps: int,
        save: Callable[[Path], Path],
        guard: StopGuard,
    ):
        self.out_dir = out_dir
        self.save_total_limit = save_total_limit
        self.checkpoint_on_signal = checkpoint_on_signal
        self.every = save_every(save_steps, max_steps)
        self.save = save
        self.guard = guard
        self.failed_writes = 0  # periodic checkpoints that raised OSError (metric checkpoint/failed_writes)

    def due(self, step: int) -> bool:
        """True when `after_step(step, ...)` writes a periodic checkpoint (every `save_steps` steps)."""
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (its weight push, its logged metrics and the producer's `mark_trained`) is complete: settle
        the guarded section (`StopGuard.settle`; the caller ends it), and every `save_steps` steps write a
        checkpoint (its seconds go to `metrics["checkpoint/seconds"]`, which the caller logs at `step`). The
        checkpoint keeps the step's metrics that MLflow has not taken yet (`TrainState.unlogged_metrics`).

        A checkpoint that cannot be written (a full or failing disk: `OSError`) does not end the run: the error is
        logged, its temporary folder removed, no older checkpoint deleted (the newest complete one stays the resume
        point), and `metrics["checkpoint/failed_writes"]` counts the failures so far; the next `save_steps` tries
        again.
        """
        self.guard.settle()
        if self.due(step):
            try:
                metrics["checkpoint/seconds"] = self.write(step)
            except OSError as err:
                self.failed_writes += 1
                logger.error(
                    "checkpoint of step %d not written (%s); training goes on, the resume point stays the newest "
                    "complete checkpoint. Fix: free space in %s (the next save_steps tries again)",
                    step,
                    err,
                    self.out_dir,
                )
            if self.failed_writes:
                metrics["checkpoint/failed_writes"] = float(self.failed_writes)

    def write(self, step: int) -> float:
        """Write `<out_dir>/checkpoint-<step>` (between steps), then delete the oldest beyond `save_total_limit`
        (only now that the new one is complete); returns the seconds it took (logged as `checkpoint/seconds`).

        Raises:
            OSError: the folder could not be written (no older checkpoint has been deleted).
        """
        t0 = time.perf_counter()
        path = self.save(checkpoint_dir(self.out_dir, step))
        rotate_checkpoints(self.out_dir, self.save_total_limit)
        seconds = time.perf_counter() - t0
        logger.info("checkpoint %s written in %.2f s", path, seconds)
        return seconds

    def on_stop(self, step: int, log_metrics: Callable[[dict[str, float], int], None]) -> Path | None:
        """After a stop signal: write a checkpoint of step `step` if the run is between steps, past its first step,
        and that step has none yet (`checkpoint_on_signal`); returns its folder, or None. Never raises (a failure is
        logged: the newest periodic checkpoint stays the resume point).

        Args:
            log_metrics: `(metrics, step)` -> None, where `checkpoint/seconds` goes.
        """
        self.guard.disarm()
        if not (self.checkpoint_on_signal and self.guard.consistent and step > 0):
            return None
        path = checkpoint_dir(self.out_dir, step)
        try:
            if not (path / STATE_FILE).is_file():
                log_metrics({"checkpoint/seconds": self.write(step)}, step)
            return path
        except Exception as err:
            logger.error("checkpoint on stop failed: %r", err)
            return None


# ------------------------------------------------------------------------------------------------ stop signals
class StopGuard:
    """Lets a stop signal wait for the end of an optimizer step so a checkpoint can follow it.

    The launch backend's signal handler calls `on_signal()`: outside a step it returns True (stop now: raise
    KeyboardInterrupt), inside one it returns False, records the signal and arms a timer of `max_wait_s`
    (SIGALRM) after which the step is abandoned; the step loop calls `check()` at the step's end, which raises
    KeyboardInterrupt then. A second signal always stops at once. `consistent` is True between steps and once a
    step's state is settled (`settle()`: learner, version and counters agree), False from a step's start until
    then (an exception in between leaves it False: no checkpoint of a half step). A settled step still holds a
    signal back until `end()`, so the step's evaluation and metrics are logged before the run stops: a
    checkpoint on stop never names a step whose metrics were lost.

    Args:
        max_wait_s: seconds a signal waits for the running step (None: no limit).
    """

    def __init__(self, max_wait_s: float | None = None):
        self.max_wait_s = max_wait_s
        self.in_step = False
        self.consistent = True
        self.pending: int | None = None

    def begin(self) -> None:
        """A step (learner update and weight push) starts."""
        self.consistent = False
        self.in_step = True

    def settle(self) -> None:
        """The step's state is complete (the learner, version and counters agree again: a checkpoint of it may be
        written), while its reporting still runs; a signal keeps waiting for `end()`."""
        self.consistent = True

    def end(self) -> None:
        """The step ended, its metrics included: a signal now stops the run at once."""
        self.in_step = False
        self.consistent = True

    def on_signal(self, signum: int) -> bool:
        """Record signal `signum`; True when the caller should stop at once."""
        if not self.in_step or self.pending is not None:
            self.pending = signum
            return True
        self.pending = signum
        if self.max_wait_s and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, _abandon_step)
            signal.setitimer(signal.ITIMER_REAL, self.max_wait_s)
        return False

    def check(self) -> None:
        """At a step's end: raise KeyboardInterrupt if a signal is pending (and disarm the timer)."""
        if self.pending is not None:
            self.disarm()
            raise KeyboardInterrupt(f"signal {self.pending}")

    def disarm(self) -> None:
        """Cancel the timer `on_signal` armed (a step that failed instead of ending must not be interrupted
        again later, during cleanup)."""
        if self.max_wait_s and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)


def _abandon_step(signum, frame) -> None:
    raise KeyboardInterrupt("the step did not end within checkpoint_signal_grace_s / 2; abandoned")
