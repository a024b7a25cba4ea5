"""On-policy distillation through the learner: the teacher's logprobs are packed per token, a group whose rewards
tie still trains (it has the teacher's signal), zero-advantage skipping keeps its rows, and the student moves toward
the teacher."""

from __future__ import annotations

import copy
import math

import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import BAD, GOOD, PAD, PROMPT, direct_logps, make_group, summed_logps


def learner(model, skip: bool, **loss_kw) -> GRPOLearner:
    return GRPOLearner(
        model, learning_rate=1e-2, weight_decay=0.0, max_grad_norm=1.0, micro_batch_size=2,
        loss=LossSettings(loss_type="dapo", **loss_kw), pad_token_id=PAD, skip_zero_advantage_batches=skip,
    )  # fmt: skip


def tied_batch(model, teacher_shift: float) -> TrainBatch:
    """Two groups of (GOOD, BAD) with on-policy logprobs; the first ties (advantages 0) and has a teacher that
    likes GOOD (`teacher_shift` nats per token above the student) and dislikes BAD as much; the second has no
    teacher and advantages 0 (nothing to learn)."""
    logps = [direct_logps(model, PROMPT, c).tolist() for c in (GOOD, BAD)]
    taught = make_group(PROMPT, [GOOD, BAD], [0.0, 0.0], logprobs=logps)
    taught.teacher_logprobs = [[lp + teacher_shift for lp in logps[0]], [lp - teacher_shift for lp in logps[1]]]
    taught.check_teacher_logprobs()
    return TrainBatch(groups=[taught, make_group(PROMPT, [GOOD, BAD], [0.0, 0.0], logprobs=logps)])


def test_pack_batch_lays_out_teacher_logprobs_per_token(tiny_model):
    batch = tied_batch(tiny_model, 1.0)
    packed = pack_batch(batch, PAD)
    assert packed.teacher_logps.shape == packed.completion_mask.shape == (4, len(GOOD))
    torch.testing.assert_close(packed.teacher_logps[0], torch.tensor(batch.groups[0].teacher_logprobs[0]))
    assert math.isnan(packed.teacher_logps[1, -1])  # BAD is one token shorter: padding
    assert torch.isnan(packed.teacher_logps[2:]).all()  # the group without a teacher
    assert packed.carries_gradient().tolist() == [True, True, False, False]


def test_tied_group_with_a_teacher_trains_toward_it_and_skipping_keeps_it(tiny_model):
    plain_model = copy.deepcopy(tiny_model)
    before = summed_logps(tiny_model)
    batch = tied_batch(tiny_model, 1.0)
    skipping = learner(tiny_model, skip=True, distillation_weight=1.0, vllm_importance_sampling_correction=False)
    plain = learner(plain_model, skip=False, distillation_weight=1.0, vllm_importance_sampling_correction=False)
    metrics = skipping.step(batch)
    plain.step(batch)
    after = summed_logps(tiny_model)
    assert after[0] > before[0] and after[1] < before[1]  # toward the teacher: GOOD up, BAD down
    assert metrics["skipped_zero_adv_completions"] == 2.0  # only the teacherless group's rows were left out
    # student - teacher per token: -1 on GOOD's 4 tokens, +1 on BAD's 3 (pi_old is the model the logprobs came from)
    assert abs(metrics["distill/reverse_kl"] - (-4 + 3) / 7) < 1e-4
    for a, b in zip(tiny_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # skipping changed nothing


def test_without_distillation_weight_the_teacher_is_not_read(tiny_model):
    before = [p.detach().clone() for p in tiny_model.parameters()]
    metrics = learner(tiny_model, skip=False).step(tied_batch(tiny_model, 1.0))  # every advantage 0
    assert not any(k.startswith("distill/") for k in metrics)
    for a, b in zip(tiny_model.parameters(), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
