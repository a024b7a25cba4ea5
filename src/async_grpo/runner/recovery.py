"""Recovering a lost inference server in the middle of a run (issue 14: "a dead vLLM").

The orchestrator marks the server lost when a generation request fails at the transport level; the runner's waits
then raise `InferenceLost`, and a weight push that fails for any reason means the same. `InferenceRecovery.recover`
brings the server back (`ReplicaPusher.recover_all` -> `InferenceEndpoint.recover`: the local backend restarts its
process; a Kubernetes Deployment restarts its pod and we wait for `/health`), re-initialises the weight transfer,
pushes the trainer's current weights (a new policy version: the server may hold a half-loaded update or its base
weights) and opens the gate again, so the groups the orchestrator parked meanwhile are generated again instead of
being lost. With several replicas this is the case where none is left: one lost replica among live ones is
recovered in the background by the pusher (`transports.weights.replicas`) and never reaches this module. After
`max_inference_restarts` recoveries the next loss fails the run with a clear message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from async_grpo.errors import RunFailedError
from async_grpo.inference.health import InferenceHealth, InferenceLost
from async_grpo.inference.replicas import ReplicaSet
from async_grpo.transports.weights.replicas import ReplicaPusher

logger = logging.getLogger(__name__)

T = TypeVar("T")


class InferenceFailedError(RunFailedError):
    """The inference server was lost more than `max_inference_restarts` times, or could not be brought back."""


class InferenceRecovery:
    """Brings the run's lost vLLM server(s) back and re-pushes the weights; every collaborator is named.

    Args:
        health: the run's gate (`mark_lost` / `restored`, restart and parked-group counters).
        replicas: the vLLM servers (their URLs name them in messages).
        pusher: the weight pusher to every replica (`recover_all` restarts or waits, new transfer groups).
        push_weights: pushes the trainer's current weights as the next policy version and bumps it; returns the
            push's seconds (`GRPORecipe.push_weights`).
        log_metrics: `(metrics, step)` -> None, the run's tracker.
        current_step: the trainer's optimizer step now (the metrics' step).
        current_version: the policy version now (for the log line).
        max_restarts: `max_inference_restarts`: recoveries allowed before the next loss fails the run.
        recovery_timeout_s: `vllm_recovery_timeout_s`: seconds a server may take to come back.
        log_hint: the server log a user should read when recovery fails (`<output_dir>/vllm.log`).
        before_recover: called first in every `recover` (the recipe ends a background weight push still in flight
            there, `OverlappedPush.drain`, so two pushes never share a pusher); None: nothing.
        stop_signal: the stop signal the run received and has not acted on yet (`StopGuard.pending`), or None. A
            run that is stopping never restarts a server it lost meanwhile (a restart there cost a 20 s vLLM start
            on the way out). Default: no signal is ever pending.
    """

    def __init__(
        self,
        *,
        health: InferenceHealth,
        replicas: ReplicaSet,
        pusher: ReplicaPusher,
        push_weights: Callable[[], float],
        log_metrics: Callable[[dict[str, float], int], None],
        current_step: Callable[[], int],
        current_version: Callable[[], int],
        max_restarts: int,
        recovery_timeout_s: float,
        log_hint: Path,
        before_recover: Callable[[], object] | None = None,
        stop_signal: Callable[[], int | None] = lambda: None,
    ):
        self.health = health
        self.replicas = replicas
        self.pusher = pusher
        self.push_weights = push_weights
        self.log_metrics = log_metrics
        self.current_step = current_step
        self.current_version = current_version
        self.max_restarts = max_restarts
        self.recovery_timeout_s = recovery_timeout_s
        self.log_hint = log_hint
        self.before_recover = before_recover
        self.stop_signal = stop_signal

    def surviving(self, fn: Callable[[], T]) -> T:
        """`fn()`, recovering the server and calling it again each time it raises `InferenceLost` (its waits poll
        the gate; a `StepStream` replays the chunks it already consumed, so a step interrupted this way is redone
        exactly).

        Raises:
            InferenceFailedError: see `recover`.
        """
        while True:
            try:
                return fn()
            except InferenceLost as err:
                self.recover(str(err))

    def push(self) -> float:
        """`push_weights()`; when the push fails (the server died, or a broadcast or control call failed), the
        server is recovered, which pushes the same weights again. Returns the seconds of the push that succeeded.
        When the run is stopping (`stop_signal`), a failed push is skipped instead (0.0 returned, a warning
        logged): the step is complete in the trainer and its checkpoint holds its weights, which a resumed run
        serves (under the version of the last push that succeeded, as any checkpoint written off a push).

        Raises:
            InferenceFailedError: see `recover`.
        """
        try:
            return self.push_weights()
        except Exception as err:
            signum = self.stop_signal()
            if signum is None:
                return self.recover(f"a weight push failed: {err!r}")
            logger.warning(
                "the weight push of step %d was skipped: the run is stopping (signal %d) and vLLM did not take it "
                "(%r); the step's checkpoint holds its weights",
                self.current_step(),
                signum,
                err,
            )
            return 0.0

    def recover(self, reason: str) -> float:
        """Bring the lost server back and push the current weights (see the module docstring); returns the push's
        seconds. Logs `inference/restarts`, `inference/recovery_seconds` and `inference/regenerated_groups`.

        Raises:
            InferenceFailedError: this loss is one more than `max_restarts`, or the server did not come back (the
                cause is chained); the message names the server, the reason and the fix.
            KeyboardInterrupt: the run is stopping (`stop_signal`): the server is not restarted, the run stops.
        """
        signum = self.stop_signal()
        if signum is not None:
            raise KeyboardInterrupt(
                f"signal {signum}: the run is stopping; the vLLM server lost ({reason}) is not restarted"
            )
        if self.before_recover is not None:  # e.g. a background push in flight ends before the pushers restart
            self.before_recover()
        health = self.health
        health.mark_lost(reason)
        url = self.replicas.urls
        if health.restarts >= self.max_restarts:
            raise InferenceFailedError(
                f"the vLLM server at {url} was lost again after {health.restarts} recoveries "
                f"(max_inference_restarts={self.max_restarts}): {health.reason}. Fix: read {self.log_hint} (or the "
                "vLLM pod's log) for the cause, or raise max_inference_restarts"
            )
        t0 = time.perf_counter()
        try:
            self.pusher.recover_all(self.recovery_timeout_s)  # restart / wait, new transfer groups
            seconds = self.push_weights()
        except Exception as err:
            raise InferenceFailedError(
                f"the vLLM server at {url} could not be brought back after: {health.reason}. Fix: read "
                f"{self.log_hint} (or the vLLM pod's log); raise vllm_recovery_timeout_s if it is only slow to start"
            ) from err
        health.restored()
        took = time.perf_counter() - t0
        logger.warning(
            "vLLM recovered in %.1f s (recovery %d of at most %d); policy version %d pushed",
            took,
            health.restarts,
            self.max_restarts,
            self.current_version(),
        )
        self.log_metrics(
            {
                "inference/restarts": float(health.restarts),
                "inference/recovery_seconds": took,
                "inference/regenerated_groups": float(health.parked_groups),
            },
            self.current_step(),
        )
        return seconds
