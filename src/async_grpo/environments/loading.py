"""The `environment` spec -> an `Environment`, checked before anything starts.

A spec names a factory: `builtin:<name>` (`environments.builtin`), `pkg.module:factory` or
`path/to/file.py:factory`, or an adapter's: `openenv:<module or file spec>` (`environments.openenv_adapter`) and
`verifiers:<env-id or module or file spec>` (`environments.verifiers_adapter`). The factory is called with no
arguments and must return an object with `reset(row, state)` and `step(action, state)` (async or plain methods;
`base.Environment`). A class with a no-argument constructor is a factory. `check_reset` then opens one episode on a dataset row, so an environment that cannot
start is refused at preflight (before vLLM starts) with the field and the fix.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any

from async_grpo.environments.base import Environment, EnvironmentSpecError
from async_grpo.environments.calls import CallOutcome, EnvironmentCaller
from async_grpo.user_code import CodeSpec, check_adapter_spec, import_callable, parse_spec, split_adapter

WHAT = "environment spec"
FIELD = "`environment`"
_FORMS = (
    "builtin:<name>, pkg.module:factory, path/to/file.py:factory, openenv:pkg.module:factory or "
    "openenv:path/to/file.py:factory"
)
_METHODS = {"reset": ("row", "state"), "step": ("action", "state")}


def parse_environment_spec(spec: Any) -> CodeSpec:
    """`user_code.parse_spec` with this module's error type (imports nothing). For an adapter spec
    (`openenv:...`, `verifiers:...`) the part after the prefix is parsed; a verifiers environment id (no colon) parses
    as a module spec whose target is the id and whose name is "".

    Raises:
        EnvironmentSpecError: the spec is malformed.
    """
    adapter, inner = split_adapter(spec)
    if adapter is None:
        return parse_spec(spec, what=f"{FIELD}: {WHAT}", error=EnvironmentSpecError)
    check_adapter_spec(spec, error=EnvironmentSpecError)
    if ":" not in str(inner):  # verifiers:<env-id>
        return CodeSpec(str(inner), "module", str(inner), "")
    return parse_spec(inner, what=f"{FIELD}: {WHAT}", error=EnvironmentSpecError)


def resolve_factory(spec: str) -> Any:
    """The callable a spec names (the builtin class, or the module's / file's attribute), not yet called.

    Raises:
        EnvironmentSpecError: malformed spec, unknown builtin, missing file or module, import error, missing or
            non-callable attribute; the message names `environment` and the fix.
    """
    parsed = parse_environment_spec(spec)
    if split_adapter(spec)[0] is not None:
        spec = parsed.text  # an adapter's factory: resolved like a plain spec
    if parsed.kind == "builtin":
        from async_grpo.environments.builtin import BUILTIN_ENVIRONMENTS

        if parsed.name not in BUILTIN_ENVIRONMENTS:
            raise EnvironmentSpecError(
                f"{FIELD} {spec!r}: no builtin environment {parsed.name!r}. Fix: use one of "
                f"{['builtin:' + n for n in sorted(BUILTIN_ENVIRONMENTS)]}, or {_FORMS}."
            )
        return BUILTIN_ENVIRONMENTS[parsed.name]
    return import_callable(parsed, what=f"{FIELD}: {WHAT}", error=EnvironmentSpecError, prefix="_async_grpo_env",
                           returns="an environment")  # fmt: skip


def check_protocol(env: Any, spec: str) -> None:
    """Refuse an object that does not implement `base.Environment`: `reset(row, state)` and `step(action,
    state)`, callable with those two positional arguments.

    Raises:
        EnvironmentSpecError: a method is missing or its signature cannot take the two arguments.
    """
    for name, params in _METHODS.items():
        method = getattr(env, name, None)
        if not callable(method):
            raise EnvironmentSpecError(
                f"{FIELD} {spec!r}: the factory returned a {type(env).__name__} without a `{name}` method. Fix: "
                f"return an object with `async def reset(self, row, state)` and `async def step(self, action, "
                "state)`, each returning an Observation (see docs/environments.md)."
            )
        try:
            inspect.signature(method).bind(*params)
        except TypeError as err:
            raise EnvironmentSpecError(
                f"{FIELD} {spec!r}: {type(env).__name__}.{name} cannot be called as {name}({', '.join(params)}) "
                f"({err}). Fix: define it as `async def {name}(self, {', '.join(params)})`."
            ) from None
        except ValueError:  # no signature (a builtin callable): it is called and judged then
            pass


def load_environment(spec: str) -> Environment:
    """Resolve `spec`, call its factory with no arguments, check the result implements the protocol. An
    `openenv:` spec's factory is wrapped (`openenv_adapter.load_openenv`); a `verifiers:` spec's Env is built and
    wrapped (`verifiers_adapter.load_verifiers`).

    Raises:
        EnvironmentSpecError: see `resolve_factory` and `check_protocol`; the factory raising is one too; an
            adapter's refusals (each names the package or feature and the fix).
    """
    adapter, inner = split_adapter(spec)
    if adapter == "verifiers":
        from async_grpo.environments.verifiers_adapter import load_verifiers

        parse_environment_spec(spec)
        return load_verifiers(str(inner), spec)
    if adapter == "openenv":
        from async_grpo.environments.openenv_adapter import load_openenv

        return load_openenv(resolve_factory(spec), spec)
    factory = resolve_factory(spec)
    try:
        env = factory()
    except Exception as err:
        raise EnvironmentSpecError(
            f"{FIELD} {spec!r}: calling the factory with no arguments raised {err!r}. Fix: make it callable as "
            "factory() (bind settings with a module-level function or functools.partial)."
        ) from err
    check_protocol(env, spec)
    return env


def check_reset(env: Environment, spec: str, row: Mapping[str, Any], timeout_s: float) -> None:
    """Open one episode on `row` (a dataset row) under `timeout_s`, as a rollout would (`EnvironmentCaller`), then
    close `env` (a throwaway instance: the run loads its own).

    Raises:
        EnvironmentSpecError: reset raised, timed out or returned no valid Observation; names the row's columns.
    """
    caller = EnvironmentCaller(env, timeout_s=timeout_s, num_threads=1)

    async def reset_once() -> CallOutcome:
        state: dict[str, Any] = {}
        try:
            return await caller.reset(row, state)
        finally:
            await caller.close_episode(state)

    try:
        outcome = asyncio.run(reset_once())
    finally:
        caller.close()
    if outcome.failure is not None:
        raise EnvironmentSpecError(
            f"{FIELD} {spec!r}: reset failed on the dataset's first row (columns {sorted(row)}): "
            f"{outcome.failure}: {outcome.error}. Fix: make reset(row, state) accept the dataset's rows (or fix the "
            "dataset) and return an Observation within env_timeout_s."
        )
