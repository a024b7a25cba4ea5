"""Reward functions: resolve spec strings to callables (`loading`) and score groups in worker processes (`pool`).

Reward functions use TRL's signature f(prompts, completions, completion_ids, **columns) -> list[float | None],
so functions written for TRL's GRPOTrainer work unchanged.
"""

from async_grpo.rewards.loading import RewardSpecError, resolve_reward_func, reward_func_name
from async_grpo.rewards.pool import RewardBadOutput, RewardError, RewardPool, RewardTimeout

__all__ = [
    "RewardBadOutput",
    "RewardError",
    "RewardPool",
    "RewardSpecError",
    "RewardTimeout",
    "resolve_reward_func",
    "reward_func_name",
]
