"""Run TRL's own GRPOTrainer code on hand-made tensors, as the oracle for parity tests.

``GRPOTrainer._compute_loss`` and ``GRPOTrainer._generate_and_score_completions`` are called unbound
with a ``SimpleNamespace`` standing in for ``self`` that provides exactly the attributes they read.
Model forward passes are replaced by stubs that return given log-prob tensors, generation by a stub
returning given token lists, and reward functions by a stub returning a given ``rewards_per_func``.
``GRPOTrainer._get_per_token_logps_and_entropies`` runs for real, on a copy of a model patched with
TRL's own fused LM head (``trl_fused_model``), as the oracle for per-token logprobs and entropies.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from async_grpo.algorithms import LossSettings

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.trainer import utils as trl_utils
        from trl.trainer.grpo_trainer import GRPOTrainer
        from trl.trainer.utils import add_fused_lm_head
except ImportError:  # trl is a dev dependency; hand-computed tests still run without it
    trl_utils = GRPOTrainer = add_fused_lm_head = None

requires_trl = pytest.mark.skipif(GRPOTrainer is None, reason="trl (dev dependency) is not installed")


def _accelerator(num_processes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        device=torch.device("cpu"),
        num_processes=num_processes,
        process_index=0,
        sync_gradients=True,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
        pad_across_processes=lambda t, dim=0, pad_index=0: t,
    )


def trl_compute_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    ref_logps: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    num_processes: int = 1,
    entropies: torch.Tensor | None = None,
):
    """TRL ``_compute_loss`` in train mode; returns ``(loss, metrics)`` with metrics as floats.

    The options are ``settings``'s, set on TRL's trainer under TRL's names (``epsilon_low`` =
    ``settings.epsilon``). ``entropies`` (B, T) is what the stubbed forward pass reports (zeros when None);
    with ``settings.top_entropy_quantile < 1`` TRL's own ``get_high_entropy_mask`` selects tokens from it.
    """
    batch, length = logps.shape
    entropies = torch.zeros_like(logps) if entropies is None else entropies

    def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == length
        return logps, entropies, None

    fake = SimpleNamespace(
        loss_type=settings.loss_type,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        beta=settings.beta,
        args=SimpleNamespace(
            delta=settings.delta,
            use_bias_correction_kl=settings.use_bias_correction_kl,
            sapo_temperature_pos=settings.sapo_temperature_pos,
            sapo_temperature_neg=settings.sapo_temperature_neg,
            steps_per_generation=gradient_accumulation_steps,
        ),
        importance_sampling_level=settings.importance_sampling_level,
        off_policy_mask_threshold=settings.off_policy_mask_threshold,
        top_entropy_quantile=settings.top_entropy_quantile,
        use_vllm=is_weights is not None,
        vllm_importance_sampling_correction=is_weights is not None,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=gradient_accumulation_steps,
        accelerator=_accelerator(num_processes),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=settings.max_completion_length,
        _get_per_token_logps_and_entropies=_get_per_token_logps_and_entropies,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
    )
    fake.get_high_entropy_mask = lambda e, m, threshold: GRPOTrainer.get_high_entropy_mask(fake, e, m, threshold)
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if sampling_logps is not None:
        inputs["sampling_per_token_logps"] = sampling_logps
    if is_weights is not None:
        inputs["importance_sampling_ratio"] = is_weights
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = torch.as_tensor(num_items_in_batch)
    loss = GRPOTrainer._compute_loss(fake, fake.model, inputs)
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    return loss, metrics


def trl_high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL ``GRPOTrainer.get_high_entropy_mask`` on one rank (``threshold = 1 - top_entropy_quantile``)."""
    fake = SimpleNamespace(accelerator=_accelerator())
    return GRPOTrainer.get_high_entropy_mask(fake, entropies, mask, threshold)


def trl_score(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    *,
    old_logps: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    lengths: list[int] | None = None,
    is_mode: str = "token_truncate",
    is_cap: float | None = 3.0,
    is_clip_min: float | None = None,
):
    """TRL ``_generate_and_score_completions`` in train mode.

    Returns ``(output_dict, metrics)``. With ``old_logps``/``sampling_logps``/``lengths`` given, the vLLM
    importance-sampling branch runs: completions have the given lengths (right padded), the sampler
    reports ``sampling_logps[i, :lengths[i]]`` and the "model" recomputes ``old_logps``.
    """
    batch, num_funcs = rewards_per_func.shape
    use_is = old_logps is not None
    if lengths is None:
        lengths = [2] * batch
    completion_ids_list = [[5] * n for n in lengths]
    sampling_list = [sampling_logps[i, :n].tolist() for i, n in enumerate(lengths)] if use_is else None

    def _generate(prompts):
        return ([[1, 2]] * batch, completion_ids_list, None, ["c"] * batch, sampling_list, {}, None, [])

    def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == old_logps.shape[1]
        return old_logps, None, None

    fake = SimpleNamespace(
        accelerator=_accelerator(),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None,
        environments=[],
        tools=None,
        _generate=_generate,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        args=SimpleNamespace(
            per_device_train_batch_size=batch,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            gradient_checkpointing_kwargs=None,
        ),
        num_iterations=1,
        use_vllm=use_is,
        vllm_importance_sampling_correction=use_is,
        vllm_importance_sampling_mode=is_mode,
        vllm_importance_sampling_clip_max=is_cap,
        vllm_importance_sampling_clip_min=is_clip_min,
        _get_per_token_logps_and_entropies=_get_per_token_logps_and_entropies,
        beta=0.0,
        _calculate_rewards=lambda inputs, prompts, completions, ids: rewards_per_func.clone(),
        num_generations=num_generations,
        reward_weights=reward_weights,
        reward_funcs=[None] * num_funcs,
        reward_func_names=[str(i) for i in range(num_funcs)],
        multi_objective_aggregation=multi_objective_aggregation,
        scale_rewards=scale_rewards,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
            "images": [],
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    output = GRPOTrainer._generate_and_score_completions(fake, [{"prompt": "p"} for _ in range(batch)])
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    return output, metrics


def trl_fused_model(model: torch.nn.Module, temperature: float = 1.0) -> torch.nn.Module:
    """A deep copy of ``model`` patched as ``GRPOTrainer.__init__`` patches the policy.

    TRL 1.16 calls ``add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs", "entropy"))``;
    afterwards ``model(..., labels=..., fused_lm_head=True)`` returns temperature-scaled per-token log-probs
    and entropies without materialising the (B, L, V) logits. ``model`` itself is left unpatched.
    """
    trl_model = copy.deepcopy(model)
    add_fused_lm_head(trl_model, temperature=temperature, outputs=("log_probs", "entropy"))
    return trl_model


def trl_per_token_logps_and_entropies(
    trl_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL ``GRPOTrainer._get_per_token_logps_and_entropies`` on a model from :func:`trl_fused_model`.

    Args:
        trl_model: the patched copy.
        input_ids: ``(B, P + T)`` prompt + completion ids, as TRL builds them (prompt left padded,
            completion right padded).
        attention_mask: ``(B, P + T)`` 1 on real tokens.
        logits_to_keep: ``T``, the completion length.

    Returns:
        ``(logps, entropies)``, each ``(B, T)`` (entropies None unless ``compute_entropy``); 0 where
        ``attention_mask`` is 0. Gradients flow to ``trl_model``'s parameters.
    """
    accelerator = SimpleNamespace(**vars(_accelerator()), autocast=nullcontext, is_main_process=True)
    fake = SimpleNamespace(accelerator=accelerator)  # no `state`/`args`: the profiling decorator just calls through
    logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        fake, trl_model, input_ids, attention_mask, logits_to_keep, compute_entropy=compute_entropy
    )
    return logps, entropies
