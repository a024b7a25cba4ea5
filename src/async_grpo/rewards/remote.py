"""Score groups on a reward service (`python -m async_grpo.rewards.server`) through RewardPool's interface.

The orchestrator cannot tell the two apart: `submit` returns a concurrent Future that resolves to the same
(G, F) rows or fails with the same RewardError subclasses and reasons. Requests run on a private asyncio
loop in one daemon thread, so `close()` cancels in-flight requests at once instead of waiting them out.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

import httpx

from async_grpo import __version__
from async_grpo.config import GRPOConfig
from async_grpo.rewards.contract import RewardTrainerState
from async_grpo.rewards.loading import reward_func_name
from async_grpo.rewards.pool import CLOSE_TIMEOUT_S, RewardPool, check_group
from async_grpo.rewards.wire import (
    AUTH_TOKEN_ENV,
    FUNCTIONS_PATH,
    HEALTH_PATH,
    REQUEST_MARGIN_S,
    REWARD_URL_ENV,
    SCORE_PATH,
    decode_scored,
    error_from_body,
)
from async_grpo.transports.scorer import RewardError, RewardTimeout, ScoredGroup

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # the reward pod may still be starting when the trainer does
# A service answering /health with 503 {"status": "starting"} is up and warming its workers (`rewards.server.warm_up`:
# imports that may load a model): it is waited for this long from the first poll, beyond connect_timeout_s (seconds).
STARTING_TIMEOUT_S = 600.0
HEALTH_POLL_S = 0.5
PROBE_TIMEOUT_S = 5.0  # one /health or /v1/reward_functions request
TCP_CONNECT_TIMEOUT_S = 10.0  # opening a connection for a score request
DEFAULT_MAX_CONCURRENCY = 2  # = RewardPool's default num_workers
KEEPALIVE_EXPIRY_S = 2.0  # idle pooled connections dropped sooner than any server closes them (ours: KEEPALIVE_S)

_URL_FIX = (
    f"Fix: check that the reward service is running and ready (on Kubernetes: kubectl get pods -l "
    f"app.kubernetes.io/component=reward) and that reward_url or ${REWARD_URL_ENV} points at it."
)


class RemoteRewardPool:
    """The client of a reward service: scores one group of G completions per `submit`, like `RewardPool`.

    Construction waits for the service's /health, then reads its reward functions. Use as a context
    manager, or call `close()`. Thread-safe: `submit` may be called from any thread (wrap the returned
    future with `asyncio.wrap_future` in async code).

    Attributes:
        url: the service's base URL, without a trailing slash.
        names: the served functions' names (for metric names `rewards/<name>/mean`), as the service reports.
        weights: one weight per function, as the service reports; applying them is the caller's job.
        timeout_s: the per-group time limit (seconds) the service enforces.
        request_timeout_s: how long (seconds) one score request may take before it fails with RewardTimeout:
            max(timeout_s, the service's) + 2 x request_margin_s (the service itself gives up after one margin).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        *,
        expected_names: Sequence[str] | None = None,
        expected_weights: Sequence[float] | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        request_margin_s: float = REQUEST_MARGIN_S,
        token: str | None = None,
    ):
        """Wait until the service is ready and check that it serves the expected functions.

        Args:
            url: base URL, e.g. http://my-run-reward.ns.svc.cluster.local:8080.
            timeout_s: the run's per-group reward time limit (seconds), i.e. `reward_timeout_s`.
            max_concurrency: score requests in flight at once; later groups wait here, off the clock. Keep
                it at most the service's worker count, so no group waits for a worker on the server.
            expected_names: the function names this run expects (from its `reward_funcs`); None skips the check.
            expected_weights: the weights this run expects; None skips the check.
            connect_timeout_s: how long (seconds) to wait for /health to answer 200; a service that answers
                "starting" (warming its workers) is waited for up to STARTING_TIMEOUT_S.
            request_margin_s: seconds beyond timeout_s allowed for JSON, the network and the server's queue.
            token: bearer token sent with every request; None reads env ASYNC_GRPO_REWARD_TOKEN (unset: none).

        Raises:
            ValueError: a bad argument, or the service serves other functions or weights than expected
                (the message lists both and the fix).
            RewardError: the service did not become ready within connect_timeout_s, or answered something
                that is not a reward service's answer (the message names the URL and the fix).
        """
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_url={url!r} is not an http(s) URL. Fix: e.g. http://my-run-reward:8080.")
        for name, value, low in (("timeout_s", timeout_s, 0.0), ("connect_timeout_s", connect_timeout_s, 0.0)):
            if not value > low:
                raise ValueError(f"{name}={value} must be > 0 seconds. Fix: give a positive number.")
        if not request_margin_s >= 0:
            raise ValueError(f"request_margin_s={request_margin_s} must be >= 0 seconds.")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency!r} must be an int >= 1. Fix: e.g. reward_num_workers.")
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(AUTH_TOKEN_ENV, "")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        info = self._connect(connect_timeout_s)
        self.names: list[str] = info["names"]
        self.weights: list[float] = info["weights"]
        self.timeout_s: float = info["timeout_s"]
        if expected_names is not None and list(expected_names) != self.names:
            raise ValueError(
                f"the reward service at {self.url} serves reward functions {self.names}, but this run's "
                f"reward_funcs name {list(expected_names)}. Fix: start the service with this run's config "
                f"(on Kubernetes it reads the run's ConfigMap), or point reward_url at the right service."
            )
        if expected_weights is not None and [float(w) for w in expected_weights] != self.weights:
            raise ValueError(
                f"the reward service at {self.url} weights its functions {self.names} with {self.weights}, but "
                f"this run's reward_weights are {list(expected_weights)}. Fix: start the service with this run's "
                f"config, or point reward_url at the right service."
            )
        if self.timeout_s != timeout_s:
            logger.warning(
                "the reward service at %s limits a group to %g s, this run's reward_timeout_s is %g s; "
                "the service's limit applies",
                self.url,
                self.timeout_s,
                timeout_s,
            )
        if info.get("version") != __version__:
            logger.warning(
                "the reward service at %s runs async-grpo %s, this process %s",
                self.url,
                info.get("version"),
                __version__,
            )
        self.request_timeout_s = max(float(timeout_s), self.timeout_s) + 2 * request_margin_s
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=self._headers,
            timeout=httpx.Timeout(self.request_timeout_s, connect=TCP_CONNECT_TIMEOUT_S),
            limits=httpx.Limits(
                max_connections=max_concurrency,
                max_keepalive_connections=max_concurrency,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )
        self._slots = asyncio.Semaphore(max_concurrency)
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._closed = False
        self._trainer_state: dict[str, int] = RewardTrainerState().to_dict()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-http", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------------------- connect
    def _connect(self, timeout_s: float) -> dict[str, Any]:
        """Poll /health until 200 within `timeout_s` (STARTING_TIMEOUT_S while it answers "starting"), then read
        /v1/reward_functions (validated)."""
        t0 = time.monotonic()
        last, starting = "no answer", False
        with httpx.Client(base_url=self.url, timeout=PROBE_TIMEOUT_S, headers=self._headers) as http:
            while True:
                limit = max(timeout_s, STARTING_TIMEOUT_S) if starting else timeout_s
                probe_s = max(0.1, min(PROBE_TIMEOUT_S, limit - (time.monotonic() - t0)))
                try:
                    resp = http.get(HEALTH_PATH, timeout=probe_s)
                    if resp.status_code == 200:
                        break
                    last = f"HTTP {resp.status_code} {resp.text[:200]!r}"
                    starting = resp.status_code == 503 and _health_status(resp) == "starting"
                except httpx.HTTPError as err:
                    last, starting = f"{type(err).__name__}: {err}", False
                waited = time.monotonic() - t0
                limit = max(timeout_s, STARTING_TIMEOUT_S) if starting else timeout_s
                left = limit - waited
                if left <= 0:
                    raise RewardError(
                        f"the reward service at {self.url} was not ready within {limit:g} s (last: {last}). {_URL_FIX}"
                    )
                time.sleep(min(HEALTH_POLL_S, left))
            try:
                resp = http.get(FUNCTIONS_PATH)
                info = resp.json()
            except (httpx.HTTPError, ValueError) as err:
                raise RewardError(
                    f"reading {self.url}{FUNCTIONS_PATH} failed: {type(err).__name__}: {err}. {_URL_FIX}"
                ) from None
        ok = (
            resp.status_code == 200
            and isinstance(info, dict)
            and isinstance(info.get("names"), list)
            and all(isinstance(n, str) for n in info["names"])
            and isinstance(info.get("weights"), list)
            and len(info["weights"]) == len(info["names"])
            and len(info["names"]) > 0
            and all(isinstance(w, (int, float)) and math.isfinite(w) for w in info["weights"])
            and isinstance(info.get("timeout_s"), (int, float))
            and info["timeout_s"] > 0
        )
        if not ok:
            raise RewardError(
                f"{self.url}{FUNCTIONS_PATH} answered HTTP {resp.status_code} {info!r:.300}, not a "
                "reward service's function list. Fix: point reward_url at `python -m "
                "async_grpo.rewards.server` of the same async-grpo version."
            )
        info["weights"] = [float(w) for w in info["weights"]]
        info["timeout_s"] = float(info["timeout_s"])
        return info

    # -------------------------------------------------------------------------------------------- scoring
    def set_trainer_state(self, **fields: int) -> None:
        """Update the `trainer_state` sent with later groups (e.g. global_step after each step)."""
        self._trainer_state = {**self._trainer_state, **fields}

    def submit(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
        trainer_state: Mapping[str, int] | None = None,
    ) -> Future:
        """Score one group of G completions with every served reward function, on the service.

        Args:
            prompts: G prompts (the group's prompt repeated, as TRL passes it).
            completions: G completions (strings, or message lists for conversational prompts).
            completion_ids: G lists of completion token ids.
            columns: the dataset's other columns, each a list of G JSON-encodable values.
            trainer_state: the `trainer_state` fields for this group; None: this client's (`set_trainer_state`).

        Returns:
            A Future resolving to a (G, F) list of lists of floats, F = len(names), NaN where a function
            returned None. It fails with `RewardTimeout` (the functions overran the service's timeout_s, or
            the service did not answer within request_timeout_s), `RewardBadOutput` (a return value of the
            wrong type or length), or `RewardError` (a function raised, a worker died, the service is
            unreachable or answered an error, the group is not JSON-encodable, or the pool was closed);
            each carries a `reason` for counting and, where known, the `function`.

        Raises:
            ValueError: inconsistent lengths (a caller bug), raised here rather than in the future.
            RuntimeError: the pool is closed.
        """
        cols = check_group("RemoteRewardPool.submit", prompts, completions, completion_ids, columns)
        n = len(completions)
        payload = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(c) for c in completion_ids],
            "columns": cols,
            "trainer_state": dict(trainer_state) if trainer_state is not None else self._trainer_state,
        }
        out: Future = Future()
        out.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("RemoteRewardPool.submit: the pool is closed. Fix: create a new RemoteRewardPool.")
            self._pending.add(out)
            task = asyncio.run_coroutine_threadsafe(self._score(payload, n), self._loop)
        task.add_done_callback(functools.partial(self._settle, out))
        return out

    async def _score(self, payload: dict[str, Any], g: int) -> ScoredGroup:
        """POST one group (after a free slot); returns its `ScoredGroup` (`_parse`) or raises a RewardError."""
        async with self._slots:
            try:
                body = json.dumps(payload).encode()
            except (TypeError, ValueError) as err:
                raise RewardError(
                    f"the group cannot be sent to the reward service as JSON ({err}). Fix: keep dataset columns "
                    "to JSON types (str, numbers, bool, None, lists, dicts with str keys), or score in-process "
                    f"(unset reward_url and ${REWARD_URL_ENV})."
                ) from None
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    resp = await self._http.post(SCORE_PATH, content=body, headers={"content-type": "application/json"})
            except (TimeoutError, httpx.TimeoutException):
                raise RewardTimeout(
                    f"the reward service at {self.url} did not answer within {self.request_timeout_s:g} s "
                    f"(reward_timeout_s={self.timeout_s:g} s + margins). Fix: check the service's log and load; "
                    "raise reward_timeout_s, or add reward workers."
                ) from None
            except httpx.HTTPError as err:
                raise RewardError(
                    f"could not reach the reward service at {self.url}: {type(err).__name__}: {err}. {_URL_FIX}"
                ) from None
        return self._parse(resp, g)

    def _parse(self, resp: httpx.Response, g: int) -> ScoredGroup:
        """A score response -> its `ScoredGroup` ((G, F) floats, what the functions logged, their seconds on the
        service; `wire.decode_scored`); an error response -> the RewardError it describes (raised)."""
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code == 200 and isinstance(data, dict) and "rewards" in data:
            return decode_scored(data, g, len(self.names))
        err = error_from_body(data)
        if err is not None and resp.status_code != 422:
            raise err
        detail = data.get("message") if isinstance(data, dict) and data.get("message") else resp.text[:300]
        fix = (
            "Fix: run the same async-grpo version in the trainer and the reward image."
            if resp.status_code in (200, 404, 405, 422)
            else _URL_FIX
        )
        raise RewardError(f"the reward service at {self.url} answered HTTP {resp.status_code}: {detail}. {fix}")

    def _settle(self, out: Future, task: Future) -> None:
        """Copy the request's outcome onto `out`; anything but a RewardError becomes one."""
        with self._lock:
            self._pending.discard(out)
        error = CancelledError() if task.cancelled() else task.exception()  # task is done: never blocks
        try:
            if error is None:
                out.set_result(task.result())
            elif isinstance(error, RewardError):
                out.set_exception(error)
            elif isinstance(error, CancelledError):
                out.set_exception(RewardError("the reward pool was closed before this group was scored."))
            else:
                out.set_exception(RewardError(f"scoring on {self.url} failed: {type(error).__name__}: {error}"))
        except InvalidStateError:  # already failed by close()
            pass

    # -------------------------------------------------------------------------------------------- shutdown
    @property
    def closed(self) -> bool:
        """True once `close()` was called: `submit` then raises RuntimeError."""
        return self._closed

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Cancel in-flight requests, close the connections and stop the client thread; idempotent.

        Futures still pending fail with `RewardError` ("pool was closed"). The service keeps running.

        Args:
            timeout_s: seconds to wait for the client thread to finish.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending), set()
        for out in pending:
            try:
                out.set_exception(RewardError("the reward pool was closed before this group was scored."))
            except InvalidStateError:
                pass
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=timeout_s)
        except Exception as err:  # a timeout, or aclose failing: the daemon thread is abandoned below
            logger.warning("reward client did not shut down cleanly within %.1f s: %r", timeout_s, err)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> RemoteRewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reward_service_url(config: GRPOConfig, url: str | None = None) -> str | None:
    """The reward service to use: `url`, else `config.reward_url`, else env ASYNC_GRPO_REWARD_URL, else None."""
    return url or config.rewards.reward_url or os.environ.get(REWARD_URL_ENV) or None


def _health_status(resp: httpx.Response) -> str | None:
    """The "status" of a /health answer, or None when the body is not the service's JSON."""
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get("status") if isinstance(body, dict) else None


def make_reward_pool(
    config: GRPOConfig, url: str | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> RewardPool | RemoteRewardPool:
    """The run's reward scorer: a `RemoteRewardPool` when a reward service URL is known (see
    `reward_service_url`), else a local `RewardPool` of `reward_num_workers` spawned processes.

    The remote pool sends at most `reward_num_workers` groups at once (the service's worker count, as
    the kubernetes launcher starts it) and checks that the service serves this run's functions and weights.

    Raises:
        RewardSpecError: (local) a spec does not resolve.
        ValueError: (local) bad weights or worker count; (remote) the service serves other functions or weights.
        RewardError: (remote) the service was not ready within connect_timeout_s (seconds).
    """
    remote = reward_service_url(config, url)
    if remote is None:
        return RewardPool.from_config(config)
    names = [reward_func_name(s) for s in config.rewards.reward_funcs]
    weights = config.rewards.reward_weights if config.rewards.reward_weights is not None else [1.0] * len(names)
    logger.info("scoring rewards on the reward service at %s", remote)
    return RemoteRewardPool(
        remote,
        config.rewards.reward_timeout_s,
        config.rewards.reward_num_workers,
        expected_names=names,
        expected_weights=weights,
        connect_timeout_s=connect_timeout_s,
    )
