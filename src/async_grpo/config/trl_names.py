"""What we do with every TRL `GRPOConfig` field that is not one of ours: convert, refuse with the reason, or
accept as a no-op.

A TRL user's flat YAML, or `trl.GRPOConfig(...).to_dict()`, loads into `GRPOConfig`: names that are ours are
fields (`FIELDS`), TRL spellings of our fields are `keys.ALIASES`, and every other TRL name is here:

- CONVERTED: TRL's value needs translating into ours (`fsdp: "full_shard auto_wrap"` -> `fsdp: true`,
  `scale_rewards: true` -> `group`, a TRL `None` that means "derive it" -> our default or the derived value).
- REFUSED: only the values that describe what this trainer does are accepted (`use_vllm: true`,
  `vllm_mode: server`, `fp16: false`); any other value fails validation with the reason and the fix.
- IGNORED: the field cannot change what this trainer computes (HF Trainer plumbing: data loaders, DDP
  buckets, hub tokens, log levels); accepted with any value, and a value off TRL's default is logged.
- PENDING: fields that other work in progress implements. Once their owner adds the field to `GRPOConfig` it
  is ours, and the entry here no longer applies (none are pending now).

`adapt_trl_keys` applies all of this to a mapping before the flat-key mapper; `disposition(name)` says, for
the documentation table (`docs/trl.md`), what happens to one TRL name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

_NOT_YET = "not yet implemented in this trainer"


class Refusal(NamedTuple):
    """A TRL field we accept only at values that describe this trainer.

    Attributes:
        ok: the accepted values (compared with ==, bool and int told apart).
        reason: why other values are refused, and the fix.
    """

    ok: tuple
    reason: str


def _refuse(names: str, ok: tuple, reason: str) -> dict[str, Refusal]:
    return {name: Refusal(ok, reason) for name in names.split()}


REFUSED: dict[str, Refusal] = {
    **_refuse(
        "use_vllm",
        (True,),
        "this trainer always generates with vLLM (an inference server beside the "
        "trainer). Fix: remove it or set use_vllm: true",
    ),
    **_refuse(
        "vllm_mode",
        ("server",),
        "vLLM always runs as its own server here (a subprocess, or a Deployment on "
        "Kubernetes); colocating it in the trainer processes is " + _NOT_YET + ". Fix: vllm_mode: server",
    ),
    **_refuse(
        "vllm_enable_sleep_mode",
        (False,),
        "sleep mode is for a colocated vLLM; ours is a separate server. Fix: remove it",
    ),
    **_refuse(
        "vllm_model_impl",
        ("vllm",),
        "the server runs vLLM's own model implementation; `transformers` is " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse(
        "vllm_structured_outputs_regex",
        (None,),
        "guided decoding changes the sampling distribution the IS "
        "correction compares against; " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse(
        "vllm_server_host",
        ("0.0.0.0",),
        "to attach to a running server give its URL as vllm_server_base_url (or vllm_url). Fix: use that",
    ),
    **_refuse(
        "vllm_server_port",
        (8000,),
        "to attach to a running server give its URL as vllm_server_base_url (or "
        "vllm_url); the port of the server we launch is vllm_port. Fix: use those",
    ),
    **_refuse(
        "use_transformers_continuous_batching use_transformers_paged",
        (False,),
        "generation always runs on vLLM. Fix: remove it",
    ),
    **_refuse("transformers_continuous_batching_config", (None,), "generation always runs on vLLM. Fix: remove it"),
    **_refuse(
        "generation_batch_size",
        (None,),
        "set steps_per_generation instead (here it counts optimizer steps "
        "per rollout, i.e. generation_batch_size / (per_device_train_batch_size x ranks x "
        "gradient_accumulation_steps)). Fix: remove it",
    ),
    **_refuse(
        "fp16",
        (False,),
        "the trainer keeps float32 master weights and supports bf16 autocast only. Fix: remove it, or use bf16: true",
    ),
    **_refuse("tf32", (None, False), "TF32 matmuls are " + _NOT_YET + ". Fix: remove it"),
    **_refuse(
        "cast_lm_head_to_fp32",
        (False,),
        "the LM head runs like the rest of the model (float32, or bf16 "
        "autocast with float32 logits for the log-softmax); " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse(
        "optim",
        ("adamw_torch", "adamw_torch_fused"),
        "the optimizer is torch's AdamW (adam_beta1, "
        "adam_beta2, adam_epsilon, weight_decay); other optimizers are " + _NOT_YET + ". Fix: optim: "
        "adamw_torch",
    ),
    **_refuse("optim_args optim_target_modules", (None,), "only AdamW is available. Fix: remove it"),
    **_refuse(
        "average_tokens_across_devices",
        (True,),
        "dapo/cispo always normalize by the tokens of all ranks (TRL's default). Fix: remove it",
    ),
    **_refuse("label_smoothing_factor", (0, 0.0), "the GRPO loss has no label smoothing. Fix: remove it"),
    **_refuse("torch_compile", (False,), "torch.compile of the policy is " + _NOT_YET + ". Fix: remove it"),
    **_refuse(
        "torch_compile_backend torch_compile_mode",
        (None,),
        "torch.compile of the policy is " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse(
        "liger_kernel_config",
        (None,),
        "use_liger_kernel here is the fused GRPO loss only; patching the "
        "model with liger kernels is " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse("neftune_noise_alpha", (None,), "NEFTune embedding noise is an SFT technique. Fix: remove it"),
    **_refuse(
        "auto_find_batch_size", (False,), "the batch geometry must be fixed (whole groups per step). Fix: remove it"
    ),
    **_refuse("logging_strategy", ("steps",), "metrics are logged every logging_steps steps. Fix: remove it"),
    **_refuse("eval_delay", (0, 0.0), "periodic evaluation starts at step eval_steps. Fix: remove it"),
    **_refuse(
        "push_to_hub",
        (False,),
        "the pipeline registers the model in the MLflow model registry "
        "(register_model); pushing to the hub from the trainer is " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse("log_completions_hub_repo", (None,), "completion tables go to MLflow. Fix: remove it"),
    **_refuse(
        "load_best_model_at_end",
        (False,),
        "the pipeline's evaluate step keeps the final model and "
        "register_model keeps the best (champion alias). Fix: remove it",
    ),
    **_refuse("data_seed", (None,), "the data order follows seed. Fix: remove it and set seed"),
    **_refuse(
        "parallelism_config",
        (None,),
        "context / tensor parallel training is " + _NOT_YET + " (several "
        "trainer ranks run data parallel, with fsdp: true sharded). Fix: remove it",
    ),
    **_refuse(
        "deepspeed",
        (None,),
        "DeepSpeed is not used; several trainer ranks shard with fsdp: true (FSDP2). Fix: remove it",
    ),
    **_refuse(
        "train_sampling_strategy",
        ("random",),
        "prompts are drawn in a seeded order (shuffle_dataset: false keeps the dataset's order). Fix: remove it",
    ),
    **_refuse("router_aux_loss_coef", (None,), "the MoE load-balancing loss is " + _NOT_YET + ". Fix: remove it"),
    **_refuse(
        "sync_ref_model",
        (False,),
        "the reference is the initial policy; TR-DPO style reference syncing is " + _NOT_YET + ". Fix: remove it",
    ),
    **_refuse(
        "entropy_coef", (0, 0.0), "an entropy bonus is " + _NOT_YET + " (top_entropy_quantile is). Fix: remove it"
    ),
    **_refuse("use_adaptive_entropy", (False,), "an adaptive entropy bonus is " + _NOT_YET + ". Fix: remove it"),
    **_refuse(
        "dtype torch_dtype",
        (None, "float32", "auto"),
        "the trainer keeps float32 master weights (TRL "
        "ModelConfig name). Fix: remove it, and use bf16: true for bfloat16 compute",
    ),
    **_refuse(
        "use_rslora use_dora",
        (False,),
        "rsLoRA / DoRA are " + _NOT_YET + " (TRL ModelConfig name; use_peft trains plain LoRA). Fix: remove it",
    ),
    **_refuse(
        "lora_modules_to_save",
        (None,),
        "training whole modules beside the adapters is "
        + _NOT_YET
        + " (TRL ModelConfig name). Fix: remove it, or add those modules to lora_target_modules",
    ),
    **_refuse(
        "load_in_4bit load_in_8bit",
        (False,),
        "quantized training (QLoRA) is " + _NOT_YET + " (TRL ModelConfig name). Fix: remove it",
    ),
    **_refuse(
        "save_strategy",
        ("steps", "no"),  # "no" (or YAML's False) becomes save_steps: 0 before this check (`_save_strategy_no`)
        "checkpoints are written every save_steps optimizer steps; per-epoch "
        "or best-metric saving is " + _NOT_YET + ". Fix: remove it, and set save_steps (0: no checkpoints)",
    ),
    **_refuse("dataset_streaming", (False,), "datasets are loaded whole (TRL ScriptArguments name). Fix: remove it"),
}


def _ignore(names: str, default: Any, reason: str) -> dict[str, tuple[Any, str]]:
    return {name: (default, reason) for name in names.split()}


_LOADER = "prompts come from the rollout orchestrator, not a torch DataLoader"
_DDP = "gradients are averaged in one flat all-reduce (or FSDP2), not through DDP"
_HF_EVAL = "held-out evaluation samples with vLLM and scores with the reward functions; Trainer.evaluate is not used"
_HUB = "only used with push_to_hub, which is refused"
_LOGS = "logging goes to MLflow and Python's logging"
# TRL name -> (TRL's default, why it changes nothing here).
IGNORED: dict[str, tuple[Any, str]] = {
    **_ignore("dataloader_num_workers", 0, _LOADER),
    **_ignore("dataloader_drop_last", False, _LOADER),
    **_ignore("dataloader_pin_memory", True, _LOADER),
    **_ignore("dataloader_persistent_workers", False, _LOADER),
    **_ignore("dataloader_prefetch_factor dataloader_multiprocessing_context", None, _LOADER),
    **_ignore("dataloader_in_order", True, _LOADER),
    **_ignore("remove_unused_columns", False, "every dataset column reaches the reward functions"),
    **_ignore("label_names", None, _LOADER),
    **_ignore("length_column_name", "length", _LOADER),
    **_ignore("accelerator_config", None, "accelerate's Accelerator does not feed the trainer here"),
    **_ignore("ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph", None, _DDP),
    **_ignore("ddp_backend", None, "torchrun ranks use nccl on GPU and gloo on CPU"),
    **_ignore(
        "ddp_timeout", 1800, "collectives wait a timeout derived from vllm_startup_timeout_s and rollout_timeout_s"
    ),
    **_ignore("local_rank", -1, "the rank comes from torchrun's environment"),
    **_ignore("use_cpu", False, "the trainer uses CUDA when the machine has it, else the CPU"),
    **_ignore("fsdp_config", None, "fsdp: true shards every decoder layer and the root with FSDP2 defaults"),
    **_ignore("bf16_full_eval fp16_full_eval", False, _HF_EVAL),
    **_ignore("per_device_eval_batch_size", 8, _HF_EVAL),
    **_ignore("prediction_loss_only", False, _HF_EVAL),
    **_ignore("eval_do_concat_batches", True, _HF_EVAL),
    **_ignore("eval_use_gather_object", False, _HF_EVAL),
    **_ignore("eval_accumulation_steps", None, _HF_EVAL),
    **_ignore("include_for_metrics", [], _HF_EVAL),
    **_ignore("batch_eval_metrics", False, _HF_EVAL),
    **_ignore("eval_on_start", False, "the held-out reward is always measured before the first step"),
    **_ignore("metric_for_best_model greater_is_better", None, "only used with load_best_model_at_end, refused"),
    **_ignore("hub_token hub_private_repo hub_model_id hub_revision", None, _HUB),
    **_ignore("hub_strategy", "every_save", _HUB),
    **_ignore("hub_always_push", False, _HUB),
    **_ignore("lora_task_type", "CAUSAL_LM", "the policy is always a causal LM (TRL ModelConfig name)"),
    **_ignore("use_cache", False, "the KV cache is vLLM's; training forwards never use one"),
    **_ignore("torch_empty_cache_steps", None, "the allocator is left to PyTorch"),
    **_ignore("logging_first_step", False, _LOGS),
    **_ignore("log_on_each_node", True, _LOGS),
    **_ignore("logging_nan_inf_filter", True, "non-finite metric values are always skipped"),
    **_ignore(
        "include_num_input_tokens_seen", "no", "num_tokens (cumulative prompt + completion tokens) is always logged"
    ),
    **_ignore("log_level", "passive", _LOGS),
    **_ignore("log_level_replica", "warning", _LOGS),
    **_ignore("disable_tqdm", None, "the CLI shows a progress bar on a terminal and sparse lines in logs"),
    **_ignore(
        "project trackio_space_id trackio_bucket_id trackio_static_space_id",
        None,
        "trackio is not a supported tracker (report_to: mlflow)",
    ),
    **_ignore("debug", "", "no debug modes"),
    **_ignore("skip_memory_metrics", True, "memory use is MLflow's system metrics (log_system_metrics)"),
    **_ignore("do_train do_eval do_predict", False, "a run always trains, and evaluates when it has held-out prompts"),
    **_ignore("ds3_gather_for_generation", True, "DeepSpeed is not used"),
    **_ignore("pad_to_multiple_of", "auto", "the trainer pads each micro-batch to its longest row"),
    **_ignore("cache_implementation", None, "generation runs on vLLM"),
    **_ignore("vllm_group_port", 51216, "the weight-transfer rendezvous picks a free port"),
    **_ignore(
        "vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg",
        None,
        "only for loss_type: vespo, which loss_type refuses",
    ),
    **_ignore("ref_model_mixup_alpha ref_model_sync_steps", None, "only with sync_ref_model, which is refused"),
    **_ignore(
        "entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target",
        None,
        "only with use_adaptive_entropy, which is refused",
    ),
    **_ignore("log_multimodal", True, "prompts are text"),
    **_ignore("log_unique_prompts", False, "completion tables have one row per completion"),
    **_ignore(
        "save_only_model",
        False,
        "a checkpoint always holds the full resumable state (save_model: the final model alone)",
    ),
    **_ignore("save_on_each_node", False, "rank 0 writes every checkpoint, to output_dir"),
    **_ignore(
        "enable_jit_checkpoint", False, "checkpoint_on_signal (default true) writes a checkpoint on SIGTERM / SIGINT"
    ),
    **_ignore("restore_callback_states_from_checkpoint", False, "there are no Trainer callbacks to restore"),
    **_ignore("ignore_data_skip", False, "resume restores the prompt sampler's position; no batches are skipped"),
}

# Other work in progress implements these; until the field exists, (TRL default, reason, refuse other values).
# (Empty now: checkpointing and resume are fields of the `checkpoint` section.)
PENDING: dict[str, tuple[Any, str, bool]] = {}


def _scale_rewards(value: Any, data: Mapping[str, Any]) -> Any:
    """TRL also takes a bool: True is "group", False is "none"."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


def _fsdp(value: Any, data: Mapping[str, Any]) -> Any:
    """TRL's `fsdp` is a list or a space-separated string of options; ours is a bool (FSDP2 full sharding)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    options = value.split() if isinstance(value, str) else list(value)
    unsupported = [o for o in options if o not in ("full_shard", "auto_wrap")]
    if unsupported:
        raise ValueError(
            f"fsdp={value!r}: only full sharding (FSDP2, `full_shard auto_wrap`) is available, not "
            f"{unsupported}. Fix: fsdp: true, or remove it."
        )
    return bool(options)


def _derived(default_from: str | None) -> Callable[[Any, Mapping[str, Any]], Any]:
    """TRL's None means "derive it": from another given field (`default_from`), else our default (key dropped)."""

    def convert(value: Any, data: Mapping[str, Any]) -> Any:
        if value is not None:
            return value
        return data.get(default_from, _DROP) if default_from else _DROP

    return convert


_DROP = object()  # a converter's answer: leave the field at our default
# TRL name (ours, or an alias of ours) -> converter(value, whole mapping) giving our value (or _DROP).
CONVERTED: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {
    "scale_rewards": _scale_rewards,
    "fsdp": _fsdp,
    "num_generations_eval": _derived("num_generations"),
    **{
        name: _derived(None)
        for name in (
            "steps_per_generation",
            "vllm_max_model_length",
            "vllm_importance_sampling_cap",
            "num_completions_to_print",
            "output_dir",
            "bf16",
            "gradient_checkpointing_kwargs",
            "warmup_ratio",
            "vllm_gpu_memory_utilization",
            "max_staleness",
            "logging_steps",
        )
    },
}


def disposition(name: str, fields: Mapping[str, Any], aliases: Mapping[str, str]) -> tuple[str, str]:
    """What happens to the TRL field `name`: (kind, detail) with kind one of same, alias, refused, ignored,
    pending, unknown; detail names our field (same, alias) or gives the reason (refused: with the accepted
    values)."""
    if name in fields:
        return "same", str(fields[name].path)
    if name in aliases:
        return "alias", str(fields[aliases[name]].path)
    if name in REFUSED:
        ok = ", ".join(repr(v) for v in REFUSED[name].ok)
        return "refused", f"accepted: {ok}; otherwise refused: {REFUSED[name].reason}"
    if name in IGNORED:
        return "ignored", IGNORED[name][1]
    if name in PENDING:
        return "pending", PENDING[name][1]
    return "unknown", ""


def _same(value: Any, accepted: Any) -> bool:
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def _from_resolved_trl_dump(data: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """A resolved TRL config (`trl.GRPOConfig(...).to_dict()`) holds both generation_batch_size and
    steps_per_generation, which TRL forbids a user to give together; there TRL's steps_per_generation counts
    micro-batches per rank, ours counts optimizer steps: ours = TRL's / gradient_accumulation_steps.

    Raises:
        ValueError: TRL's steps_per_generation is not a multiple of gradient_accumulation_steps (a rollout would
            end inside an optimizer step).
    """
    if data.get("generation_batch_size") is None or data.get("steps_per_generation") is None:
        return data
    out = {k: v for k, v in data.items() if k != "generation_batch_size"}
    gas = int(data.get("gradient_accumulation_steps", 1) or 1)
    if data["steps_per_generation"] % gas:
        raise ValueError(
            f"steps_per_generation={data['steps_per_generation']} (TRL: micro-batches per generation) is "
            f"not a multiple of gradient_accumulation_steps={gas}: a rollout would end inside an "
            "optimizer step. Fix: a multiple of gradient_accumulation_steps."
        )
    out["steps_per_generation"] = data["steps_per_generation"] // gas
    return out


def _save_strategy_no(data: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """TRL's `save_strategy: "no"` (YAML 1.1 reads a bare `no` as False) writes no checkpoints: our `save_steps: 0`,
    whatever `save_steps` says (TRL ignores it then). Other values go on to the REFUSED check ("steps" is ours)."""
    value = data.get("save_strategy")
    if value is None or not (value is False or (isinstance(value, str) and value.lower() == "no")):
        return data
    out = {k: v for k, v in data.items() if k != "save_strategy"}
    out["save_steps"] = 0
    return out


def adapt_trl_keys(data: Mapping[Any, Any], fields: Mapping[str, Any]) -> dict[Any, Any]:
    """`data` (flat keys as a TRL user writes them, any others untouched) with TRL-only names removed and TRL
    values converted to ours.

    Args:
        data: the config mapping as given.
        fields: `keys.FIELDS` (a name that is a field of ours is never treated as TRL-only).

    Returns:
        A new mapping for the flat-key mapper.

    Raises:
        ValueError: a refused field has a value other than the accepted ones; one message lists them all, each
            with the reason and the fix.
    """
    out: dict[Any, Any] = {}
    refused, ignored = [], []
    data = _save_strategy_no(_from_resolved_trl_dump(data))
    for key, value in data.items():
        if (
            not isinstance(key, str)
            or (key in fields and key not in CONVERTED)
            or (key == "optim" and not isinstance(value, str))
        ):  # TRL's `optim` names the optimizer: our section
            out[key] = value
        elif key in CONVERTED:
            converted = CONVERTED[key](value, data)
            if converted is not _DROP:
                out[key] = converted
        elif key in REFUSED:
            if not any(_same(value, ok) for ok in REFUSED[key].ok):
                refused.append(f"{key}={value!r}: {REFUSED[key].reason}.")
        elif key in IGNORED:
            if value != IGNORED[key][0]:
                ignored.append(f"{key}={value!r} ({IGNORED[key][1]})")
        elif key in PENDING:
            default, reason, refuse = PENDING[key]
            if value != default:
                (refused if refuse else ignored).append(
                    f"{key}={value!r}: {reason}. Fix: remove it." if refuse else f"{key}={value!r} ({reason})"
                )
        else:
            out[key] = value
    if refused:
        raise ValueError("TRL field(s) this trainer does not take at these values:\n    " + "\n    ".join(refused))
    if ignored:
        logger.warning("TRL field(s) accepted with no effect here: %s", "; ".join(ignored))
    return out
