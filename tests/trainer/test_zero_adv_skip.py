"""Zero-advantage micro-batch skipping: counted, and the step equals the unskipped one exactly."""

from __future__ import annotations

import copy

import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import BAD, GOOD, PAD, PROMPT, direct_logps, make_group


def make_learner(model, skip: bool) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=2,
        loss=LossSettings(),
        pad_token_id=PAD,
        skip_zero_advantage_batches=skip,
    )


def batch_with_a_flat_group(model) -> TrainBatch:
    logps = [direct_logps(model, PROMPT, c).tolist() for c in (GOOD, BAD)]
    return TrainBatch(
        groups=[
            make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=logps),
            make_group(PROMPT, [GOOD, BAD], [0.0, 0.0], logprobs=logps),
        ]
    )


def test_skipping_is_counted_and_exact(tiny_model):
    other = copy.deepcopy(tiny_model)
    skipping = make_learner(tiny_model, skip=True)
    plain = make_learner(other, skip=False)
    batch = batch_with_a_flat_group(tiny_model)
    m1 = skipping.step(batch)
    m2 = skipping.step(batch)
    plain.step(batch)
    plain.step(batch)
    assert m1["skipped_zero_adv_microbatches"] == 1.0 and m2["skipped_zero_adv_microbatches"] == 2.0
    for a, b in zip(tiny_model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_learner_itself_refuses_skipping_with_a_kl_term(tiny_model):
    """Regression (shared/repros/skip_with_kl_guard.py): a skipped micro-batch would lose its KL gradient (118% off),
    so the learner refuses the combination even when built without the config's check."""
    import pytest

    with pytest.raises(ValueError, match="skip_zero_advantage_batches needs beta=0.*Fix"):
        GRPOLearner(
            tiny_model,
            learning_rate=1e-3,
            weight_decay=0.0,
            max_grad_norm=1.0,
            micro_batch_size=2,
            loss=LossSettings(beta=0.1),
            pad_token_id=PAD,
            skip_zero_advantage_batches=True,
        )
