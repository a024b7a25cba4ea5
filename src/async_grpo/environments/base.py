"""The environment protocol: what a multi-turn rollout needs from an environment the model acts in.

One episode per rollout sample. The rollout owns the episode's `state` dict (verifiers' name: one dict per rollout,
filled by the environment, read by reward functions) and calls, in order:

    obs = await env.reset(row, state)          # the dataset row -> the messages that open the episode
    loop:
        the model's turn (sampled by vLLM; its assistant message text is the action)
        obs = await env.step(action, state)    # -> observation messages, a reward, done

Both return an `Observation` (OpenEnv's `reset()` / `step(action)` returning observation, reward, done), whose
`messages` (role `user` or `tool`) are appended to the conversation (verifiers' `env_response`); `done` ends the
episode (verifiers' `is_completed`). The rollout, not the environment, enforces `max_turns` (verifiers' name),
the length budget and a timeout on every call. How the two libraries map onto this:

    verifiers MultiTurnEnv (before 0.4)    this protocol (verifiers 0.4 envs: adapted by `verifiers_adapter`)
    setup_state(state)                     reset(row, state) (row: the dataset row, state["prompt"] its prompt)
    env_response(messages, state)          step(action, state): state["messages"] holds the conversation so far
    is_completed(messages, state)          Observation.done
    max_turns                              config `max_turns`
    rubric reward from state               state["env_reward"] -> reward kwarg `env_reward` / builtin:env_reward

    OpenEnv Environment                    this protocol (adapted: `openenv_adapter`)
    reset() -> Observation                 reset(row, state) -> Observation (the row picks the episode)
    step(action) -> Observation            step(action, state) -> Observation
    observation.reward, observation.done   Observation.reward, Observation.done

The protocol is async by contract. A synchronous implementation (plain `def reset` / `def step`) is accepted
too: `environments.calls.EnvironmentCaller` runs it in a worker thread. Either way each call runs under a timeout,
and an environment that raises, hangs or answers malformed ends its sample with a counted failure kind
(`FAILURE_KINDS`), never the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Failure kinds, the suffixes of the metrics `env/failures/<kind>` (`orchestrator.batching.env_metrics`).
FAILURE_KINDS = (
    "reset_exception",  # reset raised
    "reset_timeout",  # reset ran past env_timeout_s
    "reset_mismatch",  # reset opened this sample's episode with other messages than the group's first (one prompt)
    "step_exception",  # step raised
    "step_timeout",  # step ran past env_timeout_s
    "bad_observation",  # reset or step returned something other than a valid Observation
)
OBSERVATION_ROLES = ("user", "tool")


@dataclass
class Observation:
    """What the environment answers (OpenEnv's observation with its reward and done flag).

    Attributes:
        messages: chat messages appended to the conversation, each {"role": "user" | "tool", "content": str}
            (a tool message may carry "name"); from `reset`, the messages after the dataset prompt (usually []).
            Their tokens are rendered by the chat template and never trained on (loss_mask 0).
        reward: a reward for this step, or None; the episode's `state["env_reward"]` is the sum of the rewards
            given (None while none was), which reward functions receive as `env_reward`.
        done: True ends the episode after this observation (its messages are then not appended).
    """

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """An environment the model acts in over several turns (see the module docstring).

    One object serves every episode of the run, concurrently: per-episode data lives in the `state` dict the
    rollout passes in (never on `self`), so one instance can run many samples at once.
    """

    async def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> Observation:
        """Open an episode for one rollout sample.

        Args:
            row: the dataset row: "prompt" (the prompt messages) and every other column (e.g. "answer").
            state: the episode's empty state dict, to fill (the rollout adds "prompt", "messages", "turn",
                "max_turns", "env_reward").

        Returns:
            The messages appended after the dataset prompt ([] when the prompt opens the episode by itself);
            `reward` and `done` are read too. Every sample of a group must open with the same messages (they
            share one prompt); a sample whose differ ends with `reset_mismatch`.
        """
        ...

    async def step(self, action: str, state: dict[str, Any]) -> Observation:
        """Answer the model's turn.

        Args:
            action: the text of the model's assistant message (special tokens removed).
            state: the episode's state; state["messages"] is the conversation so far (prompt, then every turn,
                ending with this action's assistant message), state["turn"] the number of model turns so far.

        Returns:
            The observation: the messages the model reads next, a reward, and whether the episode is over.
        """
        ...


# Optional: an environment may also define `async def close_episode(self, state)` (or a plain def). The rollout
# calls it once for every episode it opened, after the episode stopped however it stopped (done, max_turns, the
# length budget, a failed call, the group dropped), to release what `reset` took for it (OpenEnv's `close()` of
# an episode's environment; the verifiers adapter cancels an episode the rollout stopped early). Its errors are
# logged, never counted against the sample (`EnvironmentCaller.close_episode`).


class EnvironmentSpecError(ValueError):
    """The `environment` spec does not resolve to an environment (the message names the field and the fix)."""


class GroupDropped(Exception):
    """Raised by an environment call when something shared failed, not the episode (e.g. the tool service cannot
    be reached): the rollout drops the whole group with `reason` (a drop-counter key of
    `transports.drops.DropReason`, e.g. "tool_service_error") instead of counting an environment failure, and no
    model is trained on the episode. `EnvironmentCaller` lets it through.

    Args:
        reason: the drop-counter key.
        message: the exception message; `reason` when empty.
    """

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or reason)
        self.reason = reason


class EnvironmentCallFailed(Exception):
    """Raised by an environment that wraps another (`environments.tools.ToolEnvironment` around the run's
    `environment`) when the wrapped one's call failed: `EnvironmentCaller` turns it into that failure, kind and
    message unchanged, so the wrapped environment's failures are counted as its own.

    Args:
        kind: one of `FAILURE_KINDS`.
        error: what went wrong.
    """

    def __init__(self, kind: str, error: str):
        super().__init__(error or kind)
        self.kind, self.error = kind, error
