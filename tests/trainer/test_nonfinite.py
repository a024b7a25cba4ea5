"""Non-finite numbers never reach the weights: a NaN/inf sampling logprob is left out of the loss (counted), and an
optimizer step whose gradient norm is not finite is skipped (counted), so vLLM is never pushed NaN weights.

Regression: a user data producer that kept HF `generate`'s padding after a second EOS id handed the trainer
`-inf` sampling logprobs; the importance-sampling ratio became inf, `inf * 0` NaN, every weight NaN after one step,
and vLLM then refused every request ("Out of range float values are not JSON compliant")."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.orchestrator.batching import make_train_batch
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import BAD, GOOD, PAD, PROMPT, make_group


def make_learner(model, **loss) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-2,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=2,
        loss=LossSettings(**loss),
        pad_token_id=PAD,
    )


def bad_logprobs() -> list[list[float]]:
    good = [-0.5] * len(GOOD)
    bad = [-0.5] * len(BAD)
    bad[-1] = -math.inf  # a padding token with probability 0 under the producer's filtered distribution
    good[0] = math.nan
    return [good, bad]


def test_a_nonfinite_sampling_logprob_is_masked_and_counted():
    group = make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=bad_logprobs())
    assert group.nonfinite_logprob_tokens == 2
    assert group.loss_mask[0][0] == 0 and group.loss_mask[1][-1] == 0
    assert sum(map(sum, group.loss_mask)) == len(GOOD) + len(BAD) - 2
    packed = pack_batch(TrainBatch(groups=[group]), PAD)
    assert torch.isfinite(packed.sampling_logps).all()
    group.rewards_per_func = [[1.0], [0.0]]
    metrics = make_train_batch([group], ["r"], [1.0], "group").metrics
    assert metrics["sampling/nonfinite_logprob_tokens"] == 2.0


@pytest.mark.parametrize("clip", ["current", "behaviour"])
def test_a_step_on_nonfinite_sampling_logprobs_keeps_the_weights_finite(tiny_model, clip):
    learner = make_learner(tiny_model, off_policy_clip=clip, vllm_importance_sampling_correction=True)
    batch = TrainBatch(groups=[make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=bad_logprobs())])
    before = copy.deepcopy(tiny_model.state_dict())
    metrics = learner.step(batch)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())  # it did train


def test_a_nonfinite_gradient_skips_the_optimizer_step_and_is_counted(tiny_model, monkeypatch):
    learner = make_learner(tiny_model)
    batch = TrainBatch(groups=[make_group(PROMPT, [GOOD, BAD], [1.0, -1.0])])
    before = copy.deepcopy(tiny_model.state_dict())
    real = learner.objective.micro_batch_loss

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        out.output.loss = out.output.loss * float("nan")
        return out

    monkeypatch.setattr(learner.objective, "micro_batch_loss", nan_loss)
    metrics = learner.step(batch)
    assert metrics["skipped_nonfinite_steps"] == 1.0
    for key, value in tiny_model.state_dict().items():
        assert torch.equal(before[key], value), key  # untouched
    monkeypatch.setattr(learner.objective, "micro_batch_loss", real)
    metrics = learner.step(batch)
    assert metrics["skipped_nonfinite_steps"] == 1.0 and math.isfinite(metrics["grad_norm"])
    assert learner.state_dict()["skipped_nonfinite_steps"] == 1
