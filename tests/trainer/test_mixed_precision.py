"""bf16 (TRL name): forward passes under bfloat16 autocast, float32 master weights, and a loss that matches the
float32 one to bf16 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import PAD, make_group


def batch_of_four_groups() -> TrainBatch:
    """4 groups x 2 completions, ragged, with off-policy sampling logprobs (IS weights differ from 1)."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for i, prompt in enumerate([[72, 105, 58], [65, 66], [90, 91, 92, 93], [48, 49]]):
        comps = [[int(t) for t in torch.randint(60, 120, (n,), generator=gen)] for n in (3 + i % 2, 2 + i)]
        logps = [[float(-0.5 - torch.rand(1, generator=gen)) for _ in c] for c in comps]
        groups.append(make_group(prompt, comps, [1.0 - 0.5 * i, -1.0 + 0.25 * i], logprobs=logps))
    return TrainBatch(groups=groups)


def learner(model, mixed_precision=None, **loss_kw) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1e9,
        micro_batch_size=4,
        loss=LossSettings(max_completion_length=8, **loss_kw),
        pad_token_id=PAD,
        mixed_precision=mixed_precision,
    )


@pytest.mark.parametrize("loss_kw", [{}, {"beta": 0.05, "loss_type": "grpo"}], ids=["dapo", "grpo+kl"])
def test_bf16_step_matches_float32_to_bf16_rounding(tiny_model, loss_kw):
    other = copy.deepcopy(tiny_model)
    batch = batch_of_four_groups()
    want = learner(tiny_model, **loss_kw).step(copy.deepcopy(batch))
    got = learner(other, "bf16", **loss_kw).step(copy.deepcopy(batch))
    assert got["loss"] == pytest.approx(want["loss"], rel=5e-2, abs=1e-3)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=2e-2)
    g32 = torch.cat([p.grad.flatten() for p in tiny_model.parameters()])
    g16 = torch.cat([p.grad.flatten() for p in other.parameters()])
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.99
    assert not torch.equal(g32, g16)  # the forward really ran in bf16
    # master weights, gradients and optimizer state stay float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in other.parameters())


def test_unknown_mixed_precision_is_refused(tiny_model):
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*Fix"):
        learner(tiny_model, "fp16")
