"""The registration gate's paired bootstrap, against hand-computed cases and scipy's bootstrap."""

import math

import numpy as np
import pytest
from scipy import stats

from async_grpo.lifecycle.promotion import HeadToHead, decide, paired_bootstrap


def test_identical_models_give_a_zero_interval_and_no_promotion():
    rewards = [0.1, 0.5, 0.9, 0.3]
    h = paired_bootstrap(rewards, rewards)
    assert (h.mean_difference, h.ci_low, h.ci_high) == (0.0, 0.0, 0.0)
    assert h.num_prompts == 4 and h.unpaired_prompts == 0
    assert not decide(0.45, h).promote


def test_two_prompts_hand_computed():
    # differences [0, 1]: a resample of 2 prompts has mean 0 (p 1/4), 0.5 (p 1/2) or 1 (p 1/4), so the 95%
    # percentile interval is [0, 1] and the mean difference 0.5
    h = paired_bootstrap([1.0, 2.0], [1.0, 1.0], resamples=20_000)
    assert h.mean_difference == 0.5 and (h.ci_low, h.ci_high) == (0.0, 1.0)
    assert (h.challenger_mean, h.champion_mean) == (1.5, 1.0)
    assert not decide(1.5, h).promote  # the lower bound 0 is not above 0
    assert not decide(1.5, h, min_improvement=0.0).promote


def test_matches_scipy_percentile_bootstrap():
    rng = np.random.default_rng(3)
    champion = rng.uniform(0, 1, 64)
    challenger = champion + rng.normal(0.05, 0.1, 64)
    h = paired_bootstrap(challenger, champion, confidence=0.9, resamples=20_000, seed=1)
    ref = stats.bootstrap(
        (challenger - champion,), np.mean, confidence_level=0.9, n_resamples=20_000, method="percentile",
        random_state=np.random.default_rng(7),
    ).confidence_interval  # fmt: skip
    assert h.ci_low == pytest.approx(ref.low, abs=0.004) and h.ci_high == pytest.approx(ref.high, abs=0.004)
    assert h.mean_difference == pytest.approx(float(np.mean(challenger - champion)))


def test_clear_improvement_promotes_and_margin_can_block_it():
    champion = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.1, 0.3]
    challenger = [c + 0.3 + 0.01 * i for i, c in enumerate(champion)]
    h = paired_bootstrap(challenger, champion)
    assert 0.3 <= h.ci_low < h.mean_difference < h.ci_high <= 0.37
    assert decide(0.9, h).promote
    blocked = decide(0.9, h, min_improvement=0.4)
    assert not blocked.promote and "lower bound not above +0.4000" in blocked.reason


def test_failed_groups_are_unpaired_and_counted():
    h = paired_bootstrap([1.0, math.nan, 0.5, 0.7], [0.5, 0.5, math.nan, 0.2])
    assert h.num_prompts == 2 and h.unpaired_prompts == 2
    assert h.mean_difference == pytest.approx(0.5)


def test_too_few_pairs_never_promote():
    h = paired_bootstrap([1.0, math.nan], [0.0, 0.0])
    assert h.num_prompts == 1 and math.isnan(h.ci_low)
    d = decide(1.0, h)
    assert not d.promote and "give no interval" in d.reason


def test_floor_and_first_champion():
    assert not decide(0.1, None, min_eval_reward=0.2).promote
    first = decide(0.3, None, min_eval_reward=0.2)
    assert first.promote and "no champion yet" in first.reason
    worse = paired_bootstrap([0.0, 0.1, 0.0], [0.5, 0.6, 0.4])
    assert decide(0.03, worse, require_improvement=False).promote


def test_seeded_and_reproducible():
    a, b = [0.2, 0.9, 0.4, 0.1, 0.6], [0.1, 0.7, 0.5, 0.1, 0.2]
    assert paired_bootstrap(a, b, seed=5) == paired_bootstrap(a, b, seed=5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"confidence": 1.0}, "promotion_confidence"),
        ({"confidence": 0.0}, "promotion_confidence"),
        ({"resamples": 10}, "resamples"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], **kwargs)


def test_lengths_must_match():
    with pytest.raises(ValueError, match="same prompts"):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_metrics_are_flat_floats():
    h = HeadToHead(1.0, 0.5, 0.5, 0.1, 0.9, 0.95, 10, 1, 1000)
    assert h.as_metrics("h2h/") == {
        "h2h/challenger_mean": 1.0, "h2h/champion_mean": 0.5, "h2h/mean_difference": 0.5, "h2h/ci_low": 0.1,
        "h2h/ci_high": 0.9, "h2h/confidence": 0.95, "h2h/num_prompts": 10.0, "h2h/unpaired_prompts": 1.0,
        "h2h/resamples": 1000.0,
    }  # fmt: skip
