"""The `batch_shaping` section: what the orchestrator does with groups whose rewards all tie (no policy gradient):
DAPO dynamic sampling drops them and generates more, the replay buffer swaps in earlier informative groups, and
deferred re-roll generates their prompts again later in the run."""

from __future__ import annotations

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant


class BatchShapingConfig(Section):
    """What the orchestrator does with groups that carry no signal: drop, replay, or re-roll them."""

    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards all tie (std 0) and keep generating until the step's batch "
        "is full (DAPO dynamic sampling). Drops are counted as dropped_groups/zero_std.",
        json_schema_extra=tenant(),
    )
    max_gen_batches: int = Field(
        10,
        ge=1,
        description="With dynamic_sampling: fail with a clear error after this many batches' worth of "
        "groups did not fill one batch.",
        json_schema_extra=tenant(),
    )
    replay_buffer_size: int = Field(
        0,
        ge=0,
        description="Keep the best this-many groups with reward std > 0 in a min-heap scored by "
        "sum_i |A_i| x std(rewards); a batch's zero-std groups are replaced by groups drawn from it in proportion "
        "to score (TRL experimental GRPOWithReplayBuffer). Replayed groups are exempt from max_staleness. Counted "
        "as the cumulative metric replayed_groups. 0 disables it. Needs dynamic_sampling=false.",
        json_schema_extra=tenant(),
    )
    replay_recompute_logps: bool = Field(
        True,
        description="For replayed rows, replace vLLM's (stale) sampling logprobs by the trainer's own old "
        "logprobs, so their stale-policy IS weight is exactly 1 and OPSM sees no drift: the row is treated as "
        "on-policy. False keeps vLLM's logprobs, so IS truncates/masks the row by its real staleness (axolotl name).",
        json_schema_extra=tenant(),
    )
    reroll_start_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Deferred re-roll (axolotl name): prompts whose whole group scored ~0 "
        "(every weighted reward within 1e-6 of 0) wait in a FIFO and are generated again, before fresh prompts, "
        "once the trainer reaches ceil(reroll_start_fraction x max_steps) steps (read from the policy version x "
        "vllm_sync_interval). Counted as the cumulative metric rerolled_groups. 1.0 disables it.",
        json_schema_extra=tenant(),
    )
    reroll_max_groups: int = Field(
        1,
        ge=1,
        description="Deferred re-roll: at most this many re-rolled prompts per batch's worth "
        "(groups_per_step) of generation requests (axolotl name).",
        json_schema_extra=tenant(),
    )
