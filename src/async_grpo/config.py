"""The one run configuration: a pydantic model loaded from YAML, overridable from the CLI.

Field names follow TRL's ``GRPOConfig`` wherever TRL has the knob, so a TRL user's
YAML mostly works as-is. This module does not import torch: the launcher, the
KFP components and the CLI validate a config before anything expensive starts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and the fix."""


class GRPOConfig(BaseModel):
    """Everything one async GRPO run needs. Unknown keys are rejected (typos fail early)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    # ---------------------------------------------------------------- model & data
    model_name_or_path: str = Field(
        "builtin:tiny",
        description="Local HF model folder, or `builtin:tiny` to build the tiny char-level "
        "Qwen2-style model under `<output_dir>/tiny-model` (no hub access needed).",
    )
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
    num_generations_eval: int = Field(
        4, ge=1, description="Completions sampled per held-out prompt (TRL name)."
    )
    eval_temperature: float | None = Field(
        None, ge=0.0, description="Sampling temperature for evaluation; None uses `temperature` (the policy GRPO "
        "optimizes), 0 gives greedy accuracy."
    )
    max_prompt_length: int = Field(256, ge=1, description="Prompts longer than this (tokens) are dropped and counted.")
    max_completion_length: int = Field(16, ge=1, description="Max generated tokens per completion (TRL name).")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt, i.e. the group size G (TRL name).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature for rollouts (TRL name). The trainer "
                               "divides its logits by it too (TRL), so its logprobs compare with vLLM's processed "
                               "sampling logprobs in the IS ratio and OPSM.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (TRL name). The trainer scores "
                         "the untruncated distribution (as TRL does), so below 1 the vLLM IS ratio and OPSM also "
                         "measure the truncation.")
    top_k: int = Field(-1, description="Top-k sampling; -1 (or 0) disables it (TRL name). Above 0 the vLLM IS ratio "
                       "also measures the truncation, as for top_p.")

    # ---------------------------------------------------------------- optimisation
    learning_rate: float = Field(1e-6, gt=0.0, description="AdamW learning rate (TRL name; TRL default 1e-6).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="Apply the LM head this many completion positions at a time (with activation "
        "checkpointing), so (batch, seq, vocab) logits are never materialized. None: full logits."
    )
    use_liger_kernel: bool = Field(
        False, description="Compute the GRPO loss with liger-kernel's fused linear GRPO loss (LigerFusedLinearGRPOLoss, "
        "the `gpu` extra): the LM head, log-softmax and loss run chunk by chunk, so (batch, seq, vocab) logits "
        "never exist; OPSM, the entropy mask and the vLLM IS weights enter as its per-token weight. Same loss as the "
        "unfused path (tests/trainer/test_liger_loss.py). Not with importance_sampling_level=sequence for cispo/sapo "
        "(axolotl / TRL name)."
    )
    fsdp: bool = Field(
        False, description="With several trainer ranks, shard parameters, gradients and AdamW state across them with "
        "FSDP2 (`fully_shard` per decoder layer and at the root), as accelerate's FSDP2 plugin does, instead of a "
        "full replica per rank. Same update (tests/trainer/test_streaming_reuse_distributed.py). Needs "
        "logprob_chunk_size=None, use_liger_kernel=false and skip_zero_advantage_batches=false. No effect on one rank."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Completions per micro-batch on each trainer rank (TRL semantics)."
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step. Completions per step = "
        "per_device_train_batch_size x gradient_accumulation_steps x world size, and must be a "
        "multiple of num_generations (whole groups per step)."
    )
    max_steps: int = Field(50, ge=1, description="Optimizer steps to run.")
    seed: int = Field(0, description="Seed for data order, model init and sampling.")
    torch_num_threads: int | None = Field(
        None, ge=1, description="Intra-op threads for the trainer's torch (None: torch's default). On a small CPU "
        "machine shared with the vLLM worker, 1 avoids contention."
    )

    # ---------------------------------------------------------------- GRPO loss
    loss_type: LossType = Field("dapo", description="Loss aggregation, as TRL's `loss_type` (default dapo).")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (k3 estimator against the initial policy).")
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip range, ratio >= 1 - epsilon (PPO/TRL).")
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip range (DAPO clip-higher); defaults to `epsilon`."
    )
    delta: float | None = Field(
        None, gt=1.0, description="Two-sided clipping: the unclipped ratio branch is capped at delta "
        "(INTELLECT-2; TRL `delta`). None disables it."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Policy ratio per token, or one per sequence (GSPO, arXiv 2507.18071; TRL name)."
    )
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the k3 KL by the policy ratio pi_theta/pi_old (TRL name and default)."
    )
    off_policy_mask_threshold: float | None = Field(
        None, gt=0.0, description="OPSM (DeepSeek-V3.2 eq. 9): drop a sequence when its advantage is negative "
        "and mean_t(sampling logp - current logp) exceeds this (TRL name). None disables it."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="SAPO gate temperature for A > 0 (TRL name).")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="SAPO gate temperature for A <= 0 (TRL name).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How several reward functions combine into one advantage (TRL name)."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scaling: divide by the group std, the batch std, or not at all (TRL)."
    )
    dynamic_sampling: bool = Field(
        False, description="Drop groups whose rewards all tie (std 0) and keep generating until the step's batch "
        "is full (DAPO dynamic sampling). Drops are counted as dropped_groups/zero_std."
    )
    max_gen_batches: int = Field(
        10, ge=1, description="With dynamic_sampling: fail with a clear error after this many batches' worth of "
        "groups did not fill one batch."
    )
    skip_zero_advantage_batches: bool = Field(
        False, description="Skip the forward/backward of micro-batches whose advantages are all 0 (they carry no "
        "policy gradient). Needs beta=0, since a skipped micro-batch would also lose its KL term."
    )
    mask_truncated_completions: bool = Field(
        False, description="Exclude completions that hit max_completion_length from the loss (DAPO, TRL name)."
    )
    top_entropy_quantile: float = Field(
        1.0, ge=0.0, le=1.0, description="rho of 'Beyond the 80/20 Rule' (arXiv 2506.01939; TRL name): keep the "
        "policy term only on tokens whose entropy is at or above the (1 - rho) quantile of the micro-batch's valid "
        "tokens. 1.0 keeps all tokens, 0.0 only the highest-entropy one; the paper uses 0.2. The KL term and the "
        "loss denominators are not masked (TRL)."
    )

    # ---------------------------------------------------------------- batch shaping (orchestrator)
    replay_buffer_size: int = Field(
        0, ge=0, description="Keep the best this-many groups with reward std > 0 in a min-heap scored by "
        "sum_i |A_i| x std(rewards); a batch's zero-std groups are replaced by groups drawn from it in proportion "
        "to score (TRL experimental GRPOWithReplayBuffer). Replayed groups are exempt from max_staleness. Counted "
        "as the cumulative metric replayed_groups. 0 disables it. Needs dynamic_sampling=false."
    )
    replay_recompute_logps: bool = Field(
        True, description="For replayed rows, replace vLLM's (stale) sampling logprobs by the trainer's own old "
        "logprobs, so their stale-policy IS weight is exactly 1 and OPSM sees no drift: the row is treated as "
        "on-policy. False keeps vLLM's logprobs, so IS truncates/masks the row by its real staleness (axolotl name)."
    )
    reroll_start_fraction: float = Field(
        1.0, ge=0.0, le=1.0, description="Deferred re-roll (axolotl name): prompts whose whole group scored ~0 "
        "(every weighted reward within 1e-6 of 0) wait in a FIFO and are generated again, before fresh prompts, "
        "once the trainer reaches ceil(reroll_start_fraction x max_steps) steps (read from the policy version x "
        "vllm_sync_interval). Counted as the cumulative metric rerolled_groups. 1.0 disables it."
    )
    reroll_max_groups: int = Field(
        1, ge=1, description="Deferred re-roll: at most this many re-rolled prompts per batch's worth "
        "(groups_per_step) of generation requests (axolotl name)."
    )

    # ---------------------------------------------------------------- stale-rollout correction
    vllm_importance_sampling_correction: bool = Field(
        True, description="Weight each token by rho = exp(trainer old logp - vLLM sampling logp) (TRL name)."
    )
    vllm_importance_sampling_mode: ISMode = Field(
        "token_truncate", description="How rho is bounded: truncate (clamp) or mask (zero), per token or per sequence."
    )
    vllm_importance_sampling_cap: float = Field(
        3.0,
        gt=0.0,
        validation_alias=AliasChoices("vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"),
        description="Upper bound C on rho (TRL `vllm_importance_sampling_cap` / `_clip_max`).",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0.0, description="Optional lower bound on rho (TRL name)."
    )
    max_staleness: int = Field(
        2, ge=0, description="Groups generated more than this many policy versions ago are dropped (and counted)."
    )

    # ---------------------------------------------------------------- rewards
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
    reward_url: str | None = Field(
        None, pattern=r"^https?://[^\s/]+", description="Base URL of a running reward service "
        "(`python -m async_grpo.rewards.server`, e.g. http://reward:8080): groups are scored there instead of in "
        "a local process pool. None: the env ASYNC_GRPO_REWARD_URL (set by the kubernetes launcher when "
        "reward_replicas > 0), else a local pool of reward_num_workers processes."
    )

    # ---------------------------------------------------------------- async pipeline
    vllm_sync_interval: int = Field(1, ge=1, description="Push weights to vLLM every this many optimizer steps.")
    max_inflight_groups: int = Field(
        8, ge=1, description="Generation requests (one per group) in flight at once; gives backpressure."
    )
    streaming_min_groups: int | None = Field(
        None, ge=1, description="Streaming group scoring (axolotl name): the orchestrator emits a step's groups to "
        "the trainer in chunks of this many scored groups, and the trainer runs the forward/backward of a chunk "
        "while later groups of the same step are still being generated and scored. The optimizer step equals the "
        "unstreamed one (losses are normalized once the step's last chunk arrived). Needs groups_per_step and "
        "per_device_train_batch_size to be multiples of it (in groups / completions), scale_rewards != batch, "
        "multi_objective_aggregation=sum_then_normalize and no rollout reuse (steps_per_generation = mini_epochs "
        "= num_iterations = 1). None: whole steps."
    )

    # ---------------------------------------------------------------- data producer (ProducerConfig)
    data_producer: str | None = Field(
        None, description="Bring your own rollout source: `pkg.module:factory` or `path/file.py:factory`, called "
        "as factory(config, tokenizer) and returning an object with the DataProducer protocol "
        "(`async_grpo.orchestrator.producer`). None: the builtin vLLM orchestrator."
    )
    steps_per_generation: int = Field(
        1, ge=1, description="Optimizer steps per produced rollout (TRL name): one rollout holds this many steps' "
        "batches, generated together."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer steps on each step batch before moving on (TRL `num_iterations`, the mu of "
        "GRPO, arXiv 2402.03300 Alg. 1). Above 1 the old logprobs are computed once, before the rollout's first "
        "update, so the clipped ratio pi_theta/pi_old is no longer identically 1."
    )
    mini_epochs: int = Field(
        1, ge=1, description="Passes over a whole rollout (all its step batches, in order) before the next one "
        "(axolotl ProducerConfig name). Old logprobs are computed once per rollout, as for num_iterations."
    )
    max_rollouts: int | None = Field(
        None, ge=1, description="Stop after this many produce-then-train rounds even if max_steps is not reached "
        "(axolotl ProducerConfig name). None: no limit."
    )
    prefetch_depth: int = Field(
        2, ge=1, description="Rollouts produced ahead of training at most (axolotl ProducerConfig name): the "
        "builtin orchestrator's queue holds prefetch_depth x steps_per_generation step batches. Deeper keeps "
        "vLLM busier at the cost of staleness (bounded separately by max_staleness)."
    )
    sync_warmup_rollouts: int = Field(
        0, ge=0, description="The first this-many rollouts are generated strictly on-policy (axolotl "
        "ProducerConfig name): the orchestrator waits for the weights of the step that will consume them "
        "(staleness 0) before launching, so a cold policy bootstraps from fresh samples; later rollouts run ahead "
        "up to max_staleness."
    )
    rollout_timeout_s: float = Field(
        300.0, gt=0.0, description="The trainer fails if no rollout group arrives within this many seconds."
    )

    # ---------------------------------------------------------------- inference
    vllm_url: str | None = Field(None, description="Attach to a running vLLM server instead of starting one.")
    vllm_port: int = Field(0, ge=0, le=65535, description="Port for the launched server; 0 picks a free one.")
    vllm_dtype: str = Field("float32", description="dtype the launched vLLM server runs the model in.")
    vllm_max_model_len: int = Field(512, ge=16, description="vLLM --max-model-len (tokens).")
    vllm_kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build (GiB).")
    vllm_startup_timeout_s: float = Field(300.0, gt=0.0, description="Wait this long for vLLM /health (seconds).")
    vllm_request_timeout_s: float = Field(120.0, gt=0.0, description="Timeout for one generation request (seconds).")
    vllm_extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` flags.")
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Weight-transfer data plane: nccl on GPU, gloo on CPU; auto picks by device."
    )
    weight_sync_timeout_s: float = Field(300.0, gt=0.0, description="Timeout for one weight push (seconds).")

    # ---------------------------------------------------------------- warm start (tiny demo)
    warmup_sft_steps: int = Field(
        0, ge=0, description="Supervised steps on the task's reference answers before GRPO (builtin tasks only)."
    )
    warmup_sft_learning_rate: float = Field(3e-3, gt=0.0, description="Learning rate of the warm-start pass.")

    # ---------------------------------------------------------------- tracking & output
    output_dir: str = Field("runs/tiny", description="Run folder: model, logs, vLLM log, MLflow store.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default `sqlite:///<output_dir>/mlflow.db`."
    )
    mlflow_experiment_name: str = Field("async-grpo", description="MLflow experiment.")
    run_name: str | None = Field(None, description="MLflow run name.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    log_completions_steps: int = Field(10, ge=1, description="Log a table of sample completions every N steps.")
    num_completions_to_print: int = Field(8, ge=1, description="Rows in each sample-completions table (TRL name).")
    save_model: bool = Field(True, description="Save the final HF checkpoint and log it to MLflow.")

    @model_validator(mode="after")
    def _check_consistency(self) -> GRPOConfig:
        """Cross-field checks; each error names the field and the fix."""
        completions = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if completions % self.num_generations != 0:
            raise ValueError(
                f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions per step "
                f"is not a multiple of num_generations={self.num_generations}; every step must hold whole groups. "
                f"Fix: set per_device_train_batch_size to a multiple of {self.num_generations}."
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has "
                f"{len(self.reward_funcs)}. Fix: give one weight per reward function, or drop reward_weights."
            )
        if self.vllm_importance_sampling_clip_min is not None and (
            self.vllm_importance_sampling_clip_min >= self.vllm_importance_sampling_cap
        ):
            raise ValueError(
                "vllm_importance_sampling_clip_min must be below vllm_importance_sampling_cap. "
                "Fix: lower clip_min or raise the cap."
            )
        if self.use_liger_kernel and self.importance_sampling_level == "sequence" and self.loss_type in ("cispo", "sapo"):
            raise ValueError(
                f"use_liger_kernel: liger-kernel 0.8.5 has no sequence-level importance sampling for "
                f"loss_type={self.loss_type}. Fix: set use_liger_kernel=false or importance_sampling_level=token."
            )
        if self.fsdp and (self.logprob_chunk_size is not None or self.use_liger_kernel
                          or self.skip_zero_advantage_batches):
            raise ValueError(
                "fsdp shards the LM head and runs the same passes on every rank, so it cannot combine with "
                "logprob_chunk_size, use_liger_kernel or skip_zero_advantage_batches. Fix: unset those, or set "
                "fsdp=false."
            )
        if self.loss_type == "cispo" and self.epsilon_high_value < 1.0:
            raise ValueError(
                f"loss_type=cispo caps the importance ratio itself at epsilon_high (epsilon_max of ScaleRL, "
                f"arXiv 2510.13786), but epsilon_high is {self.epsilon_high_value}: every on-policy ratio of 1 would "
                "be clamped, which only shrinks the learning rate. Fix: set epsilon_high, e.g. 5.0 (ScaleRL's and "
                "TRL's recommendation)."
            )
        if self.skip_zero_advantage_batches and self.beta > 0:
            raise ValueError(
                "skip_zero_advantage_batches needs beta=0: a skipped micro-batch would lose its KL term. "
                "Fix: set beta=0 or skip_zero_advantage_batches=false."
            )
        if self.replay_buffer_size > 0 and self.dynamic_sampling:
            raise ValueError(
                "replay_buffer_size > 0 has no effect with dynamic_sampling=true: dynamic sampling never lets a "
                "zero-std group into a batch, so there is nothing to replace. Fix: set replay_buffer_size=0 or "
                "dynamic_sampling=false."
            )
        if self.streaming_min_groups is not None:
            k, g = self.streaming_min_groups, self.num_generations
            problems = []
            if self.groups_per_step % k:
                problems.append(f"groups_per_step={self.groups_per_step} is not a multiple of it")
            if (k * g) % self.per_device_train_batch_size:
                problems.append(f"a chunk of {k * g} completions is not a multiple of per_device_train_batch_size="
                                f"{self.per_device_train_batch_size} (micro-batches would straddle chunks)")
            if self.scale_rewards == "batch":
                problems.append("scale_rewards=batch needs the whole step's rewards before any advantage")
            if self.multi_objective_aggregation == "normalize_then_sum":
                problems.append("normalize_then_sum z-scores across the whole step")
            if self.rollout_reuse > 1:
                problems.append("steps_per_generation/mini_epochs/num_iterations > 1 reuse a complete rollout")
            if problems:
                raise ValueError(
                    f"streaming_min_groups={k}: " + "; ".join(problems) + ". Fix: pick a divisor of groups_per_step "
                    "whose completions fill whole micro-batches, and group scaling without reuse, or unset "
                    "streaming_min_groups."
                )
        if self.data_producer is not None and (self.dynamic_sampling or self.replay_buffer_size or
                                               self.reroll_start_fraction < 1.0 or self.streaming_min_groups):
            raise ValueError(
                "data_producer replaces the builtin orchestrator, which is where dynamic_sampling, "
                "replay_buffer_size, reroll_start_fraction and streaming_min_groups live. Fix: turn those off or "
                "implement them in your producer."
            )
        if self.max_completion_length + 8 > self.vllm_max_model_len:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} leaves no room for a prompt within "
                f"vllm_max_model_len={self.vllm_max_model_len}. Fix: raise vllm_max_model_len."
            )
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def groups_per_step(self) -> int:
        """Prompt groups consumed per optimizer step (single trainer rank)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps // self.num_generations

    @property
    def rollout_reuse(self) -> int:
        """Optimizer steps taken per step batch produced: mini_epochs x num_iterations."""
        return self.mini_epochs * self.num_iterations

    @property
    def reroll_start_step(self) -> int | None:
        """Trainer step from which deferred re-roll runs, ceil(reroll_start_fraction x max_steps); None when off
        (fraction 1.0: the run would end first)."""
        if self.reroll_start_fraction >= 1.0:
            return None
        return math.ceil(self.reroll_start_fraction * self.max_steps)

    @property
    def epsilon_high_value(self) -> float:
        """Upper clip range, `epsilon_high` or `epsilon` (TRL behaviour)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking URI in effect."""
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{Path(self.output_dir).resolve() / 'mlflow.db'}"


ALIASES = {"vllm_importance_sampling_clip_max": "vllm_importance_sampling_cap"}  # TRL's newer name -> ours


def _parse_override(item: str) -> tuple[str, Any]:
    """`key=value` -> (field name, value). Values are parsed as YAML, except for string fields, which keep
    the raw text (so `run_name=2024` stays the string "2024")."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value. Fix: write e.g. learning_rate=1e-5.")
    key, raw = item.split("=", 1)
    key = ALIASES.get(key.strip(), key.strip())
    field = GRPOConfig.model_fields.get(key)
    if field is None:
        raise ConfigError(f"override {key!r}: unknown config field. Fix: check the spelling (see `async-grpo train --help`).")
    if field.annotation in (str, str | None) and raw not in ("", "null", "None", "~"):
        return key, raw
    return key, yaml.safe_load(raw) if raw != "" else None


def format_validation_error(err: ValidationError) -> str:
    """Turn a pydantic error into lines naming each bad field and how to fix it."""
    lines = ["invalid config:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field. Fix: remove it or check the spelling against GRPOConfig"
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg} (got {e['input']!r}). Fix: give a value that satisfies this"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> GRPOConfig:
    """Load a YAML config and apply `key=value` overrides (values parsed as YAML).

    Raises:
        ConfigError: the file is missing or not a mapping, an override is malformed, or a
            value is invalid; the message names the field and the fix.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist. Fix: pass a YAML file such as examples/tiny_cpu.yaml.")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a YAML mapping of field: value.")
        data.update({ALIASES.get(k, k): v for k, v in loaded.items()})
    for item in overrides or []:
        key, value = _parse_override(item)
        data[key] = value
    try:
        return GRPOConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def dump_config(config: GRPOConfig) -> str:
    """The resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
