"""Builders: each role of a run, made from the config (the runner's `setup` calls them in order).

Pure construction, no loop: the model folder, the supervised warm start, the learner (one process or several
ranks), the rollout producer (the builtin vLLM orchestrator behind the rollout queue, or a user `DataProducer`)
and the batch-shaping state. Each raises a clear `ValueError` naming the field and the fix on bad input.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_grpo import hub
from async_grpo.algorithms import LossSettings
from async_grpo.config import GRPOConfig
from async_grpo.data import PromptItem, PromptSampler, encode_prompt
from async_grpo.distillation.rollout import with_teacher
from async_grpo.inference.client import GenerationClient
from async_grpo.inference.health import InferenceHealth
from async_grpo.orchestrator.batch_shaping import ReplayBuffer, RerollQueue
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.producer import ProducerConfig, RunProducer, VLLMProducer, load_data_producer
from async_grpo.orchestrator.rollout import Rollout, SamplingSettings
from async_grpo.runner import peft_setup, tool_setup
from async_grpo.trainer.distributed import DataParallelLearner, DistInfo
from async_grpo.trainer.lr_schedule import LRSchedule, warmup_steps
from async_grpo.trainer.protocol import Learner
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue
from async_grpo.transports.scorer import Scorer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase
    from vllm.distributed.weight_transfer import WeightSource

    from async_grpo.transports.weights.push import WeightPush

logger = logging.getLogger(__name__)


def resolve_model_path(config: GRPOConfig) -> Path:
    """The policy's Hugging Face folder: `model_name_or_path` (a local folder, or a hub id resolved to its
    snapshot in the HF cache, downloaded when the hub is reachable: `hub.snapshot`), or the tiny model built
    under `<output_dir>/tiny-model` for `builtin:tiny`. The vLLM server is given the same folder.

    Raises:
        ValueError: not a local folder with a config.json; `hub.HubUnavailable` (a ValueError) for a hub id that
            is neither reachable nor cached.
    """
    if config.model_name_or_path == "builtin:tiny":
        from async_grpo.tiny_model import ensure_tiny_model

        return ensure_tiny_model(Path(config.output_dir) / "tiny-model", seed=config.seed)
    path = Path(config.model_name_or_path)
    if hub.looks_like_repo_id(config.model_name_or_path):
        path = hub.snapshot(config.model_name_or_path, revision=(config.model_init_kwargs or {}).get("revision"))
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model_name_or_path={config.model_name_or_path!r} is not a local HF model folder (no config.json). "
            "Fix: point it at a saved model, give a hub id (org/name), or use builtin:tiny."
        )
    check_tied_embeddings(path, config)
    return path


def check_tied_embeddings(path: Path, config: GRPOConfig) -> None:
    """Flag a model with tied input/output embeddings where its weight push is not verified.

    The gloo (CPU) push re-ties vLLM's LM head after every reload (`transports.weights.gloo.retie_lm_head`;
    tests/integration/test_weight_sync.py checks a tied model's logprobs after a push). vLLM's own NCCL engine relies
    on the tied parameter being updated in place, which is not verified yet: a warning says how to check it.
    """
    import json

    from async_grpo.transports.weights.sync import resolve_backend

    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied and resolve_backend(config.weight_sync.weight_sync_backend) != "gloo":
        logger.warning(
            "%s ties its embeddings; the NCCL weight push of tied models is not verified yet: compare "
            "vLLM's logprobs with the trainer's after the first push "
            "(sampling/sampling_logp_difference).",
            path,
        )


def follower_model_path(config: GRPOConfig) -> Path:
    """The model folder a trainer rank > 0 reads (rank 0 built the tiny model before the ranks met)."""
    if config.model_name_or_path == "builtin:tiny":
        return Path(config.output_dir) / "tiny-model"
    if hub.looks_like_repo_id(config.model_name_or_path):
        return hub.snapshot(config.model_name_or_path, revision=(config.model_init_kwargs or {}).get("revision"))
    return Path(config.model_name_or_path)


def load_policy(config: GRPOConfig, path: Path, *, weights: bool = True) -> Any:
    """The policy in float32 from `path` (`model_init_kwargs`, `trust_remote_code`), with TRL's model options
    (`gradient_checkpointing`, `disable_dropout`) applied; `weights=False` builds it from the config only (trainer
    ranks > 0, which receive rank 0's weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from async_grpo.trainer.policy_setup import prepare_policy

    kwargs = {k: v for k, v in (config.model_init_kwargs or {}).items() if k not in ("dtype", "torch_dtype")}
    remote = config.trust_remote_code
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=remote, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path, trust_remote_code=remote), dtype=torch.float32, trust_remote_code=remote
        )
    return prepare_policy(
        model,
        gradient_checkpointing=config.compute.gradient_checkpointing,
        gradient_checkpointing_kwargs=config.compute.gradient_checkpointing_kwargs,
        disable_dropout=config.compute.disable_dropout,
    )


def with_epochs_resolved(config: GRPOConfig, num_prompts: int, world_size: int) -> GRPOConfig:
    """`config` with max_steps=-1 (TRL: train num_train_epochs passes) replaced by the step count,
    ceil(num_train_epochs x num_prompts / (groups_per_step x world_size)); unchanged when max_steps > 0.

    Args:
        num_prompts: rows of the training dataset (before the max_prompt_length filter, so every rank agrees).
        world_size: trainer ranks (each step consumes groups_per_step prompts per rank).
    """
    if config.batch.max_steps != -1:
        return config
    steps = max(1, math.ceil(config.batch.num_train_epochs * num_prompts / (config.groups_per_step * world_size)))
    logger.info("max_steps=-1: %g epochs over %d prompts = %d steps", config.batch.num_train_epochs, num_prompts, steps)
    return config.model_copy(update={"max_steps": steps})


def eval_dataset_spec(config: GRPOConfig) -> str | None:
    """Where the held-out prompts come from: `eval_dataset`; else the dataset itself for a builtin task (its
    held-out split) or a hub dataset (its `dataset_test_split`); else None (no held-out evaluation)."""
    data = config.data
    if data.eval_dataset:
        return data.eval_dataset
    return data.dataset if data.dataset.startswith("builtin:") or hub.looks_like_repo_id(data.dataset) else None


def dataset_options(config: GRPOConfig, split: str) -> dict[str, Any]:
    """`load_prompt_items` options of `config` for `split` ("train" / "eval"): the hub configuration and split
    names (TRL ScriptArguments), the system prompt and the chat template's arguments. A separate eval_dataset is
    read with its own default split."""
    data = config.data
    split_name = (
        data.dataset_train_split if split == "train" else (data.dataset_test_split if not data.eval_dataset else None)
    )
    return {
        "config_name": data.dataset_config,
        "split_name": split_name,
        "system_prompt": data.system_prompt,
        "chat_template_kwargs": data.chat_template_kwargs,
    }


def eval_every(config: GRPOConfig) -> int | None:
    """Steps between periodic held-out evaluations (eval_strategy=steps): eval_steps, a fraction of max_steps
    when below 1 (TRL: ceil), logging_steps when None; None when eval_strategy=no."""
    data = config.data
    if data.eval_strategy != "steps":
        return None
    if data.eval_steps is None:
        return config.tracking.logging_steps
    if data.eval_steps < 1:
        return max(1, math.ceil(data.eval_steps * config.batch.max_steps))
    return int(data.eval_steps)


def seed_trainer(config: GRPOConfig) -> None:
    """Seed this trainer process from `seed`; with `full_determinism` through transformers'
    `enable_full_determinism(seed)` (what TRL's option calls: seeds and `torch.use_deterministic_algorithms(True)`),
    else `torch.manual_seed(seed)`. Every rank calls it before building its model."""
    if config.full_determinism:
        from transformers import enable_full_determinism

        enable_full_determinism(config.seed)
    else:
        import torch

        torch.manual_seed(config.seed)


def check_warm_start(config: GRPOConfig) -> None:
    """Refuse a warm start the data cannot feed (before anything starts).

    Raises:
        ValueError: warmup_sft_steps > 0 on a dataset that is not a builtin task.
    """
    if config.data.warmup_sft_steps and not config.data.dataset.startswith("builtin:"):
        raise ValueError(
            "warmup_sft_steps > 0 needs a builtin dataset (it trains on the task's answers). "
            "Fix: set warmup_sft_steps=0."
        )


HELD_OUT_WARM_START_PAIRS = 64  # held-out reference completions the warm start is checked on


def warm_start(
    config: GRPOConfig,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tool_schemas: list[dict],
    after_step: Callable[[float, int], None] | None = None,
) -> dict[str, float] | None:
    """The supervised warm start on a builtin task's reference answers (`warmup_sft_steps`), or on its reference
    conversations for a tool-calling task (tool results are context, never trained; rendered with `tool_schemas`,
    the rollout's offered tools), then its check on the task's held-out split (`trainer.sft.warm_start_report`:
    teacher-forced, on items it never trained on); a warm start that did not converge is logged as a warning.
    `after_step(seconds, padded_tokens)` is called after each SFT step (`resource_sharing.FasterThreads`); None:
    nothing.

    Returns:
        None when off, else the metrics `warmup/sft_loss` (the final training loss, nats per token) and
        `warmup/heldout_token_accuracy`, `warmup/heldout_sequence_accuracy`, `warmup/heldout_loss`.
    """
    if config.data.warmup_sft_steps == 0:
        return None
    check_warm_start(config)
    from async_grpo.tasks import get_task
    from async_grpo.trainer.sft import supervised_warm_start, warm_start_report

    task = get_task(config.data.dataset.removeprefix("builtin:"))
    held_out = [(row["prompt"], row["answer"]) for row in task.eval_dataset().select(range(HELD_OUT_WARM_START_PAIRS))]
    if task.transcript is not None:  # multi-turn reference conversations (tool calls): one pair per assistant turn
        pairs = tool_setup.warm_start_pairs(config, task, tokenizer, 2048, tool_schemas)
        conversations = [task.transcript(_prompt_text(p), a, None) for p, a in held_out]  # the likeliest turns
        checks = tool_setup.warm_start_pairs(config, task, tokenizer, 0, tool_schemas, conversations)
    else:
        pairs = [_answer_pair(tokenizer, p, c) for p, c in task.sft_examples(config.seed, 4096)]
        checks = [_answer_pair(tokenizer, p, c) for p, c in held_out]
    loss = supervised_warm_start(
        model,
        pairs,
        steps=config.data.warmup_sft_steps,
        learning_rate=config.data.warmup_sft_learning_rate,
        pad_token_id=tokenizer.pad_token_id,
        seed=config.seed,
        after_step=after_step,
    )
    report = warm_start_report(model, checks, pad_token_id=tokenizer.pad_token_id)
    if not report.converged:
        logger.warning(
            "the warm start did not converge: it reproduces %.2f of the held-out reference turns (token accuracy "
            "%.3f, loss %.3f) after %d steps at learning rate %g; GRPO may find little reward to learn from. Fix: "
            "lower warmup_sft_learning_rate or raise warmup_sft_steps",
            report.sequence_accuracy,
            report.token_accuracy,
            report.loss,
            config.data.warmup_sft_steps,
            config.data.warmup_sft_learning_rate,
        )
    return {
        "warmup/sft_loss": loss,
        "warmup/heldout_token_accuracy": report.token_accuracy,
        "warmup/heldout_sequence_accuracy": report.sequence_accuracy,
        "warmup/heldout_loss": report.loss,
    }


def _prompt_text(prompt: Any) -> str:
    """The text of a builtin task's prompt: the string, or a conversational prompt's last (user) message."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def _answer_pair(tokenizer: PreTrainedTokenizerBase, prompt: Any, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + EOS): one supervised pair of a single-turn task (TRL's prompt-completion SFT)."""
    return encode_prompt(tokenizer, prompt), tokenizer.encode(answer, add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]


def build_rollout(
    config: GRPOConfig,
    scorer: Scorer,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    items: list[PromptItem],
    tool_service: tuple[str, str | None] | None = None,
) -> Rollout:
    """The run's rollout: `SingleTurnRollout`, or the multi-turn `EnvironmentRollout` when `tools` are declared
    or an `environment` is set (`tool_setup.build_rollout`: tools, prompts and chat template checked here, before
    anything starts; tool calls run on `tool_service` = (URL, token) when given). It records episode spans
    (`RolloutGroup.spans`) only when `tracking.log_traces_steps` > 0."""
    return tool_setup.build_rollout(config, scorer, tokenizer, decode, items, tool_service)


def loss_settings(config: GRPOConfig) -> LossSettings:
    """The loss options of `config` (TRL names), from its loss, off_policy, sampling, batch_shaping and distillation
    sections (`distillation_weight` 0 when the run has no teacher)."""
    loss, off = config.loss, config.off_policy
    return LossSettings(
        loss_type=loss.loss_type, epsilon=loss.epsilon, epsilon_high=config.epsilon_high_value, beta=loss.beta,
        max_completion_length=config.sampling.max_completion_length,
        mask_truncated_completions=loss.mask_truncated_completions,
        vllm_importance_sampling_correction=off.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=off.vllm_importance_sampling_mode,
        vllm_importance_sampling_cap=off.vllm_importance_sampling_cap,
        vllm_importance_sampling_clip_min=off.vllm_importance_sampling_clip_min,
        delta=loss.delta, importance_sampling_level=loss.importance_sampling_level,
        use_bias_correction_kl=loss.use_bias_correction_kl, off_policy_mask_threshold=off.off_policy_mask_threshold,
        sapo_temperature_pos=loss.sapo_temperature_pos, sapo_temperature_neg=loss.sapo_temperature_neg,
        top_entropy_quantile=loss.top_entropy_quantile,
        replay_recompute_logps=config.batch_shaping.replay_recompute_logps,
        temperature=config.sampling.temperature, use_liger_kernel=loss.use_liger_kernel,
        off_policy_clip=off.off_policy_clip, kl_bias_correction_ratio=off.kl_bias_correction_ratio,
        seq_logprob_error_threshold=off.seq_logprob_error_threshold,
        distillation_weight=config.distillation.distillation_weight if config.distillation.enabled else 0.0,
        distillation_only=config.distillation.distillation_only,
        distillation_baseline=config.distillation.distillation_baseline == "leave_one_out",
        distillation_loss=config.distillation.distillation_loss,
    )  # fmt: skip


def build_local_learner(config: GRPOConfig, model: torch.nn.Module, pad_token_id: int) -> GRPOLearner:
    """This rank's `GRPOLearner` (every rank builds the same one; it shards the model under `fsdp`), or with use_peft
    a `trainer.peft.PeftLearner` over the LoRA-wrapped model (`runner.peft_setup.lora_policy`)."""
    learner_cls, model = peft_setup.lora_policy(config, model) if config.peft.use_peft else (GRPOLearner, model)
    return learner_cls(
        model, learning_rate=config.optim.learning_rate, weight_decay=config.optim.weight_decay,
        max_grad_norm=config.optim.max_grad_norm, micro_batch_size=config.batch.per_device_train_batch_size,
        pad_token_id=pad_token_id, logprob_chunk_size=config.compute.logprob_chunk_size,
        skip_zero_advantage_batches=config.compute.skip_zero_advantage_batches, loss=loss_settings(config),
        fsdp=config.compute.fsdp, mixed_precision="bf16" if config.compute.bf16 else None, lr_schedule=lr_schedule(config),
        adam_betas=(config.optim.adam_beta1, config.optim.adam_beta2), adam_epsilon=config.optim.adam_epsilon,
        max_tokens_per_microbatch=config.compute.max_tokens_per_microbatch, batch_flattening=config.compute.batch_flattening,
        group_by_length=config.compute.group_by_length, share_prompt_prefix=config.compute.share_prompt_prefix,
    )  # fmt: skip


def lr_schedule(config: GRPOConfig) -> LRSchedule:
    """The learning-rate schedule of `config` (lr_scheduler_type over max_steps with its warm-up).

    Raises:
        ValueError: max_steps is still -1 (resolve it with `with_epochs_resolved` first).
    """
    o, max_steps = config.optim, config.batch.max_steps
    if max_steps < 1:
        raise ValueError("max_steps=-1 must be resolved from num_train_epochs before the learner is built.")
    return LRSchedule(
        o.lr_scheduler_type,
        max_steps,
        warmup_steps(o.warmup_steps, o.warmup_ratio, max_steps),
        dict(o.lr_scheduler_kwargs or {}),
    )


def build_learner(config: GRPOConfig, model: torch.nn.Module, pad_token_id: int, info: DistInfo) -> Learner:
    """Rank 0's `Learner`: the local one, driving the other ranks when there are several."""
    local = build_local_learner(config, model, pad_token_id)
    return DataParallelLearner(local, info) if info.world_size > 1 else local


def setup_batch_shaping(config: GRPOConfig) -> dict:
    """The orchestrator's optional batch-shaping state from `config`: keyword arguments `replay`
    (a seeded `ReplayBuffer` when replay_buffer_size > 0) and `reroll` (a `RerollQueue` when
    reroll_start_fraction < 1), each None when off."""
    replay = (
        ReplayBuffer(config.batch_shaping.replay_buffer_size, random.Random(config.seed))
        if config.batch_shaping.replay_buffer_size > 0
        else None
    )
    start = config.reroll_start_step
    reroll = (
        RerollQueue(start_step=start, max_per_batch=config.batch_shaping.reroll_max_groups)
        if start is not None
        else None
    )
    return {"replay": replay, "reroll": reroll}


def sampling_settings(config: GRPOConfig, *, evaluation: bool = False) -> SamplingSettings:
    """Rollout sampling settings (TRL names); with `evaluation`, `num_generations_eval` samples at
    `eval_temperature` (the training temperature when unset)."""
    s = config.sampling
    extras = {"min_p": s.min_p, "repetition_penalty": s.repetition_penalty, "generation_kwargs": s.generation_kwargs}
    if evaluation:
        temperature = s.temperature if config.data.eval_temperature is None else config.data.eval_temperature
        return SamplingSettings(
            config.data.num_generations_eval, s.max_completion_length, temperature, s.top_p, s.top_k, **extras
        )
    return SamplingSettings(s.num_generations, s.max_completion_length, s.temperature, s.top_p, s.top_k, **extras)


def build_producer(
    config: GRPOConfig,
    *,
    tokenizer: PreTrainedTokenizerBase,
    train_items: list[PromptItem],
    rollout: Rollout,
    client_factory: Callable[[], GenerationClient],
    reward_names: list[str],
    reward_weights: list[float],
    version: PolicyVersion,
    drops: DropCounter,
    world_size: int,
    health: InferenceHealth | None = None,
) -> RunProducer:
    """The run's rollout producer: a user `data_producer`, or the builtin `VLLMProducer` over a (not yet
    started) `Orchestrator` filling a bounded `RolloutQueue`; `health` is the run's `InferenceHealth` gate. When the
    run distills, the orchestrator's rollout is `rollout` wrapped to ask the teacher (`distillation.with_teacher`);
    held-out evaluation keeps `rollout` itself. The
    orchestrator draws its prompts from the seeded `PromptSampler` through its `PromptLedger`, so a checkpoint
    saves the position of the prompts trained rather than drawn.

    Raises:
        ValueError: `data_producer` does not resolve or lacks the protocol, or the run distills without a
            `teacher_url` (`distillation.with_teacher`).
    """
    prod = config.producer
    if prod.data_producer:
        return load_data_producer(prod.data_producer, config, tokenizer)
    groups_per_step = config.groups_per_step * world_size  # TRL: per-device batch x accumulation x ranks
    chunks_per_step = groups_per_step // (prod.streaming_min_groups or groups_per_step)
    queue = RolloutQueue(
        prod.prefetch_depth * prod.steps_per_generation * chunks_per_step, config.off_policy.max_staleness, drops
    )
    orchestrator = Orchestrator(
        client_factory=client_factory, rollout=with_teacher(config.distillation, rollout),  # evaluation: no teacher
        prompts=PromptSampler(train_items, config.seed, shuffle=config.data.shuffle_dataset),
        sampling=sampling_settings(config), reward_names=reward_names, reward_weights=reward_weights,
        scale_rewards=config.rewards.scale_rewards,
        multi_objective_aggregation=config.rewards.multi_objective_aggregation,
        dynamic_sampling=config.batch_shaping.dynamic_sampling, max_gen_batches=config.batch_shaping.max_gen_batches,
        groups_per_step=groups_per_step, streaming_min_groups=prod.streaming_min_groups,
        steps_per_generation=prod.steps_per_generation, rollout_reuse=config.rollout_reuse,
        sync_warmup_rollouts=prod.sync_warmup_rollouts, max_staleness=config.off_policy.max_staleness,
        vllm_sync_interval=config.weight_sync.vllm_sync_interval, max_inflight_groups=prod.max_inflight_groups,
        queue=queue, version=version, drops=drops, health=health,
        recovery_timeout_s=config.inference.vllm_recovery_timeout_s,
        reward_failure_timeout_s=config.rewards.reward_failure_timeout_s, **setup_batch_shaping(config),
        full_determinism=config.full_determinism, seed=config.seed,
    )  # fmt: skip
    return VLLMProducer(
        orchestrator,
        queue,
        version,
        ProducerConfig.from_config(config),
        streaming=prod.streaming_min_groups is not None,
        health=health,
    )


def push_source(config: GRPOConfig, learner: Learner) -> WeightSource:
    """The weights a full push sends: the learner's parameters, cast once to a 16-bit `vllm_dtype` on the way
    (`transports.weights.cast`)."""
    from async_grpo.transports.weights.cast import for_server

    return for_server(learner.named_parameters_for_push(), config.inference.vllm_dtype)


def replica_pusher(config: GRPOConfig, learner: Learner, url: str, source: WeightSource | None = None) -> WeightPush:
    """A weight pusher from `learner` to the one vLLM server at `url` (not yet set up): the adapter only with
    vllm_lora_sync (`peft_setup.adapter_pusher`; docs/deploy.md, "LoRA"), else every weight of `source` (default
    `push_source(config, learner)`; the run passes one `FrozenSource` to every replica's pusher under
    weight_sync_overlap) over vLLM's weight transfer."""
    from async_grpo.runner import peft_setup
    from async_grpo.transports.weights.sync import WeightPusher, rendezvous_address

    if config.peft.vllm_lora_sync:
        return peft_setup.adapter_pusher(config, learner, url)
    sync = config.weight_sync
    return WeightPusher(
        source if source is not None else push_source(config, learner),
        url,
        backend=sync.weight_sync_backend,
        timeout_s=sync.weight_sync_timeout_s,
        master_address=rendezvous_address(url),
        mode=sync.weight_sync_mode,
    )


def collective_timeout_s(config: GRPOConfig) -> float:
    """How long trainer ranks > 0 wait on rank 0 in one collective (seconds): rank 0 may be starting vLLM,
    warm-starting, evaluating or waiting for rollouts meanwhile."""
    return max(1800.0, 2 * (config.inference.vllm_startup_timeout_s + config.producer.rollout_timeout_s))
