"""TRL's reward-function contract, exactly: what a reward function is called with and what it may log.

TRL 1.16 `GRPOTrainer._calculate_rewards` calls every reward function as

    f(prompts=..., completions=..., completion_ids=..., **dataset_columns,
      trainer_state=..., log_extra=..., log_metric=...)

with completions as strings for standard prompts and as `[{"role": "assistant", "content": ...}]` for
conversational ones (the rollout builds them: `orchestrator.rollout.score_group`), returns one float or None
(not applicable) per completion, and may be `async def`. `call_reward` makes exactly that call, binding the run's
parameters of configurable builtins (`bound_kwargs`); `RewardLog` collects `log_extra(column, values)` (extra
columns of the completions table) and `log_metric(name, value)` (a scalar averaged over the step and logged
beside the run's metrics); `transports.scorer.ScoredGroup` carries both back with the (G, F) rewards, across the process boundary
and the reward service's JSON.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

OVERLONG_SPEC = "builtin:soft_overlong_penalty"
JUDGE_SPEC = "builtin:llm_judge"
JUDGE_FIELDS = (  # the rewards section's fields `builtin:llm_judge` is called with (rewards/judge.py)
    "judge_url",
    "judge_model",
    "judge_rubric",
    "judge_max_score",
    "judge_max_tokens",
    "judge_temperature",
    "judge_max_retries",
    "judge_timeout_s",
    "judge_max_concurrency",
    "judge_cache_size",
    "judge_guided_score",
)


@dataclass
class RewardTrainerState:
    """The `trainer_state` reward functions receive: the fields of transformers' `TrainerState` known when a group
    is scored (TRL passes `self.state`), for reward shaping over training progress.

    Attributes:
        global_step: optimizer steps the trainer has completed when the group is scored (rollouts run ahead of
            training by up to max_staleness versions).
        max_steps: the run's optimizer steps.
    """

    global_step: int = 0
    max_steps: int = 0

    def to_dict(self) -> dict[str, int]:
        """JSON-ready fields (the reward service's wire format)."""
        return asdict(self)


class RewardLog:
    """Collects one group's `log_extra` / `log_metric` calls (TRL `_log_completion_extra` / `_log_metric`)."""

    def __init__(self) -> None:
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        """Add `values` (one per completion of the group) as the completions-table column `column`."""
        self.extra.setdefault(str(column), []).extend(list(values))

    def log_metric(self, name: str, value: float) -> None:
        """Record a scalar for the metric `name` (averaged over the step's groups when logged)."""
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            self.metrics.setdefault(str(name), []).append(float(value))


async def _await(awaitable: Any) -> Any:
    return await awaitable


def call_reward(
    func: Callable[..., Any],
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: Mapping[str, list],
    *,
    trainer_state: RewardTrainerState,
    log: RewardLog,
    bound: Mapping[str, Any] | None = None,
) -> Any:
    """Call one reward function with TRL's keyword arguments (module docstring) plus `bound` (the run's
    parameters of a configurable builtin); an `async def` function runs to completion here. Returns what it
    returned (the caller validates it)."""
    out = func(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        **columns,
        trainer_state=trainer_state,
        log_extra=log.log_extra,
        log_metric=log.log_metric,
        **dict(bound or {}),
    )
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


def bound_kwargs(config: Any) -> dict[str, dict[str, Any]]:
    """Per reward spec, the keyword arguments the run binds from its config: DAPO's soft overlong penalty gets
    max_completion_length, overlong_buffer_len and overlong_penalty_factor; a reward model
    (`rewards.reward_model`) its batch size, device and the run's chat_template_kwargs; the LLM judge
    (`rewards.judge`) the `judge_*` fields."""
    from async_grpo.rewards.reward_model import is_reward_model_spec

    rewards = config.rewards
    bound: dict[str, dict[str, Any]] = {}
    if OVERLONG_SPEC in rewards.reward_funcs:
        bound[OVERLONG_SPEC] = {
            "max_completion_length": config.sampling.max_completion_length,
            "overlong_buffer_len": rewards.overlong_buffer_len,
            "overlong_penalty_factor": rewards.overlong_penalty_factor,
        }
    if JUDGE_SPEC in rewards.reward_funcs:
        bound[JUDGE_SPEC] = {name: getattr(rewards, name) for name in JUDGE_FIELDS}
    for spec in rewards.reward_funcs:
        if is_reward_model_spec(spec):
            bound[spec] = {
                "reward_model_batch_size": rewards.reward_model_batch_size,
                "reward_model_device": rewards.reward_model_device,
                "chat_template_kwargs": dict(config.data.chat_template_kwargs or {}),
            }
    return bound
