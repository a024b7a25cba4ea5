"""Typed messages that cross role boundaries. Plain Python lists (no torch), so every role can import them.

Each struct names its producer and consumer. Roles never import each other's internals: the
orchestrator and the trainer meet only here and in `transports.queue`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


# Orchestrator -> Trainer
@dataclass
class RolloutGroup:
    """One prompt and its `num_generations` sampled completions, scored and stamped.

    Shapes use G = group size (num_generations), F = number of reward functions, T_i = tokens of
    completion i.

    Attributes:
        prompt_ids: (P,) prompt token ids exactly as sent to vLLM.
        completion_ids: G lists, (T_i,) sampled token ids each, EOS included when generated.
        sampling_logprobs: G lists, (T_i,) vLLM processed logprobs (nats) of each sampled token.
        truncated: (G,) True when the completion hit max_completion_length (finish_reason "length").
        completions: (G,) decoded completion texts (for reward functions and sample tables).
        prompt: the prompt as given by the dataset (string or list of chat messages).
        columns: the dataset row's other columns, passed to reward functions as keyword arguments.
        rewards_per_func: G rows of F floats; NaN where a function returned None.
        rewards: (G,) weighted reward per completion (nansum over functions).
        advantages: (G,) per-completion advantage (filled by the orchestrator's batcher).
        policy_version: trainer policy version whose weights generated this group.
        created_at: wall time (s since epoch) when generation was requested.
        replayed: True for a copy drawn from the orchestrator's replay buffer (`replay_buffer_size`) in
            place of a zero-std group. It is deliberately old: the rollout queue never drops it as stale,
            and with `replay_recompute_logps` the trainer treats its rows as on-policy.
        rerolled: True when the prompt was generated again by deferred re-roll (`reroll_start_fraction`)
            after an earlier group of it scored ~0. Informational.
    """

    prompt_ids: list[int]
    completion_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    truncated: list[bool]
    completions: list[str]
    prompt: object
    columns: dict
    policy_version: int
    rewards_per_func: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    replayed: bool = False
    rerolled: bool = False

    @property
    def size(self) -> int:
        """Number of completions G."""
        return len(self.completion_ids)

    @property
    def reward_std(self) -> float:
        """Population-free (unbiased, as torch.std) std of the finite rewards; 0.0 if fewer than 2."""
        vals = [r for r in self.rewards if not math.isnan(r)]
        if len(vals) < 2:
            return 0.0
        mean = sum(vals) / len(vals)
        return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


# Orchestrator -> Trainer
@dataclass
class TrainBatch:
    """The groups for one optimizer step, with advantages already computed over this batch, or one chunk
    of them (streaming group scoring, `streaming_min_groups`).

    Attributes:
        groups: the rollout groups (each with `advantages` filled).
        metrics: rollout metrics for this step (reward means, lengths, zero-std fraction...), logged by
            the trainer at the step that consumes it. With streaming, the final chunk carries the whole
            step's metrics and earlier chunks carry none.
        final: True on the last (or only) chunk of a step.
    """

    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    final: bool = True

    @property
    def num_samples(self) -> int:
        """Total completions in the batch."""
        return sum(g.size for g in self.groups)

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version in the batch."""
        return min(g.policy_version for g in self.groups)
