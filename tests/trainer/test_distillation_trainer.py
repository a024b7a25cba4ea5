"""On-policy distillation through the learner: the teacher's logprobs are packed per token, a group whose rewards
tie still trains (it has the teacher's signal), zero-advantage skipping keeps its rows, and the student moves toward
the teacher; with forward_kl, the teacher's top-k is packed, scored on every forward path, and trained toward."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.flattening import completion_logps, flatten
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.prefix_sharing import share_prompts
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_flattening import assert_same_step, completion_real, ragged_batch
from .test_flattening import learner as gradient_learner
from .test_prefix_sharing import grouped_batch
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


# ---------------------------------------------------------------- distillation_loss: forward_kl (the teacher's top-k)
def with_topk(batch: TrainBatch, k: int = 3, seed: int = 0) -> TrainBatch:
    """`batch` with a teacher's top-k on every group: k random ids per position, logprobs by rank, one group's
    last position with a single entry (the rest NaN), as the teacher's client leaves a short answer."""
    gen = torch.Generator().manual_seed(seed)
    for g, grp in enumerate(batch.groups):
        grp.teacher_logprobs = [[-1.0] * len(c) for c in grp.completion_ids]
        grp.teacher_topk_ids = [
            [torch.randperm(200, generator=gen)[:k].tolist() for _ in c] for c in grp.completion_ids
        ]
        grp.teacher_topk_logprobs = [[[-0.5 - j for j in range(k)] for _ in c] for c in grp.completion_ids]
        if g == 0:
            grp.teacher_topk_logprobs[0][-1] = [-0.5] + [math.nan] * (k - 1)
        grp.check_teacher_logprobs()
    return batch


def test_pack_batch_lays_out_the_teachers_topk(tiny_model):
    batch = with_topk(tied_batch(tiny_model, 1.0), k=3)
    batch.groups[1].teacher_topk_ids = batch.groups[1].teacher_topk_logprobs = []  # a group without a top-k
    packed = pack_batch(batch, PAD)
    assert packed.teacher_topk_ids.shape == packed.teacher_topk_logps.shape == (4, len(GOOD), 3)
    assert packed.teacher_topk_ids[0].tolist() == batch.groups[0].teacher_topk_ids[0]
    assert torch.isnan(packed.teacher_topk_logps[1, -1]).all()  # BAD is one token shorter: padding
    assert torch.isnan(packed.teacher_topk_logps[2:]).all() and not packed.teacher_topk_ids[2:].any()
    targets = packed.scored_targets()
    assert targets.shape == (4, len(GOOD), 4) and torch.equal(targets[..., 0], packed.completion_ids)
    plain = pack_batch(tied_batch(tiny_model, 1.0), PAD)
    assert plain.teacher_topk_ids.shape == (4, len(GOOD), 0) and plain.scored_targets() is None


def reference_scores(model, packed) -> torch.Tensor:
    """(N, T, 1 + K) log_softmax of one full forward of the padded batch, gathered at `scored_targets`."""
    t = packed.completion_ids.size(1)
    with torch.no_grad():
        logits = (
            model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids)
            .logits[:, -(t + 1) : -1]
            .float()
        )
    return torch.log_softmax(logits, -1).gather(-1, packed.scored_targets())


@pytest.mark.parametrize("layout", ["padded", "flattened", "shared-prompt"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_every_forward_path_scores_the_topk_like_a_full_log_softmax(tiny_model, layout, chunk_size):
    """The sampled token and the teacher's top-k are scored in the same pass on the padded, flattened and
    shared-prompt layouts, with and without the chunked LM head, and equal a full log-softmax gathered at them."""
    batch = with_topk(grouped_batch(), k=3) if layout == "shared-prompt" else with_topk(ragged_batch(), k=3)
    packed = pack_batch(batch, PAD)
    mb = {"padded": packed, "flattened": flatten(packed, None), "shared-prompt": share_prompts(packed)}[layout]
    got, _ = completion_logps(tiny_model, mb, chunk_size=chunk_size, targets=packed.scored_targets())
    want = reference_scores(tiny_model, packed)
    real = completion_real(packed)
    assert got.shape == want.shape == (*packed.completion_ids.shape, 4)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    sampled, _ = completion_logps(tiny_model, mb, chunk_size=chunk_size)
    torch.testing.assert_close(got[..., 0][real], sampled[real], atol=1e-6, rtol=0)  # the same as a plain pass


def test_a_forward_kl_step_moves_the_student_toward_the_teachers_topk(tiny_model):
    """distillation_only with forward_kl on a tied group (no GRPO signal at all): the teacher puts 0.9 on GOOD's
    next token at every position of both rows; one step raises GOOD's logprob and lowers BAD's, the step's metrics
    report the forward KL, and the flattened and shared-prompt learners compute the padded learner's gradients."""

    def batch():
        b = tied_batch(tiny_model, 0.0)
        b.groups = b.groups[:1]
        grp = b.groups[0]
        grp.teacher_topk_ids = [[[GOOD[min(j, len(GOOD) - 1)], 0] for j in range(len(c))] for c in grp.completion_ids]
        grp.teacher_topk_logprobs = [[[math.log(0.9), math.log(0.05)]] * len(c) for c in grp.completion_ids]
        grp.check_teacher_logprobs()
        return b

    kw = dict(distillation_weight=1.0, distillation_only=True, distillation_loss="forward_kl",
              vllm_importance_sampling_correction=False)  # fmt: skip
    before = summed_logps(tiny_model)
    metrics = learner(tiny_model, skip=True, **kw).step(batch())
    after = summed_logps(tiny_model)
    assert after[0] > before[0] + 0.05 and after[1] < before[1]
    assert metrics["distill/forward_kl"] > 0.5 and metrics["distill/topk_mass"] == pytest.approx(0.95, abs=1e-5)
    assert metrics["skipped_zero_adv_completions"] == 0.0  # a teacher-scored row always trains
    models = [copy.deepcopy(tiny_model) for _ in range(3)]  # gradients compared (no-op optimizers)
    want = gradient_learner(models[0], flattening=False, **kw).step(batch())
    for model, options in zip(models[1:], (dict(flattening=True), dict(flattening=False, share_prompt_prefix=True))):
        got = gradient_learner(model, **options, **kw).step(batch())
        assert_same_step(models[0], want, model, got)
