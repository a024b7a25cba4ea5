"""Run tool calls in spawned worker processes, each call under a timeout and resource limits.

As for reward functions (`rewards.pool`), the pool is pebble's: a call that overruns `timeout_s` gets its worker
killed and replaced, and a worker that dies (a crash, `os._exit`, the CPU-seconds limit's SIGXCPU, the memory
limit) costs that one call. Each worker caps its address space at `memory_mb` (`RLIMIT_AS`, set once when it
starts) and each call's CPU time at `cpu_seconds` (`RLIMIT_CPU`, re-armed before every call). A call never
raises: every failure becomes a `ToolOutcome` whose text the model reads as the tool's answer, and whose
`failure` kind the rollout counts; a tool may fail with a kind of its own by raising `tools.failures.ToolFailure`
(`builtin:python` does). Workers receive spec strings, not functions (user code is never pickled), and the
settings of `builtin:python`'s sandbox when they start. An `async def` tool is awaited in its worker, on an event
loop of the call's own (`asyncio.run`), under the same timeout and limits; the calls of one turn run at the same
time, one per worker (`tool_num_workers`), so tools that wait on I/O overlap.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import multiprocessing
import resource
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pebble import ProcessExpired, ProcessPool

from async_grpo.tools.failures import FAILURE_KINDS, MAX_ERROR_CHARS, ToolFailure
from async_grpo.tools.loading import Tool, resolve_tool
from async_grpo.tools.sandbox import SandboxSettings
from async_grpo.tools.sandbox import configure as configure_sandbox
from async_grpo.worker_warmup import warm_workers

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass
class ToolOutcome:
    """What one tool call produced.

    Attributes:
        content: the text the model sees as the tool's answer: the result, or `error: ...` on failure
            (untruncated; the rollout applies `max_tool_response_length`).
        failure: None on success, else one of FAILURE_KINDS: `malformed` (the call could not be parsed),
            `unknown_tool`, `bad_arguments` (not an object, or not matching the tool's JSON schema), `exception`
            (the tool raised), `timeout` (ran past `tool_timeout_s`; its worker was killed), `crashed` (its worker
            died, e.g. past `tool_cpu_seconds` or `tool_memory_mb`; for `builtin:python`, its program was killed by
            a signal or ran out of CPU time or memory), `output_limit` (`builtin:python` printed more than
            `python_tool_output_bytes`), `sandbox` (the `builtin:python` sandbox failed to start).
        seconds: wall-clock seconds of the call (0 for calls refused before running).
    """

    content: str
    failure: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the tool ran and returned."""
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        """The JSON form the tool route of the reward service answers with."""
        return {"content": self.content, "failure": self.failure, "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Any) -> ToolOutcome:
        """Inverse of `to_json`; raises ValueError on anything else."""
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("content"), str)
            and (data.get("failure") is None or data.get("failure") in FAILURE_KINDS)
            and isinstance(data.get("seconds"), (int, float))
        )
        if not ok:
            raise ValueError(f"not a tool outcome: {data!r:.200}")
        return cls(data["content"], data.get("failure"), float(data["seconds"]))


def failed(kind: str, message: str, seconds: float = 0.0) -> ToolOutcome:
    """A failed call's outcome: `error: <message>` (cut to MAX_ERROR_CHARS) and its kind."""
    return ToolOutcome(f"error: {message}"[:MAX_ERROR_CHARS], kind, seconds)


def check_arguments(tool: Tool, arguments: Any) -> str | None:
    """None when `arguments` fit the tool's JSON schema (an object with every required property, no unknown one,
    each of its declared JSON type), else what is wrong, in words the model can act on."""
    if not isinstance(arguments, Mapping):
        return f"the arguments of {tool.name} must be a JSON object, got {type(arguments).__name__}"
    params = tool.parameters
    props = params.get("properties") or {}
    missing = [k for k in params.get("required", []) if k not in arguments]
    unknown = [k for k in arguments if k not in props]
    if missing or unknown:
        return (
            f"{tool.name} takes {sorted(props)} (required {params.get('required', [])}); "
            f"missing {missing}, unknown {unknown}"
        )
    for key, value in arguments.items():
        declared = props[key].get("type")
        types = [declared] if isinstance(declared, str) else list(declared or [])
        allowed = tuple(t for name in types for t in _JSON_TYPES.get(name, (object,)))
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"argument {key!r} of {tool.name} must be {declared}, got {type(value).__name__}"
    return None


def precheck(tools: Mapping[str, Tool], name: str, arguments: Any, allowed: Sequence[str] | None) -> ToolOutcome | None:
    """The outcome of a call refused before it runs (`unknown_tool`: not declared or not offered to this prompt;
    `bad_arguments`: see `check_arguments`), or None when it may run."""
    tool = tools.get(name) if allowed is None or name in allowed else None
    if tool is None:
        offered = sorted(tools) if allowed is None else sorted(allowed)
        return failed("unknown_tool", f"there is no tool {name!r}; the tools are {offered}")
    problem = check_arguments(tool, arguments)
    return failed("bad_arguments", problem) if problem else None


@runtime_checkable
class ToolBackend(Protocol):
    """Where tool calls run: `ToolExecutor` (local worker processes) or `tools.remote.RemoteToolExecutor`."""

    tools: list[Tool]

    async def call(self, name: str, arguments: Any, *, allowed: Sequence[str] | None = None) -> ToolOutcome:
        """Run one call; never raises for a failing tool (see `ToolOutcome`)."""

    def close(self) -> None:
        """Stop the workers or connections."""


# ------------------------------------------------------------------ worker side (runs in spawned processes)
def _init_worker(memory_bytes: int | None, python_sandbox: SandboxSettings | None = None) -> None:
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    configure_sandbox(python_sandbox)


@functools.cache
def _worker_tool(spec: str) -> Any:
    return resolve_tool(spec)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _run_tool(spec: str, arguments: dict, cpu_seconds: float | None) -> tuple[str | None, str, bool]:
    """Worker entry point: (None, result text, False), (kind, message, False) for a `ToolFailure`, or
    ("exception", `<ExceptionType>: message`, True) for any other exception (True: say which tool raised)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if cpu_seconds:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_seconds)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    try:
        result = _worker_tool(spec)(**arguments)
        if inspect.iscoroutine(result):  # an `async def` tool: awaited on an event loop of this call's own
            result = asyncio.run(result)
        return None, _as_text(result), False
    except ToolFailure as err:
        return err.kind, err.message, False
    except Exception as err:
        return "exception", f"{type(err).__name__}: {err}", True
    finally:
        if cpu_seconds:
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


# ------------------------------------------------------------------ parent side
class ToolExecutor:
    """A pool of spawned tool workers (see the module docstring). Thread-safe; use `call` from async code.

    Args:
        tools: the declared tools (`tools.loading.load_tools`).
        num_workers: worker processes (`tool_num_workers`).
        timeout_s: per-call wall-clock limit in seconds (`tool_timeout_s`).
        cpu_seconds: per-call CPU-time limit in seconds (`tool_cpu_seconds`), None for none.
        memory_mb: per-worker address-space limit in MiB (`tool_memory_mb`), None for none.
        python_sandbox: the settings of `builtin:python` in the workers (`tools.sandbox.SandboxSettings`, from the
            `python_tool_*` fields); None: its defaults. Not checked here (see `tools.sandbox.check_sandbox`).

    Raises:
        ValueError: no tools, num_workers < 1, or a non-positive limit.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        cpu_seconds: float | None = 10.0,
        memory_mb: int | None = 1024,
        python_sandbox: SandboxSettings | None = None,
    ):
        if not tools:
            raise ValueError("ToolExecutor needs at least one tool. Fix: set tools: [builtin:calculator, ...].")
        if num_workers < 1:
            raise ValueError(f"tool_num_workers={num_workers} must be >= 1.")
        for name, value in (
            ("tool_timeout_s", timeout_s),
            ("tool_cpu_seconds", cpu_seconds),
            ("tool_memory_mb", memory_mb),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0. Fix: give a positive number.")
        self.tools = list(tools)
        self._by_name = {t.name: t for t in self.tools}
        self.timeout_s, self.cpu_seconds = float(timeout_s), cpu_seconds
        self._num_workers = num_workers
        memory = int(memory_mb * 2**20) if memory_mb else None
        self._pool = ProcessPool(
            max_workers=num_workers,
            context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(memory, python_sandbox),
        )
        self._lock = threading.Lock()
        self._closed = False

    def warm(self, timeout_s: float) -> int:
        """Start the workers and have each import the tools now, not on the first call
        (`worker_warmup.warm_workers`; the reward service calls this before it reports ready). Returns how many
        workers are warm (all of them, or fewer after `timeout_s` seconds or `close()`)."""
        specs = tuple(t.worker_spec for t in self.tools)
        return warm_workers(self._pool, _worker_tool, specs, self._num_workers, timeout_s, stopped=lambda: self._closed)

    @property
    def closed(self) -> bool:
        """True once `close()` was called (calls then fail as `crashed`)."""
        return self._closed

    def submit(self, name: str, arguments: Any, *, allowed: Sequence[str] | None = None) -> Future:
        """Start one call; the future resolves to a `ToolOutcome` and never fails.

        Args:
            name: the tool the model called.
            arguments: its arguments (a JSON object).
            allowed: the tool names this prompt offers (a dataset row's `tools` column); None offers all.
        """
        out: Future = Future()
        out.set_running_or_notify_cancel()
        refused = precheck(self._by_name, name, arguments, allowed)
        if refused is not None:
            out.set_result(refused)
            return out
        tool = self._by_name[name]
        with self._lock:
            if self._closed:
                out.set_result(failed("crashed", "the tool workers are shut down"))
                return out
            t0 = time.monotonic()
            task = self._pool.schedule(
                _run_tool, args=(tool.worker_spec, dict(arguments), self.cpu_seconds), timeout=self.timeout_s
            )
        task.add_done_callback(functools.partial(self._settle, out, name, t0))
        return out

    async def call(self, name: str, arguments: Any, *, allowed: Sequence[str] | None = None) -> ToolOutcome:
        """`submit` for async code."""
        return await asyncio.wrap_future(self.submit(name, arguments, allowed=allowed))

    def _settle(self, out: Future, name: str, t0: float, task: Future) -> None:
        seconds = time.monotonic() - t0
        error = CancelledError() if task.cancelled() else task.exception()
        if error is None:
            kind, text, raised = task.result()
            if kind is None:
                outcome = ToolOutcome(text, None, seconds)
            else:
                outcome = failed(kind, f"{name} raised {text}" if raised else text, seconds)
        elif isinstance(error, TimeoutError):
            outcome = failed("timeout", f"{name} did not finish within {self.timeout_s:g} s and was stopped", seconds)
        elif isinstance(error, ProcessExpired):
            why = " (CPU time limit)" if error.exitcode == -signal.SIGXCPU else ""
            outcome = failed("crashed", f"{name} crashed{why} (exit code {error.exitcode})", seconds)
        else:  # cancelled by close(), or unpicklable arguments
            outcome = failed("crashed", f"{name} could not run: {type(error).__name__}: {error}", seconds)
        try:
            out.set_result(outcome)
        except InvalidStateError:
            pass

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the workers (running calls are abandoned) and wait for them to exit; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.stop()
        try:
            self._pool.join(timeout_s)
        except TimeoutError:
            logger.warning("tool workers did not exit within %.1f s of close()", timeout_s)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
