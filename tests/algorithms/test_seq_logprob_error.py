"""NeMo RL's sequence logprob mismatch gate (seq_logprob_error_threshold) on hand-built sequences: the error, the
mask and its count, and that a masked sequence loses exactly its policy term in the objective."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.algorithms import GRPOObjective, LossInputs, LossSettings, MicroBatchInputs, grpo_loss
from async_grpo.algorithms.off_policy import seq_logprob_error_mask


def test_error_is_the_token_mean_of_the_probability_factor():
    old = torch.zeros(3, 2)
    sampling = torch.tensor([[0.0, -math.log(2)], [-1.0, -1.0], [0.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    keep, metrics = seq_logprob_error_mask(old, sampling, mask, threshold=2.0)
    # row 0: (e^0 + e^ln2) / 2 = 1.5; row 1: e^1; row 2: the NaN token is left out: e^0 = 1
    assert metrics["sampling/seq_mult_prob_error/max"] == pytest.approx(math.e)
    assert metrics["sampling/seq_mult_prob_error/mean"] == pytest.approx((1.5 + math.e + 1.0) / 3)
    assert keep.tolist() == [True, False, True] and metrics["sampling/seq_logprob_error_masked"] == 1.0
    assert seq_logprob_error_mask(old, sampling, mask, None)[0] is None
    padded = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # padding does not count; an empty row agrees
    _, metrics = seq_logprob_error_mask(old, sampling, padded, 2.0)
    assert metrics["sampling/seq_mult_prob_error/mean"] == pytest.approx((1.0 + math.e + 1.0) / 3)


def test_threshold_must_be_a_ratio_above_one():
    with pytest.raises(ValueError, match=r"^seq_logprob_error_threshold=1.0 .*Fix"):
        LossSettings(seq_logprob_error_threshold=1.0)


def test_a_masked_sequence_loses_its_policy_term_only():
    torch.manual_seed(0)
    logps = torch.randn(3, 4) * 0.1 - 1.0
    sampling = logps.clone()
    sampling[1] -= 1.0  # the sampler disagrees by 1 nat on every token of row 1: error e > 2
    mask = torch.ones(3, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    settings = LossSettings(beta=0.0, seq_logprob_error_threshold=2.0, vllm_importance_sampling_correction=False)
    leaf = logps.clone().requires_grad_(True)
    result = GRPOObjective(settings).micro_batch_loss(
        MicroBatchInputs(leaf, torch.zeros(3, 4), mask, advantages, sampling), num_items_in_batch=mask.sum()
    )
    keep_rows = torch.tensor([[True] * 4, [False] * 4, [True] * 4])
    expected = grpo_loss(
        logps,
        LossInputs(
            mask=mask,
            advantages=advantages,
            entropy_mask=keep_rows,
            sampling_logps=sampling,
            num_items_in_batch=mask.sum(),
        ),
        settings,
    )
    torch.testing.assert_close(result.output.loss, expected.loss, rtol=0, atol=0)
    result.output.loss.backward()
    assert torch.all(leaf.grad[1] == 0) and torch.all(leaf.grad[0] != 0)
    assert result.metrics["sampling/seq_logprob_error_masked"] == 1.0
