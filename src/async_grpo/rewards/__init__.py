"""Reward functions: resolve spec strings to callables (`loading`) and score groups in worker processes (`pool`).

Reward functions use TRL's signature f(prompts, completions, completion_ids, **columns) -> list[float | None],
so functions written for TRL's GRPOTrainer work unchanged.

The same pool also runs behind HTTP: `rewards.server` is the reward service (the reward Deployment),
`rewards.remote` its client with the pool's interface (`make_reward_pool` picks local or remote). They are
not imported here, so the reward image needs no client code and the trainer no server code.
"""

from async_grpo.rewards.loading import RewardSpecError, resolve_reward_func, reward_func_name
from async_grpo.rewards.pool import RewardPool
from async_grpo.transports.scorer import RewardBadOutput, RewardError, RewardTimeout

__all__ = [
    "RewardBadOutput",
    "RewardError",
    "RewardPool",
    "RewardSpecError",
    "RewardTimeout",
    "resolve_reward_func",
    "reward_func_name",
]
