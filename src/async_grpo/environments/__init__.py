"""Environments: what a multi-turn rollout's model acts in, turn by turn (issue 25).

    base      the `Environment` protocol (`reset(row, state)`, `step(action, state)` -> `Observation`), failure kinds
    calls     `EnvironmentCaller`: async or sync environments, each call under a timeout, failures counted
    loading   the `environment` spec -> an environment, its protocol and a first reset checked before anything starts
    builtin   builtin environments (`builtin:guess`)
    tools     `ToolEnvironment`: tool calling as an environment (the run's `tools`), imported on use
    openenv_adapter    `openenv:<module:factory>`: OpenEnv environments (text action, text observations), lazily imported
    verifiers_adapter  `verifiers:<module:factory>`: verifiers 0.4 environments, their harness's calls answered by the rollout

The rollout that drives an environment (token in, token out) is `orchestrator.env_rollout.EnvironmentRollout`;
see docs/environments.md. Importing this package pulls in neither torch nor transformers.
"""

from async_grpo.environments.base import (
    FAILURE_KINDS,
    Environment,
    EnvironmentCallFailed,
    EnvironmentSpecError,
    GroupDropped,
    Observation,
)
from async_grpo.environments.calls import CallOutcome, EnvironmentCaller, check_observation
from async_grpo.environments.loading import check_protocol, check_reset, load_environment

__all__ = [
    "FAILURE_KINDS",
    "CallOutcome",
    "Environment",
    "EnvironmentCallFailed",
    "EnvironmentCaller",
    "EnvironmentSpecError",
    "GroupDropped",
    "Observation",
    "check_observation",
    "check_protocol",
    "check_reset",
    "load_environment",
]
