"""Optional GPU path: liger-kernel's fused linear GRPO loss, with our off-policy corrections folded in.

`fused_grpo_loss` takes the decoder's hidden states and the LM head instead of per-token logprobs, and
returns the same loss as `grpo_loss` on the full logits (values and gradients;
`tests/trainer/test_liger_loss.py`), without ever holding (N, T, V) logits: liger
(`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`, 0.8.5) projects a chunk of rows at a time through
the head, streams the vocabulary in blocks, and computes the gradients inside its forward.

It takes the same per-call record as `grpo_loss` (`LossInputs`, `algorithms/inputs.py`) and the same options
(`LossSettings`, `algorithms/settings.py`). Mapping of our options (`LossSettings` fields, TRL names) onto liger:

- loss_type, epsilon (liger's epsilon_low), epsilon_high, delta, importance_sampling_level, beta,
  use_bias_correction_kl, sapo_temperature_pos/neg, max_completion_length, temperature: liger's constructor
  arguments of the same names.
- Policy-term multipliers: liger multiplies the per-token policy loss by `vllm_is_ratio` before adding
  the KL, exactly where `grpo_loss` applies, in order, the OPSM sequence mask, the entropy mask and the
  stale-policy IS weights. Their product (0 at padding) goes in as `vllm_is_ratio`. So OPSM is applied
  before calling liger, but to the policy weight rather than to the completion mask: the mask also feeds
  liger's `bnpo` denominator and its KL term, and `grpo_loss` (like TRL) keeps both for masked sequences.
- dapo / cispo normalizer `num_items_in_batch / num_processes` (the `"tokens"` rows of `LOSS_NORMALIZERS`,
  `algorithms/normalizers.py`): liger would divide by its own
  `torch.distributed` world size and clamp at 1 after dividing; we make liger's normalizer exactly 1 and
  divide by ours, so the result does not depend on whether a process group is initialized.
- Gradient accumulation: `grpo_loss` divides grpo, bnpo, dr_grpo and sapo by `gradient_accumulation_steps`;
  liger does not, so we do (a scalar after liger's autograd node; its backward scales the saved gradients).
- Metrics: liger reports only a combined clip ratio, so the metrics come from `grpo_loss` on the
  detached current logprobs (same keys as the unfused path); `policy_loss` is liger's value.

Not expressible in liger 0.8.5 (ValueError): importance_sampling_level="sequence" with cispo or sapo; a KL
bias-correction ratio other than the policy ratio (`LossInputs.kl_ratio_logps`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .inputs import LossInputs
from .logprobs import selective_log_softmax
from .losses import LossOutput, grpo_loss
from .off_policy import off_policy_mask
from .settings import LIGER_VERSION, LossSettings

__all__ = ["LIGER_VERSION", "detached_completion_logps", "fused_grpo_loss"]

_MAX_LOGITS_BLOCK = 1 << 24  # float32 logits elements materialized at once by detached_completion_logps (64 MiB)


def _import_liger_grpo_loss():
    """liger's `LigerFusedLinearGRPOLoss` class; ImportError with the install command when it is missing."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as exc:
        raise ImportError(
            "use_liger_kernel=True needs liger-kernel, which is not installed. Fix: pip install "
            f"'liger-kernel=={LIGER_VERSION}' (it is in async-grpo's gpu extra: pip install 'async-grpo[gpu]'), "
            "or set use_liger_kernel=False."
        ) from exc
    return LigerFusedLinearGRPOLoss


def _liger_world_size() -> int:
    """The world size liger's dapo normalizer divides by (`LigerFusedLinearPPOBase._compute_dapo_normalizer`)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def detached_completion_logps(
    hidden: Tensor, lm_head: torch.nn.Module, completion_ids: Tensor, temperature: float = 1.0
) -> Tensor:
    """Per-token logprobs of `completion_ids` under `lm_head(hidden) / temperature`, without gradient.

    Computed a block of positions at a time so that at most 2**24 logits are alive, the same
    `F.linear` + `selective_log_softmax` as `async_grpo.trainer.logprobs.chunked_token_logps`.

    Args:
        hidden: (N, T, H) decoder hidden states; position t predicts completion_ids[:, t].
        lm_head: the output projection (`weight` (V, H), optional `bias` (V,)).
        completion_ids: (N, T) token ids.
        temperature: logits divisor (> 0).

    Returns:
        (N, T) float32 logprobs (nats), detached.

    Raises:
        ValueError: hidden and completion_ids disagree on (N, T), or temperature <= 0.
    """
    if hidden.dim() != 3 or hidden.shape[:2] != completion_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (N, T, H) with (N, T) = completion_ids {tuple(completion_ids.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    n, t, _ = hidden.shape
    block = max(1, _MAX_LOGITS_BLOCK // max(n * lm_head.weight.shape[0], 1))
    out = []
    for start in range(0, t, block):
        logits = F.linear(hidden[:, start : start + block], lm_head.weight, lm_head.bias).float()  # (N, b, V)
        if temperature != 1.0:
            logits = logits / temperature
        out.append(selective_log_softmax(logits, completion_ids[:, start : start + block]))
    return torch.cat(out, dim=1) if out else hidden.new_zeros((n, 0), dtype=torch.float32)


def fused_grpo_loss(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    completion_ids: Tensor,
    inputs: LossInputs,
    settings: LossSettings,
    *,
    current_logps: Tensor | None = None,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> LossOutput:
    """`grpo_loss` on `lm_head(hidden)` through liger-kernel's fused linear GRPO loss (no (N, T, V) logits).

    Formulas: those of :func:`async_grpo.algorithms.grpo_loss` (TRL 1.16 ``GRPOTrainer._compute_loss``),
    evaluated by ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (liger-kernel 0.8.5) on the logprobs
    ``log_softmax(lm_head(hidden) / settings.temperature)[completion_ids]``; see the module docstring for how
    each option maps onto liger. `inputs` and `settings` have the same meaning as in `grpo_loss`.

    Args:
        hidden: (N, T, H) decoder hidden states at the positions that predict the completion tokens
            (`last_hidden_state[:, -(T + 1):-1]` of the prompt + completion forward), with grad.
        lm_head: the output projection (`weight` (V, H), optional `bias` (V,)); gets gradients.
        completion_ids: (N, T) sampled token ids (any id in [0, V) at padding, e.g. the pad id).
        inputs: the micro-batch's loss inputs (`LossInputs`, shapes with N for B), as in `grpo_loss`; its
            `old_logps` None means the current policy (ratio exactly 1); `kl_ratio_logps` must be None.
        settings: the loss options, as in `grpo_loss`; `settings.temperature` divides the logits (liger's
            `temperature`), as it divides the trainer's and vLLM's.
        current_logps: (N, T) detached logprobs of the current policy (from `detached_completion_logps`),
            used for OPSM, the padding guards and the metrics; computed here when None.
        chunk_size: about this many completions per liger chunk (liger's `chunk_size`; >= 1), or None (the
            default) for the whole micro-batch in one chunk. Whatever the chunk, liger streams the logits in
            blocks of at most 2048 positions x 4096 vocabulary entries, so a larger chunk costs no memory and
            saves Python loop turns and kernel launches: on an H200 (bf16 hidden (8, ~480, 896), vocabulary
            151,936, eight micro-batches) one chunk per micro-batch took 1.12 s against liger's default of one
            completion per chunk, 2.26 s, both at 1.6 GiB peak (the unfused path: 0.17 s, 7.5 GiB).
        compiled: let liger `torch.compile` its loss math (compiles per new shape; off by default: with
            torch 2.11 on an H200, liger 0.8.5's compiled loss failed on the second micro-batch length with
            dynamo's `IndexError` in `produce_guards_verbose`).

    Returns:
        `LossOutput`: the loss (0-d, already divided for gradient accumulation; backward reaches `hidden`,
        `lm_head.weight` and `lm_head.bias`) and `grpo_loss`'s metrics for these inputs.

    Raises:
        ImportError: liger-kernel is not installed (message says how to install it).
        ValueError: everything `grpo_loss` rejects (shape mismatches, missing ref_logps / num_items_in_batch,
            non-finite advantages, ...); importance_sampling_level="sequence" with loss_type cispo or sapo
            (liger 0.8.5 has no sequence-level variant of them); `inputs.kl_ratio_logps` set (liger corrects
            the KL by the policy ratio only); hidden not (N, T, H); lm_head weight not (V, H); chunk_size < 1.
    """
    loss_type, level = settings.loss_type, settings.importance_sampling_level
    mask, advantages, old_logps, ref_logps = inputs.mask, inputs.advantages, inputs.old_logps, inputs.ref_logps
    is_weights, sampling_logps, entropy_mask = inputs.is_weights, inputs.sampling_logps, inputs.entropy_mask
    num_items_in_batch, num_processes = inputs.num_items_in_batch, inputs.num_processes
    if level == "sequence" and loss_type in ("cispo", "sapo"):
        raise ValueError(
            f"importance_sampling_level='sequence' with loss_type={loss_type!r} is not available in liger-kernel "
            f"{LIGER_VERSION}. Fix: use importance_sampling_level='token', another loss_type, or "
            "use_liger_kernel=False."
        )
    if hidden.dim() != 3 or hidden.shape[:2] != completion_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (N, T, H) with (N, T) = completion_ids "
            f"{tuple(completion_ids.shape)}. Fix: pass last_hidden_state[:, -(T + 1):-1]."
        )
    weight = lm_head.weight
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head.weight {tuple(weight.shape)} must be (V, H) with H = {hidden.shape[2]}. "
            "Fix: pass model.get_output_embeddings()."
        )
    if chunk_size is None:
        chunk_size = max(1, hidden.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (completions per liger chunk), or None.")
    if inputs.kl_ratio_logps is not None:
        raise ValueError(
            "LossInputs.kl_ratio_logps is not available with the fused loss: liger-kernel "
            f"{LIGER_VERSION} corrects the KL by the policy ratio only. Fix: pass the sampler's logprobs as "
            "old_logps (off_policy_clip='behaviour'), leave kl_ratio_logps None, or use_liger_kernel=False."
        )

    if current_logps is None:
        current_logps = detached_completion_logps(hidden.detach(), lm_head, completion_ids, settings.temperature)
    current_logps = current_logps.detach().float()
    # The reference computation: validates every per-call input and gives the metrics (no gradient).
    with torch.no_grad():
        reference = grpo_loss(current_logps, inputs, settings)
    LigerFusedLinearGRPOLoss = _import_liger_grpo_loss()

    valid = mask.bool()  # (N, T)
    mask_f = valid.float()  # float32 even for bf16 hidden: liger sums it for the denominators
    adv = advantages.detach().reshape(-1).float()  # (N,)
    # Padding guards: liger cannot zero the logprobs at padding as grpo_loss does, so make the ratio and
    # the KL there exactly those of an on-policy token (finite; the mask then removes them).
    old = None if old_logps is None else torch.where(valid, old_logps.detach().float(), current_logps)
    ref = None
    if settings.beta != 0.0:
        ref = torch.where(valid, ref_logps.detach().float(), current_logps)

    # Policy-term multiplier, in grpo_loss's order: OPSM mask, entropy mask, IS weights; 0 at padding.
    weight_factors = []
    if settings.off_policy_mask_threshold is not None:
        old_for_opsm = current_logps if old_logps is None else torch.where(valid, old_logps.detach().float(), 0.0)
        opsm_ref = old_for_opsm if sampling_logps is None else sampling_logps
        keep = off_policy_mask(adv, current_logps, opsm_ref, valid, settings.off_policy_mask_threshold)  # (N, 1)
        weight_factors.append(keep)
    if entropy_mask is not None:
        weight_factors.append(entropy_mask.detach().float())  # (N, T)
    if is_weights is not None:
        weight_factors.append(is_weights.detach().float())  # (N, T) or (N, 1)
    policy_weight = None
    if weight_factors:
        policy_weight = mask_f.clone()
        for factor in weight_factors:
            policy_weight = policy_weight * factor.expand_as(mask_f)
        policy_weight = torch.where(valid, policy_weight, 0.0)  # also drops NaN / inf at padding

    dapo_like = settings.normalizer.divides_by_tokens  # dapo, cispo: the step divisor is the token count
    liger_loss = LigerFusedLinearGRPOLoss(
        beta=settings.beta,
        compiled=compiled,
        use_ref_model=settings.beta != 0.0,
        chunk_size=chunk_size,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        loss_type=loss_type,
        max_completion_length=settings.max_completion_length,
        importance_sampling_level=level,
        sapo_temperature_pos=settings.sapo_temperature_pos,
        sapo_temperature_neg=settings.sapo_temperature_neg,
        temperature=settings.temperature,
        delta=settings.delta,
        use_bias_correction_kl=settings.use_bias_correction_kl,
    )
    loss, _ = liger_loss(
        hidden, weight, completion_ids, mask_f, adv,
        bias=getattr(lm_head, "bias", None), ref_per_token_logps=ref, old_per_token_logps=old,
        vllm_is_ratio=policy_weight,
        num_items_in_batch=float(_liger_world_size()) if dapo_like else None,  # liger's normalizer: exactly 1
    )  # fmt: skip
    if dapo_like:  # grpo_loss: sum / (clamp(num_items, 1) / num_processes)
        num_items = float(torch.as_tensor(num_items_in_batch, dtype=torch.float64))
        loss = loss / (max(num_items, 1.0) / num_processes)
        policy_loss = loss.detach()
    else:
        policy_loss = loss.detach()
        loss = loss / inputs.gradient_accumulation_steps
    metrics = dict(reference.metrics)
    metrics["policy_loss"] = policy_loss.item()
    return LossOutput(loss=loss, metrics=metrics)
