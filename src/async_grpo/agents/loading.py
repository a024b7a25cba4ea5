"""The `agent` and `agent_command` fields -> what runs an episode, checked before anything starts.

`agent` names a function (`pkg.module:function` or `path/to/file.py:function`, `user_code`'s forms without
`builtin:` or an adapter prefix): `load_agent` imports it and checks that it can be called as
`fn(row, base_url=..., api_key=...)`. `agent_command` is an argv list: `check_agent_command` checks that its program
resolves to an executable here, as `subprocess` would find it, and `agent_environment` is the whole environment the
program gets. Preflight (`preflight.inputs.check_agent`) runs these on the local target, so an agent that cannot
start is refused (exit 2) with the field and the fix before vLLM starts.
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from async_grpo.user_code import CodeSpec, import_callable, parse_spec, split_adapter

FIELD = "agent"
COMMAND_FIELD = "agent_command"
FORMS = "pkg.module:function or path/to/file.py:function"
SIGNATURE = "def agent(row, base_url, api_key)"
# What the agent program's environment may copy from ours (when set): finding programs and libraries, the locale, a
# temporary folder. Nothing else: this process may hold MLflow, object-store or hub credentials in its environment,
# and the agent is submitter code that also talks to the network.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


class AgentSpecError(ValueError):
    """The `agent` or `agent_command` field does not name an agent that can run (the message names the field and the
    fix)."""


def parse_agent_spec(spec: Any) -> CodeSpec:
    """`user_code.parse_spec` for the `agent` field, with this module's error type (imports nothing).

    Args:
        spec: the config value, `pkg.module:function` or `path/to/file.py:function`.

    Returns:
        The parsed spec, kind "module" or "file".

    Raises:
        AgentSpecError: the spec is malformed, a `builtin:` spec (there are no builtin agents) or an adapter spec
            (`openenv:`, `verifiers:`, which wrap environments); the message names `agent` and the fix.
    """
    if split_adapter(spec)[0] is not None:
        raise AgentSpecError(
            f"{FIELD} {spec!r}: adapter prefixes (openenv:, verifiers:) wrap environments, not agents. Fix: name the "
            f"agent function as {FORMS}."
        )
    if not isinstance(spec, str) or ":" not in spec:  # parse_spec would suggest `builtin:`, which agents lack
        raise AgentSpecError(
            f"{FIELD} spec {spec!r} names no function. Fix: write it as {FORMS}, e.g. my_agent.py:run."
        )
    parsed = parse_spec(spec, what="agent spec", error=AgentSpecError)
    if parsed.kind == "builtin":
        raise AgentSpecError(f"{FIELD} {spec!r}: there are no builtin agents. Fix: name your function as {FORMS}.")
    return parsed


def load_agent(spec: str) -> Callable[..., Any]:
    """Import the function `spec` names (this runs the module's code) and check that it can be called as an episode
    calls it, `fn(row, base_url=..., api_key=...)`. An `async def` and a plain `def` are both accepted; a callable
    without an introspectable signature (a C builtin) is accepted and judged when called.

    Args:
        spec: the `agent` field's value.

    Returns:
        The function (not called).

    Raises:
        AgentSpecError: a malformed spec (`parse_agent_spec`); the module or file does not import or has no such
            attribute, or it is not callable (`user_code.import_callable`); it is a class, or a generator function
            (neither returns a reward); its signature cannot take `(row, base_url=, api_key=)`. Each message names
            `agent`, what was found and the fix.
    """
    parsed = parse_agent_spec(spec)
    fn = import_callable(parsed, what="agent spec", error=AgentSpecError, prefix="_async_grpo_agent",
                         returns="the episode's reward (a number or None) from (row, base_url=, api_key=)")  # fmt: skip
    if inspect.isclass(fn):
        raise AgentSpecError(
            f"{FIELD} {spec!r}: {parsed.name} is a class; an agent is a function called once per episode. Fix: point "
            f"at a function, {SIGNATURE}, returning the episode's reward (a number) or None."
        )
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise AgentSpecError(
            f"{FIELD} {spec!r}: {parsed.name} is a generator function, whose call returns a generator, not a reward. "
            f"Fix: define it as {SIGNATURE} (or async def) and return the reward instead of yielding."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the first episode's call decides
        return fn
    try:
        signature.bind({}, base_url="x", api_key="y")
    except TypeError as err:
        raise AgentSpecError(
            f"{FIELD} {spec!r}: {parsed.name}{signature} cannot be called as {parsed.name}(row, base_url=..., "
            f"api_key=...) ({err}). Fix: define it as {SIGNATURE} (or async def), returning the episode's reward "
            "or None."
        ) from None
    return fn


def check_agent_command(argv: Sequence[str]) -> None:
    """Check that `argv[0]` names a program this machine can run, as `subprocess` will look it up: a path (it holds
    a `/`; relative to the working directory) must be a regular file we may execute; a bare name must be found on
    PATH (`shutil.which`). Runs nothing.

    Args:
        argv: the `agent_command` field's value, program first.

    Raises:
        AgentSpecError: argv is empty or holds an empty or non-string argument or a NUL byte; the program is missing,
            not a regular file, not executable by this user, or not found on PATH. The message names
            `agent_command` and the fix.
    """
    if not argv or not all(isinstance(arg, str) and arg and "\x00" not in arg for arg in argv):
        raise AgentSpecError(
            f"{COMMAND_FIELD} {list(argv)!r} is not an argv list of non-empty strings. Fix: give the program and its "
            "arguments, e.g. [python, agent.py]."
        )
    program = argv[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        path = Path(program)
        if not path.exists():
            problem = f"{str(path.resolve())!r} does not exist"
        elif not path.is_file():
            problem = f"{program!r} is not a regular file"
        elif not os.access(path, os.X_OK):
            problem = f"{program!r} is not executable by this user"
        else:
            return
        raise AgentSpecError(
            f"{COMMAND_FIELD} {list(argv)!r}: the program {problem}. Fix: point agent_command[0] at an executable file "
            f"(chmod +x it, or run it through its interpreter: [python, {program}])."
        )
    if shutil.which(program) is None:
        raise AgentSpecError(
            f"{COMMAND_FIELD} {list(argv)!r}: no program {program!r} on PATH. Fix: install it, or give its path "
            "(e.g. ./bin/agent or /usr/local/bin/agent)."
        )


def agent_environment(base_url: str, api_key: str) -> dict[str, str]:
    """The whole environment of an agent program: OPENAI_BASE_URL and OPENAI_API_KEY (what OpenAI's clients read),
    and from this process only INHERITED_ENV (PATH, HOME, LANG, LC_ALL, TMPDIR, PYTHONPATH, VIRTUAL_ENV) where set.

    Nothing else is copied, on purpose: the trainer's environment holds credentials (MLFLOW_TRACKING_TOKEN, AWS_*,
    HF_TOKEN, the reward service's or the judge's keys), and the agent is submitter code that talks to the network.
    The only key it gets is its episode's own, which the endpoint accepts for that episode alone.

    Args:
        base_url: the endpoint's OpenAI-compatible base URL (ending in `/v1`).
        api_key: the episode's key.

    Returns:
        A new dict, for `subprocess`'s `env=`.
    """
    env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
    env["OPENAI_BASE_URL"] = str(base_url)
    env["OPENAI_API_KEY"] = str(api_key)
    return env
