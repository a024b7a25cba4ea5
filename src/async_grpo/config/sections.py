"""The sections of `GRPOConfig`: one pydantic model per concern, fields named as in TRL's ``GRPOConfig``.

`RunFields` holds the top-level fields (with `trl_fields.RunTRLFields`); every other field lives in exactly one
section, and its flat name (the field name) is unique across all sections, so a flat key maps to one place. (One
field shares its section's name: `tools`, TRL's key, in section `tools`; a list value is the field, a mapping the
section.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.base import Section
from async_grpo.config.checkpoint_section import CheckpointConfig
from async_grpo.config.microbatch_fields import MicroBatchFields
from async_grpo.config.peft_section import PeftConfig
from async_grpo.config.placement import InferencePlacementFields
from async_grpo.config.tools_section import ToolsConfig
from async_grpo.config.trl_fields import (
    DataTRLFields,
    InferenceTRLFields,
    OffPolicyTRLFields,
    OptimTRLFields,
    RewardsTRLFields,
    RunTRLFields,
    SamplingTRLFields,
    TrackingTRLFields,
)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class RunFields(RunTRLFields, Section):
    """Top-level fields of `GRPOConfig` (not in a section)."""

    model_name_or_path: str = Field(
        "builtin:tiny",
        description="Local HF model folder, or `builtin:tiny` to build the tiny char-level "
        "Qwen2-style model under `<output_dir>/tiny-model` (no hub access needed).",
    )
    seed: int = Field(0, description="Seed for data order, model init and sampling.")
    output_dir: str = Field("runs/tiny", description="Run folder: model, logs, vLLM log, MLflow store.")


class DataConfig(DataTRLFields, Section):
    """Training and held-out prompts, evaluation, and the supervised warm start."""

    dataset: str = Field(
        "builtin:reverse",
        description="Training prompts: a .jsonl/.json/.parquet file, a `datasets.save_to_disk` folder, "
        "or `builtin:<task>`. Needs a `prompt` column (standard string or conversational messages); "
        "other columns are passed to reward functions as keyword arguments (as TRL does).",
    )
    eval_dataset: str | None = Field(
        None,
        description="Held-out prompts in the same formats as `dataset`. For `builtin:<task>` the "
        "task's held-out split is used when this is None.",
    )
    eval_num_prompts: int = Field(64, ge=1, description="Held-out prompts scored per evaluation.")
    num_generations_eval: int = Field(4, ge=1, description="Completions sampled per held-out prompt (TRL name).")
    eval_temperature: float | None = Field(
        None,
        ge=0.0,
        description="Sampling temperature for evaluation; None uses `temperature` (the policy GRPO "
        "optimizes), 0 gives greedy accuracy.",
    )
    max_prompt_length: int = Field(256, ge=1, description="Prompts longer than this (tokens) are dropped and counted.")
    warmup_sft_steps: int = Field(
        0, ge=0, description="Supervised steps on the task's reference answers before GRPO (builtin tasks only)."
    )
    warmup_sft_learning_rate: float = Field(3e-3, gt=0.0, description="Learning rate of the warm-start pass.")


class SamplingConfig(SamplingTRLFields, Section):
    """How rollouts are sampled from vLLM (the trainer scores with the same temperature)."""

    num_generations: int = Field(
        8, ge=2, description="Completions sampled per prompt, i.e. the group size G (TRL name)."
    )
    max_completion_length: int = Field(16, ge=1, description="Max generated tokens per completion (TRL name).")
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Sampling temperature for rollouts (TRL name). The trainer "
        "divides its logits by it too (TRL), so its logprobs compare with vLLM's processed "
        "sampling logprobs in the IS ratio and OPSM.",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling threshold (TRL name). The trainer scores "
        "the untruncated distribution (as TRL does), so below 1 the vLLM IS ratio and OPSM also "
        "measure the truncation.",
    )
    top_k: int = Field(
        -1,
        description="Top-k sampling; -1 (or 0) disables it (TRL name). Above 0 the vLLM IS ratio "
        "also measures the truncation, as for top_p.",
    )


class OptimConfig(OptimTRLFields, MicroBatchFields, Section):
    """The optimizer, the step's batch geometry and how the learner computes it."""

    learning_rate: float = Field(1e-6, gt=0.0, description="AdamW learning rate (TRL name; TRL default 1e-6).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Completions per micro-batch on each trainer rank (TRL semantics)."
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step. Completions per step = "
        "per_device_train_batch_size x gradient_accumulation_steps x world size, and must be a "
        "multiple of num_generations (whole groups per step).",
    )
    max_steps: int = Field(
        50, ge=-1, description="Optimizer steps to run; -1: num_train_epochs passes over the training prompts (TRL)."
    )
    torch_num_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads for the trainer's torch (None: torch's default). On a small CPU "
        "machine shared with the vLLM worker, 1 avoids contention.",
    )
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        description="Apply the LM head this many completion positions at a time (with activation "
        "checkpointing), so (batch, seq, vocab) logits are never materialized. None: full logits.",
    )
    fsdp: bool = Field(
        False,
        description="With several trainer ranks, shard parameters, gradients and AdamW state across them with "
        "FSDP2 (`fully_shard` per decoder layer and at the root), as accelerate's FSDP2 plugin does, instead of a "
        "full replica per rank. Same update (tests/trainer/test_streaming_reuse_distributed.py). Needs "
        "logprob_chunk_size=None, use_liger_kernel=false and skip_zero_advantage_batches=false. No effect on one rank.",
    )
    skip_zero_advantage_batches: bool = Field(
        False,
        description="Skip the forward/backward of micro-batches whose advantages are all 0 (they carry no "
        "policy gradient). Needs beta=0, since a skipped micro-batch would also lose its KL term.",
    )
    bf16: bool = Field(
        False,
        description="Run the trainer's forward passes under bfloat16 autocast (TRL name), with float32 master "
        "weights, gradients and AdamW state, and float32 logits for the log-softmax. On CPU it needs bfloat16 support "
        "(avx512_bf16 / AMX); on GPU any Ampere or newer. The IS ratio then also sees the trainer's bf16 rounding "
        "(docs/algorithms.md).",
    )


class LossConfig(Section):
    """The GRPO objective: aggregation, clipping, KL, and which tokens count."""

    loss_type: LossType = Field("dapo", description="Loss aggregation, as TRL's `loss_type` (default dapo).")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (k3 estimator against the initial policy).")
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip range, ratio >= 1 - epsilon (PPO/TRL).")
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip range (DAPO clip-higher); defaults to `epsilon`."
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        description="Two-sided clipping: the unclipped ratio branch is capped at delta "
        "(INTELLECT-2; TRL `delta`). None disables it.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Policy ratio per token, or one per sequence (GSPO, arXiv 2507.18071; TRL name)."
    )
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the k3 KL by the policy ratio pi_theta/pi_old (TRL name and default)."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="SAPO gate temperature for A > 0 (TRL name).")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="SAPO gate temperature for A <= 0 (TRL name).")
    mask_truncated_completions: bool = Field(
        False, description="Exclude completions that hit max_completion_length from the loss (DAPO, TRL name)."
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="rho of 'Beyond the 80/20 Rule' (arXiv 2506.01939; TRL name): keep the "
        "policy term only on tokens whose entropy is at or above the (1 - rho) quantile of the micro-batch's valid "
        "tokens. 1.0 keeps all tokens, 0.0 only the highest-entropy one; the paper uses 0.2. The KL term and the "
        "loss denominators are not masked (TRL).",
    )
    use_liger_kernel: bool = Field(
        False,
        description="Compute the GRPO loss with liger-kernel's fused linear GRPO loss (LigerFusedLinearGRPOLoss, "
        "the `gpu` extra): the LM head, log-softmax and loss run chunk by chunk, so (batch, seq, vocab) logits "
        "never exist; OPSM, the entropy mask and the vLLM IS weights enter as its per-token weight. Same loss as the "
        "unfused path (tests/trainer/test_liger_loss.py). Not with importance_sampling_level=sequence for cispo/sapo "
        "(axolotl / TRL name).",
    )


class OffPolicyConfig(OffPolicyTRLFields, Section):
    """Correction of stale rollouts: vLLM importance-sampling weights, OPSM, and the staleness bound."""

    vllm_importance_sampling_correction: bool = Field(
        True, description="Weight each token by rho = exp(trainer old logp - vLLM sampling logp) (TRL name)."
    )
    vllm_importance_sampling_mode: ISMode = Field(
        "token_truncate", description="How rho is bounded: truncate (clamp) or mask (zero), per token or per sequence."
    )
    vllm_importance_sampling_cap: float = Field(
        3.0,
        gt=0.0,
        description="Upper bound C on rho (TRL `vllm_importance_sampling_cap`; the key "
        "`vllm_importance_sampling_clip_max`, TRL's newer name, sets it too).",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0.0, description="Optional lower bound on rho (TRL name)."
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0.0,
        description="OPSM (DeepSeek-V3.2 eq. 9): drop a sequence when its advantage is negative "
        "and mean_t(sampling logp - current logp) exceeds this (TRL name). None disables it.",
    )
    max_staleness: int = Field(
        2, ge=0, description="Groups generated more than this many policy versions ago are dropped (and counted)."
    )
    off_policy_clip: Literal["current", "behaviour"] = Field(
        "behaviour",
        description="The policy the PPO ratio is taken against. `behaviour` (default): the policy "
        "that sampled, vLLM's logprobs (TRL AsyncGRPOTrainer; decoupled PPO): pi_theta/pi_vLLM is clipped to "
        "[1 - epsilon, 1 + epsilon_high], so a stale token outside the trust region stops pushing, and no IS weight "
        "is applied on top (the vllm_importance_sampling_* metrics are still logged). `current`: the trainer's own "
        "policy before the step (TRL GRPOTrainer; with one optimizer step per batch the ratio is 1, so staleness is "
        "corrected by the truncated IS weight alone). Measured on the demo at max_staleness 4: docs/algorithms.md.",
    )
    kl_bias_correction_ratio: Literal["old", "sampler"] = Field(
        "old",
        description="With use_bias_correction_kl: multiply the k3 KL by pi_theta/pi_old (`old`, TRL) or by "
        "pi_theta/pi_vLLM (`sampler`, DeepSeek-V3.2's unbiased KL against the policy that sampled the tokens).",
    )


class BatchShapingConfig(Section):
    """What the orchestrator does with groups that carry no signal: drop, replay, or re-roll them."""

    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards all tie (std 0) and keep generating until the step's batch "
        "is full (DAPO dynamic sampling). Drops are counted as dropped_groups/zero_std.",
    )
    max_gen_batches: int = Field(
        10,
        ge=1,
        description="With dynamic_sampling: fail with a clear error after this many batches' worth of "
        "groups did not fill one batch.",
    )
    replay_buffer_size: int = Field(
        0,
        ge=0,
        description="Keep the best this-many groups with reward std > 0 in a min-heap scored by "
        "sum_i |A_i| x std(rewards); a batch's zero-std groups are replaced by groups drawn from it in proportion "
        "to score (TRL experimental GRPOWithReplayBuffer). Replayed groups are exempt from max_staleness. Counted "
        "as the cumulative metric replayed_groups. 0 disables it. Needs dynamic_sampling=false.",
    )
    replay_recompute_logps: bool = Field(
        True,
        description="For replayed rows, replace vLLM's (stale) sampling logprobs by the trainer's own old "
        "logprobs, so their stale-policy IS weight is exactly 1 and OPSM sees no drift: the row is treated as "
        "on-policy. False keeps vLLM's logprobs, so IS truncates/masks the row by its real staleness (axolotl name).",
    )
    reroll_start_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Deferred re-roll (axolotl name): prompts whose whole group scored ~0 "
        "(every weighted reward within 1e-6 of 0) wait in a FIFO and are generated again, before fresh prompts, "
        "once the trainer reaches ceil(reroll_start_fraction x max_steps) steps (read from the policy version x "
        "vllm_sync_interval). Counted as the cumulative metric rerolled_groups. 1.0 disables it.",
    )
    reroll_max_groups: int = Field(
        1,
        ge=1,
        description="Deferred re-roll: at most this many re-rolled prompts per batch's worth "
        "(groups_per_step) of generation requests (axolotl name).",
    )


class RewardsConfig(RewardsTRLFields, Section):
    """Reward functions, where they run, and how their scores become advantages."""

    reward_funcs: list[str] = Field(
        default_factory=lambda: ["builtin:reverse_exact_match", "builtin:reverse_format"],
        min_length=1,
        description="Reward functions: `builtin:<name>`, `pkg.module:function`, or `path/to/file.py:function`, "
        "each with TRL's signature f(prompts, completions, completion_ids, **columns) -> list[float | None].",
    )
    reward_weights: list[float] | None = Field(
        None, description="One weight per reward function (TRL name); all 1.0 when None."
    )
    reward_num_workers: int = Field(2, ge=1, description="Reward worker processes.")
    reward_timeout_s: float = Field(30.0, gt=0.0, description="Per-group reward call timeout (seconds).")
    reward_failure_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="Fail the run (with a checkpoint, see checkpoint_on_signal) once every group has "
        "failed to score for this long (seconds; a dead reward service or broken reward workers), instead of "
        "dropping groups until rollout_timeout_s. Single failures are dropped and counted as before.",
    )
    reward_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+",
        description="Base URL of a running reward service "
        "(`python -m async_grpo.rewards.server`, e.g. http://reward:8080): groups are scored there instead of in "
        "a local process pool. None: the env ASYNC_GRPO_REWARD_URL (set by the kubernetes launcher when "
        "reward_replicas > 0), else a local pool of reward_num_workers processes.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scaling: divide by the group std, the batch std, or not at all (TRL)."
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How several reward functions combine into one advantage (TRL name)."
    )


class DataProducerConfig(Section):
    """The rollout source (axolotl's ProducerConfig): how far it runs ahead and how often a rollout is reused."""

    data_producer: str | None = Field(
        None,
        description="Bring your own rollout source: `pkg.module:factory` or `path/file.py:factory`, called "
        "as factory(config, tokenizer) and returning an object with the DataProducer protocol "
        "(`async_grpo.orchestrator.producer`). None: the builtin vLLM orchestrator.",
    )
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="Optimizer steps per produced rollout (TRL name): one rollout holds this many steps' "
        "batches, generated together.",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps on each step batch before moving on (TRL `num_iterations`, the mu of "
        "GRPO, arXiv 2402.03300 Alg. 1). Above 1 the old logprobs are computed once, before the rollout's first "
        "update, so the clipped ratio pi_theta/pi_old is no longer identically 1.",
    )
    mini_epochs: int = Field(
        1,
        ge=1,
        description="Passes over a whole rollout (all its step batches, in order) before the next one "
        "(axolotl ProducerConfig name). Old logprobs are computed once per rollout, as for num_iterations.",
    )
    max_rollouts: int | None = Field(
        None,
        ge=1,
        description="Stop after this many produce-then-train rounds even if max_steps is not reached "
        "(axolotl ProducerConfig name). None: no limit.",
    )
    prefetch_depth: int = Field(
        2,
        ge=1,
        description="Rollouts produced ahead of training at most (axolotl ProducerConfig name): the "
        "builtin orchestrator's queue holds prefetch_depth x steps_per_generation step batches. Deeper keeps "
        "vLLM busier at the cost of staleness (bounded separately by max_staleness).",
    )
    sync_warmup_rollouts: int = Field(
        0,
        ge=0,
        description="The first this-many rollouts are generated strictly on-policy (axolotl "
        "ProducerConfig name): the orchestrator waits for the weights of the step that will consume them "
        "(staleness 0) before launching, so a cold policy bootstraps from fresh samples; later rollouts run ahead "
        "up to max_staleness.",
    )
    rollout_timeout_s: float = Field(
        300.0, gt=0.0, description="The trainer fails if no rollout group arrives within this many seconds."
    )
    max_inflight_groups: int = Field(
        8, ge=1, description="Generation requests (one per group) in flight at once; gives backpressure."
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
    )


class InferenceConfig(InferenceTRLFields, InferencePlacementFields, Section):
    """The vLLM server that generates rollouts: attach to one, or how to launch it."""

    vllm_url: str | None = Field(
        None,
        description="Attach to running vLLM servers instead of starting them: one URL, "
        "a comma-separated list of vllm_replicas URLs, or one URL whose host name resolves to "
        "the replicas' addresses (a Kubernetes headless Service).",
    )
    vllm_port: int = Field(0, ge=0, le=65535, description="Port for the launched server; 0 picks a free one.")
    vllm_dtype: str = Field("float32", description="dtype the launched vLLM server runs the model in.")
    vllm_max_model_len: int = Field(512, ge=16, description="vLLM --max-model-len (tokens).")
    vllm_kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build (GiB).")
    vllm_startup_timeout_s: float = Field(300.0, gt=0.0, description="Wait this long for vLLM /health (seconds).")
    vllm_request_timeout_s: float = Field(120.0, gt=0.0, description="Timeout for one generation request (seconds).")
    vllm_extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` flags.")
    max_inference_restarts: int = Field(
        3,
        ge=0,
        description="Times the run recovers from a vLLM server that died or stopped answering (the local "
        "backend restarts it; on Kubernetes its Deployment does) before it fails with a clear message. Each "
        "recovery re-initialises the weight transfer and pushes the current weights; groups in flight are "
        "generated again, not lost.",
    )
    vllm_recovery_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Longest wait for a lost vLLM server to answer /health again, and for "
        "generation requests parked meanwhile (seconds).",
    )


class WeightSyncConfig(Section):
    """Pushing the trainer's weights to vLLM: how often and over which data plane."""

    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Weight-transfer data plane: nccl on GPU, gloo on CPU; auto picks by device."
    )
    weight_sync_timeout_s: float = Field(300.0, gt=0.0, description="Timeout for one weight push (seconds).")
    vllm_sync_interval: int = Field(1, ge=1, description="Push weights to vLLM every this many optimizer steps.")


class TrackingConfig(TrackingTRLFields, Section):
    """MLflow: where the run is logged, and how often."""

    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; None: the MLFLOW_TRACKING_URI environment variable, else "
        "`sqlite:///<output_dir>/mlflow.db`. MLFLOW_RUN_ID in the environment makes the run log into that run.",
    )
    mlflow_experiment_name: str = Field(
        "async-grpo",
        description="MLflow experiment; at this default the MLFLOW_EXPERIMENT_NAME environment variable wins.",
    )
    run_name: str | None = Field(None, description="MLflow run name.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    log_completions_steps: int = Field(10, ge=1, description="Log a table of sample completions every N steps.")
    num_completions_to_print: int = Field(8, ge=1, description="Rows in each sample-completions table (TRL name).")


# Section name in GRPOConfig -> its model, in the order `dump_config` and `train --help` show them.
SECTIONS: dict[str, type[Section]] = {
    "data": DataConfig,
    "sampling": SamplingConfig,
    "optim": OptimConfig,
    "loss": LossConfig,
    "off_policy": OffPolicyConfig,
    "batch_shaping": BatchShapingConfig,
    "rewards": RewardsConfig,
    "producer": DataProducerConfig,
    "inference": InferenceConfig,
    "weight_sync": WeightSyncConfig,
    "tracking": TrackingConfig,
    "checkpoint": CheckpointConfig,
    "tools": ToolsConfig,
    "peft": PeftConfig,
}
