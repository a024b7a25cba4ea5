"""Score completion groups with user reward functions in spawned worker processes, each call under a timeout.

The process pool is pebble's, because it kills a worker whose task overruns and starts a fresh one, so a
hung or crashing reward function costs one group, never the run. Workers receive spec strings, not
functions, and resolve them once per process, so user code is never pickled and may hold unpicklable state.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import numbers
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, NamedTuple

from pebble import ProcessExpired, ProcessPool

from async_grpo.rewards.contract import RewardLog, RewardTrainerState, bound_kwargs, call_reward
from async_grpo.rewards.loading import RewardSpecError, absolute_reward_spec, resolve_reward_func, reward_func_name
from async_grpo.transports.scorer import RewardBadOutput, RewardError, RewardTimeout, ScoredGroup
from async_grpo.worker_warmup import warm_workers

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
WATCHDOG_INTERVAL_S = 0.5  # how often the pool checks that pebble's pool is not broken (seconds)
STALL_GRACE_S = 60.0  # no group settled for reward_timeout_s + this while groups wait: the pool is stuck (seconds)
_TRACEBACK_LINES = 12  # tail of the reward function's traceback kept in the error message


def check_group(
    caller: str,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]] | None,
) -> dict[str, list]:
    """Check that one group's arguments all hold G >= 1 entries; returns `columns` as lists.

    Raises:
        ValueError: G == 0 or a length differs (names `caller` and the offending arguments).
    """
    n = len(completions)
    cols = {k: list(v) for k, v in (columns or {}).items()}
    lengths = {
        "prompts": len(prompts),
        "completion_ids": len(completion_ids),
        **{f"columns[{k!r}]": len(v) for k, v in cols.items()},
    }
    bad = {k: v for k, v in lengths.items() if v != n}
    if n == 0 or bad:
        raise ValueError(f"{caller}: {n} completions but lengths {bad}. Fix: pass G >= 1 of everything.")
    return cols


# ------------------------------------------------------------------ worker side (runs in spawned processes)
@functools.cache
def _worker_func(spec: str) -> Any:
    return resolve_reward_func(spec)


def _check_output(name: str, out: Any, n: int) -> list[float]:
    """Validate one function's return value; None and NaN become NaN. Raises RewardBadOutput."""
    fix = f"Fix: make {name} return a list of {n} floats (or None to abstain), one per completion."
    if not isinstance(out, (list, tuple)):
        raise RewardBadOutput(f"reward function {name!r} returned a {type(out).__name__}, not a list. {fix}", name)
    if len(out) != n:
        raise RewardBadOutput(f"reward function {name!r} returned {len(out)} values for {n} completions. {fix}", name)
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
        elif isinstance(v, numbers.Real):
            x = float(v)
            if math.isinf(x):
                raise RewardBadOutput(f"reward function {name!r} returned {x} at index {i}. {fix}", name)
            values.append(x)
        else:
            raise RewardBadOutput(
                f"reward function {name!r} returned a {type(v).__name__} ({v!r:.60}) at index {i}. {fix}", name
            )
    return values


def _call(
    spec: str,
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict[str, list],
    state: RewardTrainerState,
    log: RewardLog,
    bound: dict[str, Any],
) -> list[float]:
    name = reward_func_name(spec)
    try:
        func = _worker_func(spec)
    except RewardSpecError as err:
        raise RewardError(f"reward worker could not resolve {spec!r}: {err}", name) from None
    try:  # TRL's call: columns, trainer_state, log_extra, log_metric; `async def` runs to completion
        out = call_reward(
            func, prompts, completions, completion_ids, columns, trainer_state=state, log=log, bound=bound
        )
    except Exception as err:
        tb = "".join(traceback.format_exc().splitlines(keepends=True)[-_TRACEBACK_LINES:])
        raise RewardError(
            f"reward function {name!r} ({spec}) raised {type(err).__name__}: {err}. "
            f"Fix: make it handle every completion (return None to abstain).\n{tb}",
            name,
        ) from None
    return _check_output(name, out, len(completions))


def _score_group(
    specs: tuple[str, ...],
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict[str, list],
    trainer_state: dict[str, int] | None = None,
    bound: dict[str, dict[str, Any]] | None = None,
) -> ScoredGroup:
    """Worker entry point: run every reward function on one group, one after another; returns (G, F) floats, NaN
    for None, with what the functions logged and each function's wall-clock seconds (`ScoredGroup.seconds`, keyed
    by function name, measured here in the worker)."""
    state, log = RewardTrainerState(**(trainer_state or {})), RewardLog()
    per_func: list[list[float]] = []
    seconds: dict[str, float] = {}
    for spec in specs:
        start = time.perf_counter()
        per_func.append(
            _call(spec, prompts, completions, completion_ids, columns, state, log, (bound or {}).get(spec, {}))
        )
        seconds[reward_func_name(spec)] = time.perf_counter() - start
    return ScoredGroup([list(row) for row in zip(*per_func, strict=True)], log.extra, log.metrics, seconds)


# ------------------------------------------------------------------ parent side
def _absolute_spec(spec: str) -> str:
    """File specs and model folders get an absolute path, so workers resolve them whatever their working directory."""
    return absolute_reward_spec(spec)


class _Retired(NamedTuple):
    """A broken pebble pool taken out of service, and the groups it held (each still to fail)."""

    pool: ProcessPool
    orphans: list[Future]


class RewardPool:
    """A pool of spawned reward workers that scores one group of G completions per `submit`.

    Use as a context manager, or call `close()`. Thread-safe: `submit` may be called from any thread
    (wrap the returned future with `asyncio.wrap_future` in async code).

    Attributes:
        specs: the reward-function specs as given.
        names: each function's name, for metric names `rewards/<name>/mean`.
        weights: one weight per function (all 1.0 when none were given); applying them is the caller's job.
        timeout_s: per-group time limit (seconds) covering all functions together.
    """

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] | None = None,
        num_workers: int = 2,
        timeout_s: float = 30.0,
        bound_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        stall_grace_s: float = STALL_GRACE_S,
    ):
        """Validate the specs in this process (importing each once), then create the pool.

        Worker processes start on the first `submit`. `bound_kwargs` maps a spec to keyword arguments bound on
        every call of that function (`contract.bound_kwargs`: the run's parameters of configurable builtins).
        `stall_grace_s` (seconds): the pool counts as stuck, and is replaced, when groups wait and none has settled
        for `timeout_s` + this long (`_stuck`); it must cover a fresh worker's start-up (spawn and imports).

        Raises:
            RewardSpecError: a spec does not resolve (names the spec and the fix).
            ValueError: empty specs, duplicate function names, weights of the wrong length or not
                finite, num_workers < 1, timeout_s <= 0 or stall_grace_s < 0.
        """
        if isinstance(specs, str) or not specs:
            raise ValueError(
                f"reward_funcs={specs!r} must be a non-empty list of specs. Fix: e.g. ['builtin:reverse_exact_match']."
            )
        self.specs = list(specs)
        for spec in self.specs:
            resolve_reward_func(spec)  # fail here, not in a worker, on typos
        self.names = [reward_func_name(s) for s in self.specs]
        duplicates = sorted({n for n in self.names if self.names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"reward_funcs has several functions named {duplicates}; their metrics would collide. "
                f"Fix: give each reward function a distinct name."
            )
        self.weights = [1.0] * len(self.specs) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.specs):
            raise ValueError(
                f"reward_weights has {len(self.weights)} entries but reward_funcs has {len(self.specs)}. "
                f"Fix: give one weight per reward function."
            )
        if not all(math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward_weights={self.weights} must be finite numbers. Fix: remove inf/nan weights.")
        if num_workers < 1:
            raise ValueError(f"reward_num_workers={num_workers} must be >= 1. Fix: use at least 1 worker.")
        if not timeout_s > 0:
            raise ValueError(f"reward_timeout_s={timeout_s} must be > 0. Fix: give a positive number of seconds.")
        if not stall_grace_s >= 0:
            raise ValueError(f"stall_grace_s={stall_grace_s} must be >= 0 seconds. Fix: e.g. {STALL_GRACE_S}.")
        self.timeout_s = float(timeout_s)
        self.stall_grace_s = float(stall_grace_s)
        self._worker_specs = tuple(_absolute_spec(s) for s in self.specs)
        self._bound = {_absolute_spec(k): dict(v) for k, v in (bound_kwargs or {}).items()}
        self._trainer_state = RewardTrainerState()
        self._num_workers = num_workers
        self._pool = self._new_pool()
        self._generation = 0  # the pool's number: +1 at each replacement of a broken one
        self.restarts = 0  # broken pools replaced (`_usable_pool`)
        self._lock = threading.Lock()
        self._pending: dict[Future, int] = {}  # a group's future -> the generation of the pool scoring it
        self._last_progress = time.monotonic()  # when a group last settled (or the first waiting one came)
        self._retiring: list[threading.Thread] = []  # broken pools being stopped (`_retire`)
        self._closed = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None  # started with the workers, at the first submit

    def warm(self, timeout_s: float) -> int:
        """Start the workers and have each import the reward functions now, not on the first group
        (`worker_warmup.warm_workers`): the reward service calls this before it reports ready, since a request's
        time limit there includes the wait for a free worker. Returns how many workers are warm (num_workers, or
        fewer after `timeout_s` seconds or `close()`)."""
        with self._lock:
            if self._closed:
                return 0
            pool = self._pool
        return warm_workers(
            pool, _worker_func, self._worker_specs, self._num_workers, timeout_s, stopped=self._stop.is_set
        )

    def _new_pool(self) -> ProcessPool:
        return ProcessPool(max_workers=self._num_workers, context=multiprocessing.get_context("spawn"))

    def _usable_pool(self, stuck: bool = False) -> tuple[ProcessPool, _Retired | None]:
        """The pebble pool, swapped for a fresh one when it is broken (call with the lock held), and the broken pool
        to retire (`_retire`) once the lock is released, or None.

        pebble gives up on the whole pool when a worker dies while it runs no task (killed by the OOM killer or
        `kill -9` while idle: pebble cannot tell which task it was taking, `BrokenProcessPool`): every later
        `schedule` raises, and a group scheduled as it broke may never settle (its timeout was the dead pool's
        to enforce). Here a new pool is started, and the groups the broken one held are taken off `_pending`; the
        caller then stops the broken pool and fails those groups with RewardError (each dropped and counted as
        reward_error), so one lost worker costs those groups, never the run.

        The broken pool is never stopped with the lock held: pebble marks a pool broken (`active` False) and then,
        in its own loop thread, fails every task it held (`handle_broken_pool` -> `tasks_abort`), whose callbacks
        (`_settle`) take the lock; `join` waits for that thread. Stopping the pool under the lock in that window
        deadlocked the pool and stalled the run (the chaos soak's reward_worker_kill9 in CI, with many groups
        queued just after a trainer restart: no step for 300 s).
        """
        if self._pool.active and not stuck:
            return self._pool, None
        self.restarts += 1
        self._generation += 1
        self._last_progress = time.monotonic()
        logger.warning(
            "the reward worker pool %s; starting a new one (restart %d)",
            "is stuck (no group settled)" if stuck else "broke (a worker died outside a task)",
            self.restarts,
        )
        broken, self._pool = self._pool, self._new_pool()
        orphans = [f for f, generation in self._pending.items() if generation < self._generation]
        for out in orphans:
            del self._pending[out]
        return self._pool, _Retired(broken, orphans)

    def _retire(self, retired: _Retired) -> None:
        """Stop a broken pool and fail the groups it held, in a thread of its own (call without the lock): pebble's
        join can take minutes when the pool broke mid-transfer, and neither `submit` nor the watchdog may wait on
        it. `close` joins these threads."""
        thread = threading.Thread(target=self._stop_retired, args=(retired,), name="reward-pool-retire", daemon=True)
        with self._lock:  # submit and the watchdog may both retire a pool
            self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]
        thread.start()

    @staticmethod
    def _stop_retired(retired: _Retired) -> None:
        retired.pool.stop()
        try:
            retired.pool.join(CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the broken reward pool's workers did not exit within %.1f s", CLOSE_TIMEOUT_S)
        for out in retired.orphans:
            try:
                out.set_exception(
                    RewardError("a reward worker died and its pool was replaced before this group was scored.")
                )
            except InvalidStateError:  # settled meanwhile
                pass

    def _watch(self) -> None:
        """The watchdog thread: every WATCHDOG_INTERVAL_S seconds, replace a broken pool (`_usable_pool`) even when
        no new group comes to notice it; ends with `close()`."""
        while not self._stop.wait(WATCHDOG_INTERVAL_S):
            with self._lock:
                if self._closed:
                    return
                _, retired = self._usable_pool(stuck=self._stuck())
            if retired is not None:
                self._retire(retired)

    def _stuck(self) -> bool:
        """True when groups wait and none has settled for reward_timeout_s + stall_grace_s seconds (call with the
        lock held). pebble kills a task that runs past its timeout, so a pool that makes no progress that long is
        not slow but stuck: a worker SIGKILLed while holding pebble's channel lock leaves the others unable to take
        tasks, and the queued groups would never start (nor time out, which only started tasks do)."""
        return bool(self._pending) and time.monotonic() - self._last_progress > self.timeout_s + self.stall_grace_s

    @classmethod
    def from_config(cls, config: Any, num_workers: int | None = None) -> RewardPool:
        """The pool of a run's `GRPOConfig`: its reward functions, weights, workers (or `num_workers`), timeout and
        bound builtin parameters."""
        r = config.rewards
        return cls(
            r.reward_funcs,
            r.reward_weights,
            r.reward_num_workers if num_workers is None else num_workers,
            r.reward_timeout_s,
            bound_kwargs=bound_kwargs(config),
        )

    def set_trainer_state(self, **fields: int) -> None:
        """Update the `trainer_state` later groups' reward functions receive (e.g. global_step after each step)."""
        self._trainer_state = RewardTrainerState(**{**self._trainer_state.to_dict(), **fields})

    @property
    def closed(self) -> bool:
        """True once `close()` was called: `submit` then raises RuntimeError."""
        return self._closed

    def submit(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: Mapping[str, Sequence[Any]] | None = None,
        trainer_state: Mapping[str, int] | None = None,
    ) -> Future:
        """Score one group of G completions with every reward function, in a worker process.

        Args:
            prompts: G prompts (the group's prompt repeated, as TRL passes it).
            completions: G completions (strings, or message lists for conversational prompts).
            completion_ids: G lists of completion token ids.
            columns: the dataset's other columns, each a list of G values, passed as keyword arguments.
            trainer_state: the `trainer_state` fields for this group; None: the pool's (`set_trainer_state`).

        Returns:
            A Future resolving to a (G, F) `transports.scorer.ScoredGroup` (rows of floats, F = len(specs) in
            spec order, NaN where a function returned None, with what the functions logged and each function's
            seconds). It fails with `RewardTimeout` (the set overran timeout_s),
            `RewardBadOutput` (a return value of the wrong type or length) or `RewardError` (a function
            raised, a worker died, or the pool was closed); each carries a `reason` for counting.

        Raises:
            ValueError: inconsistent lengths (a caller bug), raised here rather than in the future.
            RuntimeError: the pool is closed.
        """
        columns = check_group("RewardPool.submit", prompts, completions, completion_ids, columns)
        out: Future = Future()
        out.set_running_or_notify_cancel()
        retired: _Retired | None = None
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("RewardPool.submit: the pool is closed. Fix: create a new RewardPool.")
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, name="reward-pool-watchdog", daemon=True)
                    self._watchdog.start()
                if not self._pending:  # the wait for progress starts with the first waiting group
                    self._last_progress = time.monotonic()
                pool, retired = self._usable_pool()
                task = pool.schedule(
                    _score_group,
                    args=(
                        self._worker_specs,
                        list(prompts),
                        list(completions),
                        [list(c) for c in completion_ids],
                        columns,
                        dict(trainer_state) if trainer_state is not None else self._trainer_state.to_dict(),
                        self._bound,
                    ),
                    timeout=self.timeout_s,
                )
                self._pending[out] = self._generation
        finally:
            if retired is not None:  # outside the lock (`_usable_pool`)
                self._retire(retired)
        task.add_done_callback(functools.partial(self._settle, out))
        return out

    def _settle(self, out: Future, task: Future) -> None:
        """Copy the pebble task's outcome onto `out`, translating failures into RewardError types."""
        with self._lock:
            self._pending.pop(out, None)
            self._last_progress = time.monotonic()
        error = CancelledError() if task.cancelled() else task.exception()  # task is done: never blocks
        try:
            if error is None:
                out.set_result(task.result())
            else:
                out.set_exception(self._as_reward_error(error))
        except InvalidStateError:  # already failed by close()
            pass

    def _as_reward_error(self, err: BaseException) -> RewardError:
        if self._closed:  # pebble fails the tasks it abandons on stop()
            return RewardError(f"the reward pool was closed before this group was scored ({type(err).__name__}).")
        if isinstance(err, RewardError):
            return err
        if isinstance(err, TimeoutError):
            return RewardTimeout(
                f"reward functions {self.names} did not finish within reward_timeout_s={self.timeout_s:g} s; "
                f"the worker was killed. Fix: make them faster, or raise reward_timeout_s."
            )
        if isinstance(err, ProcessExpired):
            return RewardError(
                f"a reward worker died (exit code {err.exitcode}) while running {self.names}. "
                f"Fix: check the functions for crashes or excessive memory use."
            )
        if isinstance(err, CancelledError):
            return RewardError("the group was cancelled before it was scored.")
        # e.g. unpicklable arguments or results
        return RewardError(f"scoring with {self.names} failed: {type(err).__name__}: {err}")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the workers (running tasks are abandoned) and wait for them to exit; idempotent.

        Futures still pending fail with `RewardError` ("pool was closed").

        Args:
            timeout_s: seconds to wait for the workers to exit.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending), {}
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout_s)
        self._pool.stop()
        try:
            self._pool.join(timeout_s)
        except TimeoutError:
            logger.warning("reward workers did not exit within %.1f s of close()", timeout_s)
        with self._lock:
            retiring = list(self._retiring)
        for thread in retiring:
            thread.join(timeout_s)
        for out in pending:
            try:
                out.set_exception(RewardError("the reward pool was closed before this group was scored."))
            except InvalidStateError:
                pass

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
