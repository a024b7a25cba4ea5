"""Trainer side of batch shaping: replayed rows (`replay_recompute_logps`) and `top_entropy_quantile`."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.trainer.packing import pack_batch
from async_grpo.transports.messages import TrainBatch

from .test_trainer import BAD, GOOD, PAD, PROMPT, direct_logps, make_group, make_learner, on_policy_batch

STALE_LOGP = -8.0  # a sampling logprob far below the model's own: rho = exp(old - samp) >> cap
SURE_LOGP = -0.1  # far above the model's own (~ -ln 320): rho << 1, and OPSM sees samp - logp >> threshold


def replayed_batch(model, stale_logp: float = STALE_LOGP) -> TrainBatch:
    """Group (A: +1, B: -1), replayed: vLLM's logprobs (`stale_logp` per token) are a long-gone policy's."""
    stale = [[stale_logp] * len(c) for c in (GOOD, BAD)]
    grp = make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=stale)
    grp.replayed = True
    return TrainBatch(groups=[grp])


def test_pack_batch_carries_the_replayed_flag(tiny_model):
    fresh = on_policy_batch(tiny_model).groups[0]
    batch = TrainBatch(groups=[fresh, replayed_batch(tiny_model).groups[0]])
    assert pack_batch(batch, PAD).replayed.tolist() == [False, False, True, True]


def test_recompute_treats_replayed_rows_as_on_policy(tiny_model):
    """With replay_recompute_logps a replayed step is exactly the step without any IS correction (weight 1),
    and OPSM keeps the rows although their vLLM logprobs are far off."""
    other, dropped = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    kw = dict(off_policy_mask_threshold=0.5)
    replayed = make_learner(tiny_model, replay_recompute_logps=True, **kw).step(replayed_batch(tiny_model, SURE_LOGP))
    make_learner(other, vllm_importance_sampling_correction=False).step(replayed_batch(other, SURE_LOGP))
    for key in ("min", "max", "mean"):
        assert replayed[f"sampling/importance_sampling_ratio/{key}"] == 1.0
    assert replayed["sampling/importance_sampling_ratio/masked_frac"] == 0.0
    for a, b in zip(tiny_model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the same rows keeping vLLM's logprobs: every IS weight is rho = exp(old - samp) < 0.01 and OPSM drops the
    # negative-advantage row, so the step all but vanishes
    stale = make_learner(dropped, replay_recompute_logps=False, **kw).step(replayed_batch(dropped, SURE_LOGP))
    assert stale["sampling/importance_sampling_ratio/max"] < 0.01
    assert stale["grad_norm"] < 0.01 * replayed["grad_norm"]


def test_without_recompute_replayed_rows_keep_the_stale_is_weight(tiny_model):
    metrics = make_learner(tiny_model, replay_recompute_logps=False, vllm_importance_sampling_cap=3.0).step(
        replayed_batch(tiny_model)
    )
    # old - samp = logp + 8 > ln 3 for every token of this tiny model, so every weight is truncated to the cap
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(3.0)
    assert metrics["sampling/importance_sampling_ratio/masked_frac"] == 1.0


def test_recompute_leaves_fresh_rows_alone(tiny_model):
    fresh = make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=[[STALE_LOGP] * len(c) for c in (GOOD, BAD)])
    metrics = make_learner(tiny_model, replay_recompute_logps=True).step(TrainBatch(groups=[fresh]))
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(3.0)  # not replayed: still corrected


def test_top_entropy_quantile_trains_only_high_entropy_tokens(tiny_model):
    full_model, masked_model = tiny_model, copy.deepcopy(tiny_model)
    batch = on_policy_batch(tiny_model)
    full = make_learner(full_model).step(copy.deepcopy(batch))
    masked = make_learner(masked_model, top_entropy_quantile=0.0).step(copy.deepcopy(batch))
    assert "entropy_mask/kept_fraction" not in full
    # rho = 0: one token (the highest-entropy one) of the 7 in the single micro-batch keeps its policy term
    assert masked["entropy_mask/kept_fraction"] == pytest.approx(1 / (len(GOOD) + len(BAD)))
    assert masked["num_tokens"] == full["num_tokens"]  # the denominator is unchanged
    assert 0 < masked["grad_norm"] < full["grad_norm"]


def test_top_entropy_quantile_one_is_the_plain_step(tiny_model):
    other = copy.deepcopy(tiny_model)
    batch = on_policy_batch(tiny_model)
    make_learner(tiny_model).step(copy.deepcopy(batch))
    make_learner(other, top_entropy_quantile=1.0).step(copy.deepcopy(batch))
    for a, b in zip(tiny_model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_direct_logps_differ_from_the_stale_ones(tiny_model):
    """Guard: the stale logprob really is far from the model's, so the tests above are not vacuous."""
    lps = torch.cat([direct_logps(tiny_model, PROMPT, c) for c in (GOOD, BAD)])
    assert (lps - STALE_LOGP > torch.log(torch.tensor(3.0))).all()
