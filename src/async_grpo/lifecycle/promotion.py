"""Promote a challenger only when it beats the champion on the same held-out prompts, by more than noise.

Both models are scored on the same prompts with the same per-prompt seeds, sampling and reward functions
(`evaluation.score_held_out`), so each prompt gives one paired difference (challenger - champion) and whatever the
prompt itself contributes (its difficulty, its sampling streams) cancels. The decision rests on a percentile
bootstrap confidence interval of the mean paired difference (Efron & Tibshirani, "An Introduction to the Bootstrap",
1993, ch. 13; `scipy.stats.bootstrap(..., method="percentile")` computes the same interval): promote when its lower
bound is above `min_improvement`. A single noisy evaluation of 64 prompts therefore neither promotes a model that is
no better nor needs a fixed bar from an earlier run scored on other prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 10_000
MIN_PAIRED_PROMPTS = 2  # fewer paired prompts give no interval; such a comparison never promotes


@dataclass(frozen=True)
class HeadToHead:
    """The paired comparison of a challenger with the champion on the same held-out prompts.

    Attributes:
        challenger_mean: mean per-prompt reward of the challenger over the paired prompts (reward units).
        champion_mean: the same for the champion.
        mean_difference: challenger_mean - champion_mean.
        ci_low, ci_high: the percentile bootstrap interval of the mean difference at `confidence` (two-sided:
            the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of `resamples` bootstrap means); NaN when
            fewer than `MIN_PAIRED_PROMPTS` prompts are paired.
        confidence: the interval's coverage, in (0, 1).
        num_prompts: prompts scored for both models (the pairs).
        unpaired_prompts: prompts left out because either model's group failed (counted, never silently dropped).
        resamples: bootstrap resamples drawn.
    """

    challenger_mean: float
    champion_mean: float
    mean_difference: float
    ci_low: float
    ci_high: float
    confidence: float
    num_prompts: int
    unpaired_prompts: int
    resamples: int

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        """The comparison as flat metrics (`prefix` + field name), for MLflow and a KFP `Metrics` artifact."""
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def paired_bootstrap(
    challenger: Sequence[float],
    champion: Sequence[float],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> HeadToHead:
    """Bootstrap interval of the mean paired difference challenger[i] - champion[i].

    Args:
        challenger: (N,) per-prompt mean reward of the challenger; NaN where its group failed.
        champion: (N,) the champion's, on the same N prompts in the same order; NaN where its group failed.
        confidence: interval coverage (`promotion_confidence`), in (0, 1).
        resamples: bootstrap resamples (>= 100).
        seed: seeds the resampling (numpy's PCG64), so a decision can be reproduced.

    Returns:
        HeadToHead over the prompts where both are finite.

    Raises:
        ValueError: the sequences differ in length, confidence is not in (0, 1), or resamples < 100.
    """
    if len(challenger) != len(champion):
        raise ValueError(
            f"challenger has {len(challenger)} per-prompt rewards and champion {len(champion)}; a paired comparison "
            "needs both scored on the same prompts"
        )
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"promotion_confidence={confidence} is not in (0, 1). Fix: use e.g. 0.95.")
    if resamples < 100:
        raise ValueError(f"bootstrap resamples={resamples} is below 100. Fix: use e.g. {DEFAULT_RESAMPLES}.")
    a = np.asarray(challenger, dtype=np.float64)
    b = np.asarray(champion, dtype=np.float64)
    paired = np.isfinite(a) & np.isfinite(b)
    a, b = a[paired], b[paired]
    n = int(paired.sum())
    diff = a - b
    low = high = math.nan
    if n >= MIN_PAIRED_PROMPTS:
        rng = np.random.Generator(np.random.PCG64(seed))
        means = diff[rng.integers(0, n, size=(resamples, n))].mean(axis=1)  # (resamples,)
        alpha = 1.0 - confidence
        low, high = (float(q) for q in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    return HeadToHead(
        challenger_mean=float(a.mean()) if n else math.nan,
        champion_mean=float(b.mean()) if n else math.nan,
        mean_difference=float(diff.mean()) if n else math.nan,
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        num_prompts=n,
        unpaired_prompts=int(len(paired) - n),
        resamples=resamples,
    )


@dataclass(frozen=True)
class Decision:
    """Whether to register the challenger and make it champion, and why (one line for logs, tags and the UI)."""

    promote: bool
    reason: str


def decide(
    challenger_reward: float,
    head_to_head: HeadToHead | None,
    *,
    min_eval_reward: float = 0.0,
    min_improvement: float = 0.0,
    require_improvement: bool = True,
) -> Decision:
    """The registration gate.

    1. The challenger's held-out reward must be at least `min_eval_reward` (an absolute floor).
    2. With a champion and `require_improvement`, the lower bound of the interval of the mean paired difference
       must be above `min_improvement` (reward units). No interval (fewer than 2 paired prompts) never promotes.
    3. With no champion (`head_to_head` None), or `require_improvement` off, the floor alone decides: the first
       version becomes champion.

    Args:
        challenger_reward: the challenger's held-out reward over all its scored completions.
        head_to_head: the paired comparison, or None when there is no champion to compare with (or none was made).
        min_eval_reward: the floor.
        min_improvement: the margin the interval's lower bound must clear.
        require_improvement: False promotes on the floor alone even when a champion exists.

    Returns:
        Decision.
    """
    if challenger_reward < min_eval_reward:
        return Decision(
            False, f"skip: held-out reward {challenger_reward:.4f} is below min_eval_reward {min_eval_reward:.4f}"
        )
    if not require_improvement:
        return Decision(True, f"register: held-out reward {challenger_reward:.4f}; require_improvement is off")
    if head_to_head is None:
        return Decision(True, f"register: held-out reward {challenger_reward:.4f}; no champion yet")
    h = head_to_head
    summary = (
        f"mean difference {h.mean_difference:+.4f} over {h.num_prompts} paired prompts, "
        f"{h.confidence:.0%} interval [{h.ci_low:+.4f}, {h.ci_high:+.4f}]"
    )
    if math.isnan(h.ci_low):
        return Decision(False, f"skip: {h.num_prompts} paired prompts give no interval ({summary})")
    if h.ci_low > min_improvement:
        return Decision(True, f"register: beats the champion, lower bound above {min_improvement:+.4f} ({summary})")
    return Decision(False, f"skip: not shown better, lower bound not above {min_improvement:+.4f} ({summary})")
