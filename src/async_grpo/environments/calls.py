"""Calling an environment safely: async or sync, each call under a timeout, every failure a counted kind.

`EnvironmentCaller` wraps one `Environment`. A coroutine method is awaited under `asyncio.wait_for`; a plain
method runs in one of the caller's own worker threads (never the event loop's default executor, so a hung
environment cannot starve other work) and is awaited under the same timeout. A thread cannot be killed: a
synchronous call past its timeout is abandoned (its thread finishes in the background) and the sample ends with
`*_timeout`; an environment that hangs forever keeps one of `num_threads` threads per hung call. The result is
checked (`check_observation`) so a malformed answer ends the sample as `bad_observation` instead of failing later.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from async_grpo.environments.base import (
    OBSERVATION_ROLES,
    Environment,
    EnvironmentCallFailed,
    GroupDropped,
    Observation,
)

logger = logging.getLogger(__name__)
MAX_ERROR_CHARS = 300


@dataclass
class CallOutcome:
    """One environment call's result.

    Attributes:
        observation: the checked observation, or None when the call failed.
        failure: None on success, else one of `base.FAILURE_KINDS`.
        error: what went wrong (the exception or the problem, at most MAX_ERROR_CHARS), "" on success.
    """

    observation: Observation | None
    failure: str | None = None
    error: str = ""


def check_observation(obs: Any) -> str | None:
    """Why `obs` is not a valid `Observation` (None when it is): the type, `messages` a list of dicts with role
    user/tool and string content, `reward` None or a number
    (int or float, not bool), `done` a bool."""
    if not isinstance(obs, Observation):
        return f"returned {type(obs).__name__}, not an Observation"
    if not isinstance(obs.messages, list):
        return f"Observation.messages is a {type(obs.messages).__name__}, not a list"
    for m in obs.messages:
        if (
            not isinstance(m, Mapping)
            or m.get("role") not in OBSERVATION_ROLES
            or not isinstance(m.get("content"), str)
        ):
            return f"Observation.messages holds {m!r}; each must be {{'role': 'user' or 'tool', 'content': str}}"
    if obs.reward is not None and (isinstance(obs.reward, bool) or not isinstance(obs.reward, (int, float))):
        return f"Observation.reward is {obs.reward!r}, not a number or None"
    if not isinstance(obs.done, bool):
        return f"Observation.done is {obs.done!r}, not a bool"
    return None


class EnvironmentCaller:
    """Calls one environment's `reset` and `step` under a timeout (see the module docstring).

    Args:
        env: the environment (async or sync methods).
        timeout_s: wall-clock limit of one call (seconds); None: no limit here, for an environment that bounds its
            own calls (`environments.tools.ToolEnvironment`: each tool call under `tool_timeout_s` in its workers).
        num_threads: worker threads for a synchronous environment's calls.
    """

    def __init__(self, env: Environment, *, timeout_s: float | None, num_threads: int = 4):
        self.env, self.timeout_s = env, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="async-grpo-env")

    async def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> CallOutcome:
        """`env.reset(row, state)`; failures are `reset_exception`, `reset_timeout`, `bad_observation`."""
        return await self._call("reset", self.env.reset, dict(row), state)

    async def step(self, action: str, state: dict[str, Any]) -> CallOutcome:
        """`env.step(action, state)`; failures are `step_exception`, `step_timeout`, `bad_observation`."""
        return await self._call("step", self.env.step, action, state)

    async def close_episode(self, state: dict[str, Any]) -> None:
        """`env.close_episode(state)` when the environment has one (`Environment.close_episode`), under the
        timeout; it never fails the sample: an error or a timeout is logged (closing is best effort)."""
        method = getattr(self.env, "close_episode", None)
        if not callable(method):
            return
        try:
            if inspect.iscoroutinefunction(method):
                await asyncio.wait_for(method(state), self.timeout_s)
            else:
                future = asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(method, state))
                await asyncio.wait_for(future, self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # TimeoutError included: the episode is over either way
            logger.warning("the environment's close_episode raised", exc_info=True)

    async def _call(self, name: str, method: Any, *args: Any) -> CallOutcome:
        try:
            if inspect.iscoroutinefunction(method):
                obs = await asyncio.wait_for(method(*args), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._pool, functools.partial(method, *args))
                obs = await asyncio.wait_for(future, self.timeout_s)
                if inspect.isawaitable(obs):  # a plain def returning a coroutine: await it on the loop
                    obs = await asyncio.wait_for(obs, self.timeout_s)
        except TimeoutError:
            return CallOutcome(None, f"{name}_timeout", f"{name} ran past env_timeout_s={self.timeout_s:g}")
        except (asyncio.CancelledError, GroupDropped):
            raise  # cancelled, or the environment drops the whole group (a shared service failed)
        except EnvironmentCallFailed as err:  # a wrapped environment's failure, counted as its own kind
            return CallOutcome(None, err.kind, err.error[:MAX_ERROR_CHARS])
        except Exception as err:  # the environment's own bug: this sample ends, the run goes on
            logger.debug("environment %s raised", name, exc_info=True)
            return CallOutcome(None, f"{name}_exception", f"{name} raised {err!r}"[:MAX_ERROR_CHARS])
        problem = check_observation(obs)
        if problem is not None:
            return CallOutcome(None, "bad_observation", f"{name} {problem}"[:MAX_ERROR_CHARS])
        return CallOutcome(obs)

    def close(self) -> None:
        """Stop the worker threads (a hung synchronous call is abandoned, not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # closing is best effort: the run is ending
                logger.warning("the environment's close() raised", exc_info=True)
