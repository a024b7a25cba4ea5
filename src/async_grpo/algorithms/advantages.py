"""Group-relative advantages for GRPO.

Pure functions over tensors, no model and no config object. The arithmetic mirrors TRL 1.16
``GRPOTrainer._generate_and_score_completions`` (the block between ``_calculate_rewards`` and the
per-process slicing) expression for expression, so results agree with TRL bit for bit on the same
inputs; the only departures are documented where they occur (all on degenerate groups, none changes an
advantage).

Shapes: ``B = num_groups * num_generations`` completions, the ``num_generations`` completions of one
prompt contiguous; ``F`` reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["AdvantageOutput", "compute_advantages", "nanstd"]

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
STD_EPS = 1e-4  # TRL adds this to the std before dividing (not a max(std, eps))


@dataclass
class AdvantageOutput:
    """Result of :func:`compute_advantages`.

    Attributes:
        advantages: ``(B,)`` float, finite everywhere (NaN never appears; unscorable rows get 0).
        rewards: ``(B,)`` weighted ``nansum`` of the reward functions (None rewards count as 0), NaN
            on unscorable rows (every function returned None), as TRL logs them.
        std_rewards: ``(B,)`` the std the advantages were scaled by (group std repeated per row, or
            the batch std); for ``scale_rewards="none"`` the group std, used only for
            ``is_std_zero``. Degenerate groups (fewer than two scored rows) get 0 here, not NaN.
        is_std_zero: ``(B,)`` bool, ``std_rewards`` close to 0 (TRL's ``frac_reward_zero_std``
            flag). Note that with ``scale_rewards="batch"`` or ``normalize_then_sum`` this is the
            *batch* std, so it says nothing about a single group.
        group_std_zero: ``(B,)`` bool, the row's group has zero (or undefined: fewer than two scored
            rows) std of the weighted summed reward, whatever ``scale_rewards`` is: the group
            carries no learning signal. This is the flag for dynamic sampling (DAPO) filters.
        unscorable: ``(B,)`` bool, every reward function returned None for this row.
        metrics: ``reward``, ``reward_std``, ``frac_reward_zero_std`` and, per reward function
            index ``i``, ``rewards/{i}/mean`` and ``rewards/{i}/std`` (NaN-ignoring; NaN when no
            value exists, as in TRL). The caller renames ``{i}`` to function names.
    """

    advantages: Tensor
    rewards: Tensor
    std_rewards: Tensor
    is_std_zero: Tensor
    group_std_zero: Tensor
    unscorable: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def nanstd(tensor: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs.

    Same arithmetic as ``trl.trainer.utils.nanstd``: ``sqrt(nanmean((x - nanmean(x))**2) * n/(n-1))``
    with ``n`` the count of non-NaN values; NaN where ``n <= 1``.

    Args:
        tensor: any shape, floating.
        dim: dimension to reduce, or None for all.
        keepdim: keep the reduced dimension (size 1).

    Returns:
        The std, reduced over ``dim`` (a 0-d tensor when ``dim`` is None and not keepdim).
    """
    reduce_dim = tuple(range(tensor.dim())) if dim is None else dim
    mean = torch.nanmean(tensor, dim=reduce_dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=reduce_dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=reduce_dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    if dim is None:
        return std.squeeze()
    return std.squeeze(dim)


def _validate(
    rewards_per_func: Tensor,
    reward_weights: Tensor,
    num_generations: int,
    scale_rewards: str,
    multi_objective_aggregation: str,
) -> None:
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be 2-D (B, F), got shape {tuple(rewards_per_func.shape)}")
    num_rows, num_funcs = rewards_per_func.shape
    if reward_weights.shape != (num_funcs,):
        raise ValueError(
            f"reward_weights must have shape ({num_funcs},) to match rewards_per_func, "
            f"got {tuple(reward_weights.shape)}"
        )
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive int, got {num_generations!r}")
    if num_rows == 0 or num_rows % num_generations != 0:
        raise ValueError(
            f"B={num_rows} rows is not a positive multiple of num_generations={num_generations}; "
            "the completions of each prompt must be contiguous and complete"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"Invalid value for scale_rewards: {scale_rewards!r}. Must be one of {SCALE_REWARDS}.")
    if multi_objective_aggregation not in AGGREGATIONS:
        raise ValueError(
            f"Invalid multi_objective_aggregation: {multi_objective_aggregation!r}. Must be one of {AGGREGATIONS}."
        )
    if torch.isinf(rewards_per_func).any():
        raise ValueError("rewards_per_func contains +/-inf; reward functions must return finite floats or None")


def compute_advantages(
    rewards_per_func: Tensor,
    reward_weights: Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> AdvantageOutput:
    """GRPO group-relative advantages from per-function rewards.

    ``sum_then_normalize`` (TRL default, DeepSeekMath GRPO eq. "outcome supervision", Shao et al. 2024):
    ``r = nansum_f(w_f * R_f)``; ``A = r - mean_group(r)``, then divided by ``std + 1e-4`` where the std
    is the group's (``scale_rewards="group"``) or the whole batch's (``"batch"``, Hu et al. REINFORCE++ /
    "Tricks or Traps" recommendation); ``"none"`` skips the division (Dr. GRPO, Liu et al. 2025).

    ``normalize_then_sum`` (GDPO, TRL ``multi_objective_aggregation="normalize_then_sum"``): each
    function is normalized within its group, ``(R_f - mean_group) / (std_group + 1e-4)``, weighted and
    NaN-summed, and the sum is normalized by the batch mean and std (``scale_rewards`` is ignored, as in
    TRL).

    Means and stds ignore NaN; stds are Bessel-corrected (``trl.trainer.utils.nanstd``). Mirrors TRL
    ``GRPOTrainer._generate_and_score_completions`` with ``GRPOConfig.scale_rewards`` and
    ``GRPOConfig.multi_objective_aggregation``.

    None handling (as TRL): a NaN entry (function returned None) counts as 0 in the weighted sum of a
    row where another function scored; a row where every function returned None is *unscorable*: its
    reward is NaN, it is left out of the group mean/std, and its advantage is 0. A group where every
    row is unscorable, or where a std is undefined (fewer than two scored rows), yields advantage 0
    rather than NaN (TRL's final ``nan_to_num``). NaN advantages are never produced.

    Args:
        rewards_per_func: ``(B, F)`` float rewards, NaN where a function returned None. Integer
            tensors are converted to float32.
        reward_weights: ``(F,)`` weight per reward function.
        num_generations: completions per prompt ``G``; ``B`` must be a multiple of it and the ``G``
            rows of one prompt contiguous.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.

    Returns:
        :class:`AdvantageOutput` (advantages in reward units divided by reward std, i.e. unitless
        unless ``scale_rewards="none"``).

    Raises:
        ValueError: bad shapes, ``B`` not a multiple of ``num_generations``, unknown
            ``scale_rewards`` / ``multi_objective_aggregation``, or an infinite reward.
    """
    if not torch.is_floating_point(rewards_per_func):
        rewards_per_func = rewards_per_func.float()
    reward_weights = torch.as_tensor(reward_weights)
    _validate(rewards_per_func, reward_weights, num_generations, scale_rewards, multi_objective_aggregation)
    num_funcs = rewards_per_func.shape[1]
    weights = reward_weights.to(device=rewards_per_func.device, dtype=rewards_per_func.dtype).unsqueeze(0)  # (1, F)

    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (B,)

    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)  # (B,)
        rewards[unscorable] = torch.nan
        mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1)  # (B/G,)
        mean_grouped = mean_grouped.repeat_interleave(num_generations, dim=0)  # (B,)
        if scale_rewards in ("group", "none"):  # "none" uses the group std only for is_std_zero
            if num_generations > 1:
                std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)  # (B/G,)
                std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)  # (B,)
            else:
                std_rewards = torch.zeros_like(rewards)
        else:  # "batch"
            std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = rewards - mean_grouped  # (B,)
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + STD_EPS)
    else:  # normalize_then_sum
        grouped = rewards_per_func.view(-1, num_generations, num_funcs)  # (B/G, G, F)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)  # (B/G, 1, F)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, num_funcs)  # (B, F)
        rewards_norm = (reward_k * weights).nansum(dim=1)  # (B,)
        rewards_norm[unscorable] = torch.nan
        if rewards_norm.numel() > 1:
            std_rewards = nanstd(rewards_norm).expand_as(rewards_norm)  # (B,)
        else:
            std_rewards = torch.zeros_like(rewards_norm)
        advantages = (rewards_norm - torch.nanmean(rewards_norm)) / (std_rewards + STD_EPS)  # (B,)

    # Unscorable rows and degenerate groups carry no signal: NaN -> 0 (TRL does the same). Rewards are
    # validated finite above, so no inf can reach here except through a zero std, which +1e-4 prevents.
    advantages = torch.nan_to_num(advantages, nan=0.0)

    # Departure from TRL (robustness): an undefined std (NaN: group with < 2 scored rows) is reported
    # as 0, so such groups count as zero-std (no learning signal). TRL's isclose(NaN, 0) is False there.
    # Advantages are unaffected (computed above from TRL's exact expressions).
    std_rewards = torch.nan_to_num(std_rewards, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # (B,)

    # Logged reward: weighted nansum of raw rewards, NaN on unscorable rows (TRL logs this, also for
    # normalize_then_sum).
    raw_rewards = (rewards_per_func * weights).nansum(dim=1)  # (B,)
    raw_rewards[unscorable] = torch.nan
    group_std = nanstd(raw_rewards.view(-1, num_generations), dim=1) if num_generations > 1 else None  # (B/G,)
    if group_std is None:
        group_std_zero = torch.ones_like(unscorable)
    else:
        group_std = torch.nan_to_num(group_std, nan=0.0).repeat_interleave(num_generations, dim=0)  # (B,)
        group_std_zero = torch.isclose(group_std, torch.zeros_like(group_std))

    metrics: dict[str, float] = {}
    for i in range(num_funcs):
        metrics[f"rewards/{i}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{i}/std"] = nanstd(rewards_per_func[:, i]).item()
    metrics["reward"] = torch.nanmean(raw_rewards).item()
    metrics["reward_std"] = nanstd(raw_rewards).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()

    return AdvantageOutput(
        advantages=advantages,
        rewards=raw_rewards,
        std_rewards=std_rewards,
        is_std_zero=is_std_zero,
        group_std_zero=group_std_zero,
        unscorable=unscorable,
        metrics=metrics,
    )
