"""Running one episode of the user's agent: a function or a command, under a time-out, every fault a counted kind.

`FunctionAgent` calls `fn(row, base_url=..., api_key=...)`: an `async def` on the rollout's loop, a plain `def` in
one of its own worker threads (never the loop's default executor). `CommandAgent` runs an argv list (no shell) as a
subprocess in its own session (process group), with `OPENAI_BASE_URL` and `OPENAI_API_KEY` in an environment that
holds nothing else of this process's (`agents.loading.agent_environment`: no credential reaches it), the row as one
JSON line on stdin; its last stdout line, when it parses as a JSON number or null, is its return value.

Either way the episode's return value is its reward (or None), and what goes wrong is an `AgentOutcome.fault`:

    exception    the function raised, or the command exited non-zero (or could not start)
    timeout      the episode ran past agent_timeout_s: the coroutine is cancelled, the command's process group
                 killed (SIGKILL, by the PID this module started), a thread abandoned (its key is revoked, so
                 its next model call gets 401)
    bad_return   the return value is not a number or None (a bool, NaN, a string, ...): the reward is None

The rollout adds the kinds it sees on the endpoint (`no_call`, `max_turns`; `agents.rollout`). The tail of what the
agent wrote (a command's stdout and stderr, a function's exception) is kept for the completions table.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from async_grpo.agents.loading import agent_environment

LOG_TAIL_CHARS = 2000  # characters of an agent's output (or exception) kept for the completions table
READ_CHUNK_BYTES = 65536
KILL_WAIT_S = 5.0  # most seconds to wait for a killed command to be reaped
FUNCTION_THREADS = 256  # most plain-function episodes running at once (threads are made as episodes need them)


@dataclass
class AgentOutcome:
    """How one episode of the agent ended.

    Attributes:
        value: its return value as the episode's reward (a finite float), or None (none, or a fault).
        fault: None, or one of "exception", "timeout", "bad_return" (module docstring).
        log: the tail (at most LOG_TAIL_CHARS) of a command's stdout and stderr, or a function's exception.
        seconds: wall-clock seconds the episode ran.
    """

    value: float | None
    fault: str | None = None
    log: str = ""
    seconds: float = 0.0


class AgentRunner(Protocol):
    """Runs one episode of the agent (`FunctionAgent`, `CommandAgent`)."""

    async def run(self, row: Mapping[str, Any], base_url: str, api_key: str, timeout_s: float) -> AgentOutcome:
        """Run the agent on `row` against `base_url` with `api_key`, at most `timeout_s` seconds; never raises but
        for cancellation."""
        ...

    def close(self) -> None:
        """Release what the runner holds (worker threads)."""
        ...


def return_value(value: Any) -> tuple[float | None, str | None]:
    """(reward, fault) from an agent's return value: a finite int or float -> (float, None), None -> (None, None),
    anything else (a bool, NaN or infinity, a string, a dict) -> (None, "bad_return")."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, "bad_return"
    return float(value), None


def _tail(text: str) -> str:
    return text[-LOG_TAIL_CHARS:]


class FunctionAgent:
    """An agent that is a Python function (see the module docstring).

    Args:
        fn: `fn(row, base_url=..., api_key=...)`, async or plain (`agents.loading.load_agent` checked it).
        num_threads: worker threads for a plain function's episodes (episodes beyond wait for a thread, inside
            their time-out); FUNCTION_THREADS by default.
    """

    def __init__(self, fn: Callable[..., Any], num_threads: int = FUNCTION_THREADS):
        self.fn = fn
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="async-grpo-agent")

    async def run(self, row: Mapping[str, Any], base_url: str, api_key: str, timeout_s: float) -> AgentOutcome:
        """See `AgentRunner.run`."""
        start = time.monotonic()
        call = functools.partial(self.fn, dict(row), base_url=base_url, api_key=api_key)
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = await asyncio.wait_for(call(), timeout_s)
            else:
                value = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, call), timeout_s)
                if inspect.isawaitable(value):  # a plain def returning a coroutine: await it on the loop
                    value = await asyncio.wait_for(value, max(timeout_s - (time.monotonic() - start), 0.0))
        except TimeoutError:
            return AgentOutcome(None, "timeout", f"ran past agent_timeout_s={timeout_s:g}", time.monotonic() - start)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the agent's own bug: this episode ends, the run goes on
            log = _tail("".join(traceback.format_exception(err)))
            return AgentOutcome(None, "exception", log, time.monotonic() - start)
        reward, fault = return_value(value)
        log = "" if fault is None else f"returned {value!r}; an agent returns a number or None"[:LOG_TAIL_CHARS]
        return AgentOutcome(reward, fault, log, time.monotonic() - start)

    def close(self) -> None:
        """Stop the worker threads (a hung episode's thread is abandoned, not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class CommandAgent:
    """An agent that is a command (see the module docstring).

    Args:
        argv: the program and its arguments (`agents.loading.check_agent_command` checked the program).
        cwd: the working directory (None: this process's).
    """

    def __init__(self, argv: Sequence[str], cwd: str | None = None):
        self.argv, self.cwd = list(argv), cwd

    async def run(self, row: Mapping[str, Any], base_url: str, api_key: str, timeout_s: float) -> AgentOutcome:
        """See `AgentRunner.run`."""
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=agent_environment(base_url, api_key), cwd=self.cwd,
                start_new_session=True,
            )  # fmt: skip
        except OSError as err:
            return AgentOutcome(None, "exception", f"could not start {self.argv[0]!r}: {err}", 0.0)
        stdout, stderr = bytearray(), bytearray()
        try:
            await asyncio.wait_for(self._talk(proc, row, stdout, stderr), timeout_s)
        except TimeoutError:
            await _kill(proc)
            log = _tail(_decode(stdout) + _decode(stderr) + f"\n[ran past agent_timeout_s={timeout_s:g}]")
            return AgentOutcome(None, "timeout", log, time.monotonic() - start)
        except BaseException:
            await _kill(proc)
            raise
        await _kill(proc)  # the agent's own children, if it left any running
        out, err = _decode(stdout), _decode(stderr)
        log = _tail(out + ("\n" if out and err else "") + err)
        if proc.returncode != 0:
            return AgentOutcome(
                None, "exception", _tail(f"{log}\n[exit code {proc.returncode}]"), time.monotonic() - start
            )
        lines = [line for line in out.splitlines() if line.strip()]
        try:
            value = json.loads(lines[-1]) if lines else None
        except ValueError:
            value = None  # prose output: no return value
        reward, fault = return_value(value if not isinstance(value, (list, dict, str)) else None)
        return AgentOutcome(reward, fault, log, time.monotonic() - start)

    @staticmethod
    async def _talk(proc: asyncio.subprocess.Process, row: Mapping[str, Any], stdout: bytearray,
                    stderr: bytearray) -> None:  # fmt: skip
        """Write the row, read both streams to EOF keeping their tails, and wait for the exit."""

        async def drain(stream: asyncio.StreamReader | None, sink: bytearray) -> None:
            while stream is not None and (chunk := await stream.read(READ_CHUNK_BYTES)):
                sink.extend(chunk)
                del sink[: max(len(sink) - 4 * LOG_TAIL_CHARS, 0)]

        async def feed() -> None:
            if proc.stdin is None:
                return
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write((json.dumps(dict(row), default=str) + "\n").encode())
                await proc.stdin.drain()
                proc.stdin.close()

        await asyncio.gather(feed(), drain(proc.stdout, stdout), drain(proc.stderr, stderr))
        await proc.wait()

    def close(self) -> None:
        """Nothing held between episodes (each episode's process is ended by `run`)."""


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """End the command's process group (it was started in its own session, so its PID is the group's id: Linux does
    not reuse a PID while a group carries it), children it left included, then reap it, waiting at most KILL_WAIT_S."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
