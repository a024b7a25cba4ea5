"""The `producer` section: the rollout source (axolotl's ProducerConfig): a user data producer or the builtin vLLM
orchestrator, how often a rollout is reused (steps_per_generation, num_iterations, mini_epochs), how far production
runs ahead of training (prefetch depth, groups in flight, on-policy warm-up rollouts), timeouts, and streaming scored
groups to the trainer within a step."""

from __future__ import annotations

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, tenant


class DataProducerConfig(Section):
    """The rollout source (axolotl's ProducerConfig): how far it runs ahead and how often a rollout is reused."""

    data_producer: str | None = Field(
        None,
        description="Bring your own rollout source: `pkg.module:factory` or `path/file.py:factory`, called "
        "as factory(config, tokenizer) and returning an object with the DataProducer protocol "
        "(`async_grpo.orchestrator.producer`). None: the builtin vLLM orchestrator.",
        json_schema_extra=code(),
    )
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="Optimizer steps per produced rollout (TRL name): one rollout holds this many steps' "
        "batches, generated together.",
        json_schema_extra=tenant(),
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps on each step batch before moving on (TRL `num_iterations`, the mu of "
        "GRPO, arXiv 2402.03300 Alg. 1). Above 1 the old logprobs are computed once, before the rollout's first "
        "update, so the clipped ratio pi_theta/pi_old is no longer identically 1.",
        json_schema_extra=tenant(),
    )
    mini_epochs: int = Field(
        1,
        ge=1,
        description="Passes over a whole generation round (the step batches of one `produce` call, in order) "
        "before the next one (axolotl ProducerConfig name). Old logprobs are computed once per round, as for "
        "num_iterations.",
        json_schema_extra=tenant(),
    )
    max_rollouts: int | None = Field(
        None,
        ge=1,
        description="Stop after this many generation rounds (`produce` calls, each steps_per_generation step "
        "batches; axolotl's rollouts, whence the ProducerConfig name) even if max_steps is not reached; the metric "
        "`generation_rounds` counts them. None: no limit.",
        json_schema_extra=tenant(),
    )
    prefetch_depth: int = Field(
        2,
        ge=1,
        description="Generation rounds produced ahead of training at most (axolotl ProducerConfig name): the "
        "builtin orchestrator's queue holds prefetch_depth x steps_per_generation step batches. Deeper keeps "
        "vLLM busier at the cost of staleness (bounded separately by max_staleness).",
        json_schema_extra=tenant(),
    )
    sync_warmup_rollouts: int = Field(
        0,
        ge=0,
        description="The first this-many generation rounds are generated strictly on-policy (axolotl "
        "ProducerConfig name): the orchestrator waits for the weights of the step that will consume them "
        "(staleness 0) before launching, so a cold policy bootstraps from fresh samples; later rounds run ahead "
        "up to max_staleness.",
        json_schema_extra=tenant(),
    )
    rollout_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="The trainer fails if no rollout group arrives within this many seconds.",
        json_schema_extra=tenant(),
    )
    max_inflight_groups: int = Field(
        8,
        ge=1,
        description="Generation requests (one per group) in flight at once; gives backpressure.",
        json_schema_extra=tenant(),
    )
    streaming_min_groups: int | None = Field(
        None,
        ge=1,
        description="Streaming group scoring (axolotl name): the orchestrator emits a step's groups to "
        "the trainer in chunks of this many scored groups, and the trainer runs the forward/backward of a chunk "
        "while later groups of the same step are still being generated and scored. The optimizer step equals the "
        "unstreamed one (losses are normalized once the step's last chunk arrived). Needs groups_per_step and "
        "per_device_train_batch_size to be multiples of it (in groups / completions), scale_rewards != batch, "
        "multi_objective_aggregation=sum_then_normalize and no rollout reuse (steps_per_generation = mini_epochs "
        "= num_iterations = 1). None: whole steps.",
        json_schema_extra=tenant(),
    )
