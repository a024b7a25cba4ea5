"""The run's progress where Kubeflow Trainer 2.x reads it: the TrainJob's `status.trainerStatus` (KEP-2779).

With the controller's `TrainJobStatus` feature gate on, Kubeflow Trainer injects into each trainer pod the URL of its
status server, a CA certificate and a projected ServiceAccount token scoped to the TrainJob
(`KUBEFLOW_TRAINER_SERVER_URL`, `..._CA_CERT`, `..._TOKEN`). The Kubeflow SDK's `update_trainjob_status` posts to it
(progress percentage, estimated remaining seconds, metrics as strings) and does nothing without them: on a laptop,
under kfp.local or in a PyTorchJob. `kubectl get trainjob` and the Kubeflow UI then show the run's progress.

The post is an HTTPS call with a 5 s timeout, so it never runs on the training loop: `update` only stores the
latest snapshot, and a daemon thread posts it every `interval_s` seconds (the SDK also drops calls closer than 5 s
apart) and once more, with the final numbers, when the run stops. The pod reaches the status server only where the
platform opens that egress (`PlatformPolicy.trainjob_status_namespace`, docs/security.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"  # set by the controller when it collects trainer status
SDK_THROTTLE_S = 5.0  # `update_trainjob_status` drops a call within this many seconds of the last one it sent
REPORTED_METRICS = ("reward", "eval/reward", "policy_version", "staleness/mean")  # besides step and max_steps


def trainer_status(step: int, max_steps: int, elapsed_s: float, metrics: Mapping[str, float]) -> dict:
    """What one report says: the keyword arguments of the SDK's `update_trainjob_status`.

    Args:
        step: optimizer steps done.
        max_steps: optimizer steps the run will take (>= 1).
        elapsed_s: seconds of the step loop so far (the estimate's rate is step / elapsed_s).
        metrics: the latest values of the step's metrics; those of `REPORTED_METRICS` that are present are
            reported, beside `step` and `max_steps`.

    Returns:
        {"progress_percent": 0-100 (int), "estimated_remaining_seconds": (max_steps - step) / rate, rounded (None
        before the first step), "metrics": {name: value}} with every value as the SDK sends it (`str(value)`,
        at most 64 characters: the CRD's limit).
    """
    percent = max(0, min(100, int(100 * step / max(max_steps, 1))))
    remaining = round((max_steps - step) * elapsed_s / step) if step > 0 else None
    reported = {"step": step, "max_steps": max_steps}
    reported.update({k: round(float(metrics[k]), 4) for k in REPORTED_METRICS if metrics.get(k) is not None})
    return {
        "progress_percent": percent,
        "estimated_remaining_seconds": max(remaining, 0) if remaining is not None else None,
        "metrics": reported,
    }


class TrainJobProgress:
    """Reports the step loop's progress to the TrainJob's status from a background thread (rank 0 only).

    Args:
        max_steps: optimizer steps the run will take.
        interval_s: seconds between two reports (>= the SDK's 5 s throttle).
        post: the reporting call (`kubeflow.trainer.update_trainjob_status`; a test passes its own); it must never
            raise and returns whether the report was taken.
        environ: where the controller's variables are read (`os.environ`).
        now: the clock, in seconds.
    """

    def __init__(
        self,
        max_steps: int,
        *,
        interval_s: float = 15.0,
        post: Callable[..., bool] | None = None,
        environ: Mapping[str, str] = os.environ,
        now: Callable[[], float] = time.monotonic,
    ):
        self.max_steps = max_steps
        self.interval_s = max(interval_s, SDK_THROTTLE_S)
        self.enabled = bool(environ.get(SERVER_URL_ENV))
        self._post = post
        self._now = now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = now()
        self._snapshot: tuple[int, float, dict[str, float]] = (0, 0.0, {})
        self._last_post = float("-inf")
        self.reports = 0  # reports the status server took

    def start(self) -> None:
        """Start the reporting thread (nothing outside a TrainJob that collects trainer status)."""
        if not self.enabled or self._thread is not None:
            return
        if self._post is None:
            from kubeflow.trainer import update_trainjob_status

            self._post = update_trainjob_status
        self._start = self._now()
        self._thread = threading.Thread(target=self._loop, name="trainjob-progress", daemon=True)
        self._thread.start()
        logger.info("reporting progress to the TrainJob's status every %.0f s", self.interval_s)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Keep step `step`'s metrics for the next report; returns at once."""
        with self._lock:
            self._snapshot = (step, self._now() - self._start, dict(metrics))

    def stop(self, timeout_s: float = 2 * SDK_THROTTLE_S + 5.0) -> None:
        """Send the final report (after the SDK's throttle window, at most `timeout_s` seconds) and end the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the TrainJob progress thread did not end within %.0f s (it is a daemon)", timeout_s)
        self._thread = None

    def _loop(self) -> None:
        """Report every `interval_s` until stopped, then once more with the last snapshot."""
        while not self._stop.wait(self.interval_s):
            self._report()
        wait = self._last_post + SDK_THROTTLE_S - self._now()
        if wait > 0:
            time.sleep(min(wait, SDK_THROTTLE_S))
        self._report()

    def _report(self) -> None:
        with self._lock:
            step, elapsed_s, metrics = self._snapshot
        status = trainer_status(step, self.max_steps, elapsed_s, metrics)
        if self._post(**status):
            self.reports += 1
            self._last_post = self._now()
