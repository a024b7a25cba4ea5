"""Turn a reward-function spec string into the callable it names.

Specs are plain strings (`builtin:<name>`, `pkg.module:function`, `path/to/file.py:function`, or a reward model:
`model:<path or hub id>` or a bare model folder, see `rewards.reward_model`) so that a config stays YAML and each
reward worker process can resolve its own copy without pickling user code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_grpo.rewards import reward_model
from async_grpo.user_code import CodeSpec, import_target, parse_spec

BUILTIN_PREFIX = "builtin:"
WHAT = "reward function spec"


class RewardSpecError(ValueError):
    """A reward-function spec is malformed or does not resolve; the message names the spec and the fix."""


def parse_reward_spec(spec: Any) -> CodeSpec:
    """`user_code.parse_spec` with this module's error type (imports nothing).

    Raises:
        RewardSpecError: the spec is malformed.
    """
    return parse_spec(spec, what=WHAT, error=RewardSpecError)


def reward_func_name(spec: str) -> str:
    """The function name a spec refers to (used in metric names `rewards/<name>/mean`; a reward model's is
    `reward_model/<folder>`); does not import.

    Raises:
        RewardSpecError: the spec is malformed.
    """
    if reward_model.is_reward_model_spec(spec):
        return reward_model.reward_model_name(spec)
    return parse_reward_spec(spec).name


def absolute_reward_spec(spec: str) -> str:
    """The spec as worker processes get it: file and local model paths made absolute (any working directory)."""
    if reward_model.is_reward_model_spec(spec):
        return reward_model.absolute_reward_model_spec(spec)
    return parse_reward_spec(spec).absolute()


def resolve_reward_model(spec: str) -> reward_model.RewardModelScorer:
    """The scorer of a reward-model spec; loads nothing (each worker loads the model on its first call).

    Raises:
        RewardSpecError: an empty location, or a local path without config.json.
    """
    location = reward_model.reward_model_location(spec)
    if not location:
        raise RewardSpecError(f"reward model spec {spec!r} names no model. Fix: write model:<folder or org/name>.")
    if not reward_model.is_hub_id(location) and not (Path(location).expanduser() / "config.json").is_file():
        raise RewardSpecError(
            f"reward model spec {spec!r}: {location!r} is no folder with a config.json. Fix: give the folder "
            "save_pretrained wrote (a sequence-classification model with num_labels=1) or a hub id org/name."
        )
    return reward_model.RewardModelScorer(location)


def resolve_reward_func(spec: str) -> Callable[..., Any]:
    """Import and return the reward function named by `spec`.

    Forms: `model:<path or hub id>` or a bare model folder (`resolve_reward_model`), `builtin:<name>` (a builtin task's reward, see `async_grpo.tasks.builtin_reward_funcs`),
    `pkg.module:function` (imported with importlib), `path/to/file.py:function` (loaded from that file,
    relative paths against the working directory; the same file always maps to the same module).

    Returns:
        The callable, with TRL's reward signature f(prompts, completions, completion_ids, **columns).

    Raises:
        RewardSpecError: malformed spec, unknown builtin, missing file or module, missing attribute,
            or an attribute that is not callable; the message names the spec and the fix.
    """
    if reward_model.is_reward_model_spec(spec):
        return resolve_reward_model(spec)
    parsed = parse_reward_spec(spec)
    target, name = parsed.target, parsed.name
    if parsed.kind == "builtin":
        from async_grpo.rewards.agent_reward import agent_reward
        from async_grpo.rewards.judge import llm_judge
        from async_grpo.tasks import builtin_reward_funcs

        funcs = {**builtin_reward_funcs(), "llm_judge": llm_judge, "agent_reward": agent_reward}
        if name not in funcs:
            raise RewardSpecError(
                f"reward function spec {spec!r}: no builtin reward {name!r}. "
                f"Fix: use one of {[BUILTIN_PREFIX + n for n in sorted(funcs)]}."
            )
        return funcs[name]
    module = import_target(parsed, what=WHAT, error=RewardSpecError, prefix="_async_grpo_reward")
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
