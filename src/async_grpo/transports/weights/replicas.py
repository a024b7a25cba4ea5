"""Every weight push reaches every live vLLM replica; a lost replica is brought back and rejoins behind none.

vLLM's weight-transfer engine joins one trainer to the workers of one server, so each replica gets its own transfer
group (one per-replica `push.WeightPush`: `WeightPusher` or `LoRAAdapterPusher`). A push sends to all live replicas at once (one thread each): each pauses, receives and resumes on its
own, and the run's policy version moves only after every replica answered. A replica whose push fails is marked
lost and the push still counts when another replica took it. A replica lost while others serve is recovered in the
background (`InferenceEndpoint.recover`: restart the local process, or wait for Kubernetes to replace the pod) and
rejoins at the next push with a fresh transfer group and the full current weights; until then it gets no requests.
When no replica is live, `push` raises and the runner's `recovery.recover` calls `recover_all`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from async_grpo.inference.replicas import Replica, ReplicaSet
from async_grpo.transports.weights.push import PushReport, WeightPush

logger = logging.getLogger(__name__)

JOIN_S = 5.0  # how long `close` waits for a background recovery (it is a daemon thread; the backend stops servers)


class NoReplicaError(RuntimeError):
    """No vLLM replica accepted a weight push (the runner then recovers them: `runner.recovery`)."""


class ReplicaPusher:
    """Weight pushes to all replicas of a `ReplicaSet` (a `push.WeightPush` over one per replica).

    Args:
        replicas: the run's replicas.
        make: builds a per-replica pusher (not yet set up) for a replica URL.
        recovery_timeout_s: longest wait for one lost replica to come back (seconds; `vllm_recovery_timeout_s`).
        max_restarts: background recoveries per replica before it is given up for the rest of the run
            (`max_inference_restarts`).
        parallel: push to the replicas at once (one thread each). False pushes one after another: needed when
            iterating the weights is a collective across trainer ranks (FSDP shards), which two concurrent passes
            would interleave.

    Attributes:
        last_seconds: per replica index, the seconds of its part of the last push.
        last_report: the last push's `PushReport`: its wall seconds, the most bytes any replica's pusher reported
            (wire and dense), and with several replicas each one's seconds.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        make: Callable[[str], WeightPush],
        *,
        recovery_timeout_s: float = 600.0,
        max_restarts: int = 3,
        parallel: bool = True,
    ):
        self.replicas = replicas
        self.parallel = parallel
        self.make = make
        self.recovery_timeout_s = recovery_timeout_s
        self.max_restarts = max_restarts
        self.pushers: dict[int, WeightPush] = {}
        self.last_seconds: dict[int, float] = {}
        self.last_report = PushReport()
        self.stop = threading.Event()

    def setup(self) -> None:
        """Rendezvous with every live replica (once, at the start of the run).

        Raises:
            whatever a per-replica `setup` raises (a server that rejects the handshake at start is a setup error).
        """
        for replica in self.replicas.live():
            self._join(replica)

    def _join(self, replica: Replica) -> None:
        old = self.pushers.pop(replica.index, None)
        if old is not None:
            _close_quietly(old)
        pusher = self.make(replica.url)
        pusher.setup()
        self.pushers[replica.index] = pusher

    def push(self, version: int) -> float:
        """Send the current weights tagged `version` to every live replica and to those that recovered since the
        last push (which first get a fresh transfer group); start background recoveries for lost ones. Returns the
        wall seconds of the whole push.

        Raises:
            NoReplicaError: no replica took the push (the first failure is chained).
        """
        self._recover_lost_in_background()
        targets = list(self.replicas.in_state("available", "syncing"))
        for replica in self.replicas.in_state("ready"):
            try:
                self._join(replica)
                targets.append(replica)
            except Exception as err:
                self.replicas.mark_lost(replica, f"the weight transfer could not be set up again: {err!r}")
        if not targets:
            raise NoReplicaError(f"no live vLLM replica to push policy version {version} to ({self.replicas.urls})")
        t0 = time.perf_counter()
        for replica in targets:
            self.replicas.set_state(replica, "syncing")
        workers = len(targets) if self.parallel else 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weight-push") as pool:
            futures = {replica.index: pool.submit(self._timed_push, replica, version) for replica in targets}
        errors, self.last_seconds = [], {}
        for replica in targets:
            err = futures[replica.index].exception()
            if err is None:
                self.last_seconds[replica.index] = futures[replica.index].result()
                self.replicas.set_state(replica, "available")
            else:
                errors.append(err)
                self.replicas.mark_lost(replica, f"a weight push failed: {err!r}")
        if len(errors) == len(targets):
            raise NoReplicaError(f"no vLLM replica accepted policy version {version}: {errors[0]!r}") from errors[0]
        seconds = time.perf_counter() - t0
        reports = [self.pushers[i].last_report for i in self.last_seconds]
        self.last_report = PushReport(
            seconds=seconds,
            wire_bytes=max(r.wire_bytes for r in reports),
            dense_bytes=max(r.dense_bytes for r in reports),
            replica_seconds=dict(self.last_seconds) if len(self.replicas) > 1 else {},
        )
        return seconds

    def _timed_push(self, replica: Replica, version: int) -> float:
        return float(self.pushers[replica.index].push(version))

    def _recover_lost_in_background(self) -> None:
        """For each lost replica while another one serves: one daemon thread brings it back (state `recovering`,
        then `ready`, or `lost` again when it failed)."""
        if not self.replicas.live():
            return  # nothing serves: the runner's blocking recovery (`recover_all`) handles it
        for replica in self.replicas.in_state("lost"):
            if replica.restarts >= self.max_restarts:
                continue  # given up (logged once when it reached the limit)
            self.replicas.set_state(replica, "recovering")
            replica.thread = threading.Thread(
                target=self._recover_one, args=(replica,), daemon=True, name=f"vllm-replica-{replica.index}-recovery"
            )
            replica.thread.start()

    def _recover_one(self, replica: Replica) -> None:
        t0 = time.perf_counter()
        try:
            replica.endpoint.recover(self.recovery_timeout_s)
        except Exception as err:
            replica.restarts += 1
            self.replicas.set_state(replica, "lost")
            if self.stop.is_set():  # the run ended meanwhile and stopped the server it was restarting
                logger.info("vLLM replica %d: recovery stopped with the run (%r)", replica.index, err)
                return
            logger.warning(
                "vLLM replica %d could not be brought back (%d of %d tries): %r",
                replica.index,
                replica.restarts,
                self.max_restarts,
                err,
            )
            return
        replica.restarts += 1
        if self.stop.is_set():
            return
        self.replicas.set_state(replica, "ready")
        logger.warning(
            "vLLM replica %d back at %s after %.1f s; it rejoins at the next weight push",
            replica.index,
            replica.url,
            time.perf_counter() - t0,
        )

    def recover_all(self, timeout_s: float) -> None:
        """Bring back every replica that is not live (blocking: nothing serves), with a fresh transfer group each;
        the caller then pushes the current weights, which makes them available.

        Raises:
            the last replica's error when none came back.
        """
        for replica in self.replicas.replicas:
            if replica.thread is not None:
                replica.thread.join(timeout_s)
        last: Exception | None = None
        back = 0
        for replica in self.replicas.in_state("lost", "recovering", "ready"):
            try:
                if replica.state != "ready":
                    replica.endpoint.recover(timeout_s)
                    replica.restarts += 1
                self._join(replica)
                self.replicas.set_state(replica, "available")
                back += 1
            except Exception as err:
                last = err
                self.replicas.set_state(replica, "lost")
                logger.warning("vLLM replica %d at %s did not come back: %r", replica.index, replica.url, err)
        if back == 0 and not self.replicas.live():
            raise last if last is not None else NoReplicaError("no vLLM replica to recover")

    def close(self) -> None:
        """Tear down every transfer group; background recoveries are told to stop and waited for briefly."""
        self.stop.set()
        for replica in self.replicas.replicas:
            if replica.thread is not None:
                replica.thread.join(JOIN_S)
        for pusher in self.pushers.values():
            _close_quietly(pusher)
        self.pushers.clear()


def _close_quietly(pusher: WeightPush) -> None:
    try:
        pusher.close()
    except Exception as err:
        logger.info("closing a weight transfer: %r", err)
