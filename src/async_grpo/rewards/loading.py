"""Turn a reward-function spec string into the callable it names.

Specs are plain strings (`builtin:<name>`, `pkg.module:function`, `path/to/file.py:function`) so that a
config stays YAML and each reward worker process can resolve its own copy without pickling user code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from async_grpo.modules import load_module_file

BUILTIN_PREFIX = "builtin:"
_FORMS = "`builtin:<name>`, `pkg.module:function` or `path/to/file.py:function`"


class RewardSpecError(ValueError):
    """A reward-function spec is malformed or does not resolve; the message names the spec and the fix."""


def _split(spec: Any) -> tuple[str, str]:
    if not isinstance(spec, str) or ":" not in spec:
        hint = f" Did you mean 'builtin:{spec}'?" if isinstance(spec, str) and spec.isidentifier() else ""
        raise RewardSpecError(f"reward function spec {spec!r} is not one of {_FORMS}.{hint}")
    target, name = spec.rsplit(":", 1)
    if not target or not name.isidentifier():
        raise RewardSpecError(
            f"reward function spec {spec!r}: {name!r} is not a function name. "
            f"Fix: write it as {_FORMS}."
        )
    return target, name


def reward_func_name(spec: str) -> str:
    """The function name a spec refers to (used in metric names `rewards/<name>/mean`); does not import.

    Raises:
        RewardSpecError: the spec is malformed.
    """
    return _split(spec)[1]


def resolve_reward_func(spec: str) -> Callable[..., Any]:
    """Import and return the reward function named by `spec`.

    Forms: `builtin:<name>` (a builtin task's reward, see `async_grpo.tasks.builtin_reward_funcs`),
    `pkg.module:function` (imported with importlib), `path/to/file.py:function` (loaded from that file,
    relative paths against the working directory; the same file always maps to the same module).

    Returns:
        The callable, with TRL's reward signature f(prompts, completions, completion_ids, **columns).

    Raises:
        RewardSpecError: malformed spec, unknown builtin, missing file or module, missing attribute,
            or an attribute that is not callable; the message names the spec and the fix.
    """
    target, name = _split(spec)
    if target == "builtin":
        from async_grpo.tasks import builtin_reward_funcs

        funcs = builtin_reward_funcs()
        if name not in funcs:
            raise RewardSpecError(
                f"reward function spec {spec!r}: no builtin reward {name!r}. "
                f"Fix: use one of {[BUILTIN_PREFIX + n for n in sorted(funcs)]}."
            )
        return funcs[name]
    module = _load_file(spec, target) if target.endswith(".py") else _import_module(spec, target)
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardSpecError(
            f"reward function spec {spec!r}: {target} has no attribute {name!r}. "
            f"Fix: use one of its callables {public}."
        )
    func = getattr(module, name)
    if not callable(func):
        raise RewardSpecError(
            f"reward function spec {spec!r}: {name!r} is a {type(func).__name__}, not a function. "
            f"Fix: point at a function f(prompts, completions, completion_ids, **kwargs)."
        )
    return func


def _import_module(spec: str, module_name: str) -> Any:
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise RewardSpecError(
            f"reward function spec {spec!r}: {module_name!r} is neither a module name nor a .py file. "
            f"Fix: write it as {_FORMS}."
        )
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RewardSpecError(
            f"reward function spec {spec!r}: cannot import {module_name!r} ({err}). "
            f"Fix: install the package or put it on PYTHONPATH, or use path/to/file.py:function."
        ) from err
    except Exception as err:  # the module itself is broken (SyntaxError, an error at import time)
        raise RewardSpecError(f"reward function spec {spec!r}: importing {module_name!r} failed: {err!r}") from err


def _load_file(spec: str, file_name: str) -> Any:
    return load_module_file(file_name, prefix="_async_grpo_reward", what=f"reward function spec {spec!r}",
                            error=RewardSpecError)
