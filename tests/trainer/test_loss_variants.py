"""Every loss variant the config exposes trains in the real learner: the +advantage completion rises."""

from __future__ import annotations

import pytest

from .test_trainer import make_learner, on_policy_batch, summed_logps

VARIANTS = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "cispo", "epsilon_high": 5.0},
    {"loss_type": "sapo"},
    {"loss_type": "dapo", "importance_sampling_level": "sequence"},  # GSPO
    {"loss_type": "dapo", "delta": 1.5},
    {"loss_type": "dapo", "off_policy_mask_threshold": 0.5},  # OPSM
    {"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": False},
    {"loss_type": "dapo", "vllm_importance_sampling_mode": "sequence_mask"},
]


@pytest.mark.parametrize("settings", VARIANTS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_variant_moves_policy_toward_positive_advantage(tiny_model, settings):
    before_good, before_bad = summed_logps(tiny_model)
    learner = make_learner(tiny_model, max_completion_length=8, **settings)
    batch = on_policy_batch(tiny_model)
    for _ in range(3):
        metrics = learner.step(batch)
    after_good, after_bad = summed_logps(tiny_model)
    assert after_good > before_good
    assert after_bad < before_bad
    assert ("kl" in metrics) == (settings.get("beta", 0.0) > 0)
