"""`builtin:agent_reward`: the agent's own return value as a reward function (TRL's reward-function contract)."""

from __future__ import annotations

from typing import Any

AGENT_REWARD_COLUMN = "agent_reward"  # the keyword column the agent rollout passes (agents.rollout)


def agent_reward(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float | None]:
    """Each completion's agent return value (TRL reward signature): the `agent_reward` keyword column the agent
    rollout passes, one value per completion (row). None where the agent returned None or failed (the row is then
    unscored by this function: NaN, left out of the weighted sum, as TRL treats a None reward).

    Raises:
        ValueError: no `agent_reward` argument (the run has no `agent`), or the wrong number of values.
    """
    if AGENT_REWARD_COLUMN not in kwargs:
        raise ValueError(
            "agent_reward: needs the `agent_reward` argument, which only an agent rollout passes. "
            "Fix: set `agent` or `agent_command`, or drop builtin:agent_reward from reward_funcs."
        )
    values = list(kwargs[AGENT_REWARD_COLUMN])
    if len(values) != len(completions):
        raise ValueError(f"agent_reward: got {len(completions)} completions but {len(values)} agent_reward values.")
    return [None if v is None else float(v) for v in values]
