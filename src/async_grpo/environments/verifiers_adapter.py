"""verifiers (prime-rl's environments, `verifiers` 0.4.0): resolved, checked, and refused with the reason and the fix.

Spec: `environment: verifiers:<env-id>` (an installed verifiers environment package or a builtin one, the id
`vf.load_environment` takes, e.g. `verifiers:user-sim`) or `verifiers:<pkg.module:Name>` / `verifiers:<path/to/
file.py:Name>` (a `verifiers.v1.Env` subclass or instance).

Why refused: verifiers 0.4 replaced the `MultiTurnEnv` API (`env_response(messages, state)`, `is_completed`,
`setup_state`, a `Rubric`) with `verifiers.v1`: an `Env` whose `run(task, agents)` drives agents, and each agent's
harness calls the model itself through its own OpenAI-compatible client (and the interception server, tools over
MCP, sandboxes). The environment, not the rollout, decides when and how the model is sampled, so the rollout
cannot keep token in / token out (sampled ids, their logprobs and the policy version of every token); training on
tokens re-derived from the harness' text would train on wrong tokens. The spec is therefore resolved (so a typo or
a missing package is reported as such) and then refused before vLLM starts, with the fix: port the environment to
the protocol (`async def reset(row, state)` / `async def step(action, state)`, its reward as `Observation.reward`;
docs/environments.md shows the mapping) or use an OpenEnv environment (`openenv:`). Importing this module imports
no verifiers code.
"""

from __future__ import annotations

from typing import Any

from async_grpo.environments.base import EnvironmentSpecError
from async_grpo.user_code import import_target, parse_spec

PACKAGE = "verifiers"
INSTALL_FIX = (
    "Fix: install it where the rollouts run (`pip install --no-deps verifiers==0.4.0`: its declared dependencies "
    "pin openai<3 and mcp==2.0.0, older than this project's; see docs/environments.md, 'Adapters')."
)
REFUSAL = (
    "verifiers 0.4 environments (`verifiers.v1.Env.run(task, agents)`) sample the model themselves through their "
    "agents' harness and its own OpenAI-compatible client, so the rollout cannot keep token in / token out (the "
    "sampled ids, their logprobs and each token's policy version) and would train on wrong tokens. Fix: port the "
    "environment to the protocol (async def reset(row, state) / step(action, state) returning an Observation, its "
    "rubric's score as the final Observation.reward; docs/environments.md, 'Adapters'), or use an OpenEnv "
    "environment (environment: openenv:<module:factory>)."
)


def resolve_verifiers(inner: str, spec: str) -> Any:
    """The verifiers environment an inner spec names: an env id (`vf.environment_class`) or `module:Name` /
    `file.py:Name` (imported).

    Args:
        inner: what follows `verifiers:`.
        spec: the whole spec, for messages.

    Returns:
        The `Env` class or object named.

    Raises:
        EnvironmentSpecError: verifiers is missing, the id does not resolve, the module or attribute is missing.
    """
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise EnvironmentSpecError(
            f"`environment` {spec!r}: a verifiers: spec needs the {PACKAGE} package, which cannot be imported "
            f"({err}). {INSTALL_FIX}"
        ) from err
    if ":" not in inner:
        try:
            return vf.environment_class("", inner)
        except Exception as err:
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: verifiers cannot load environment {inner!r} ({err}). Fix: install the "
                "environment's package, or write verifiers:pkg.module:Name."
            ) from err
    parsed = parse_spec(inner, what="`environment`: verifiers spec", error=EnvironmentSpecError)
    if parsed.kind == "builtin":
        raise EnvironmentSpecError(f"`environment` {spec!r}: write builtin environments without `verifiers:`.")
    module = import_target(parsed, what="`environment`: verifiers spec", error=EnvironmentSpecError, prefix="_vf")
    if not hasattr(module, parsed.name):
        raise EnvironmentSpecError(f"`environment` {spec!r}: {parsed.target} has no attribute {parsed.name!r}.")
    return getattr(module, parsed.name)


def load_verifiers(inner: str, spec: str) -> Any:
    """Resolve a verifiers spec (`resolve_verifiers`) and refuse it: see the module docstring.

    Raises:
        EnvironmentSpecError: always; the message says what was found, why it cannot be trained on token in /
            token out, and the fix.
    """
    target = resolve_verifiers(inner, spec)
    try:
        from verifiers.v1 import Env
    except ImportError:  # pragma: no cover - resolve_verifiers imported it
        Env = None
    is_env = Env is not None and ((isinstance(target, type) and issubclass(target, Env)) or isinstance(target, Env))
    name = target.__name__ if isinstance(target, type) else type(target).__name__
    what = f"the verifiers Env {name}" if is_env else f"{name}, which is not a verifiers.v1.Env, and"
    raise EnvironmentSpecError(f"`environment` {spec!r}: {what} cannot be driven by the rollout. {REFUSAL}")
