"""Trainer: packing into padded tensors, per-token logprobs under padding, and GRPOLearner steps on the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.packing import PackedBatch, completion_logps, pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import RolloutGroup, TrainBatch

PAD = 256  # <|endoftext|> in the tiny tokenizer


def make_group(prompt_ids, completion_ids, advantages, truncated=None, logprobs=None, version=0) -> RolloutGroup:
    g = len(completion_ids)
    return RolloutGroup(
        prompt_ids=list(prompt_ids),
        completion_ids=[list(c) for c in completion_ids],
        sampling_logprobs=logprobs or [[-0.1 * (j + 1) for j in range(len(c))] for c in completion_ids],
        truncated=truncated or [False] * g,
        completions=["" for _ in completion_ids],
        prompt="p",
        columns={},
        policy_version=version,
        advantages=list(advantages),
    )


def mixed_batch() -> TrainBatch:
    """Two groups: prompt lengths 3 and 2, completion lengths 2, 4 | 1, 3; row 1 is truncated."""
    return TrainBatch(groups=[
        make_group([1, 2, 3], [[10, 11], [12, 13, 14, 15]], [1.0, -1.0], truncated=[False, True]),
        make_group([4, 5], [[20], [21, 22, 23]], [0.5, -0.5]),
    ])  # fmt: skip


# ------------------------------------------------------------------ pack_batch
def test_pack_batch_shapes_and_padding():
    packed = pack_batch(mixed_batch(), PAD)
    assert len(packed) == 4
    assert packed.input_ids.shape == (4, 3 + 4)
    assert packed.completion_ids.shape == (4, 4)
    P = PAD
    assert packed.input_ids.tolist() == [
        [1, 2, 3, 10, 11, P, P],
        [1, 2, 3, 12, 13, 14, 15],
        [P, 4, 5, 20, P, P, P],  # prompt left-padded, completion right-padded
        [P, 4, 5, 21, 22, 23, P],
    ]
    assert packed.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
    ]
    assert packed.completion_ids.tolist() == [[10, 11, P, P], [12, 13, 14, 15], [20, P, P, P], [21, 22, 23, P]]
    assert packed.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert packed.advantages.tolist() == [1.0, -1.0, 0.5, -0.5]
    expected_lps = torch.tensor([[-0.1, -0.2, 0, 0], [-0.1, -0.2, -0.3, -0.4], [-0.1, 0, 0, 0], [-0.1, -0.2, -0.3, 0]])
    torch.testing.assert_close(packed.sampling_logps, expected_lps)
    assert packed.input_ids.dtype == torch.long and packed.completion_mask.dtype == torch.float32


def test_pack_batch_position_ids_start_at_first_real_token():
    packed = pack_batch(mixed_batch(), PAD)
    for row in range(len(packed)):
        real = packed.attention_mask[row].bool()
        first = int(real.nonzero()[0])
        assert packed.position_ids[row, first] == 0
        assert packed.position_ids[row][real].tolist() == list(range(int(real.sum())))
    assert packed.position_ids[2].tolist()[:4] == [0, 0, 1, 2]  # left pad, then 0, 1, 2


def test_pack_batch_mask_truncated_zeroes_truncated_rows():
    packed = pack_batch(mixed_batch(), PAD, mask_truncated=True)
    assert packed.completion_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
    # the tokens themselves are still in the sequence (only the loss ignores them)
    assert packed.completion_ids[1].tolist() == [12, 13, 14, 15]
    assert packed.attention_mask[1].sum() == 7


def test_pack_batch_empty_completions_keep_one_column():
    packed = pack_batch(TrainBatch(groups=[make_group([7, 8], [[], []], [0.0, 0.0])]), PAD)
    assert packed.completion_ids.shape == (2, 1)
    assert packed.completion_mask.sum() == 0


def test_packed_batch_slice():
    packed = pack_batch(mixed_batch(), PAD)
    part = packed.slice(1, 3)
    assert isinstance(part, PackedBatch) and len(part) == 2
    assert torch.equal(part.input_ids, packed.input_ids[1:3])
    assert part.advantages.tolist() == [-1.0, 0.5]


# ------------------------------------------------------------------ completion_logps
def direct_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logprobs of `completion` after `prompt` from one unpadded sequence (no mask, default positions)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (L, V)
    logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(completion)])


def test_completion_logps_match_unpadded_forward(tiny_model):
    tiny_model.eval()
    batch = TrainBatch(groups=[
        make_group([72, 101, 108, 108, 111, 32], [[119, 111], [114, 108, 100, 33, 10]], [1.0, -1.0]),
        make_group([97], [[98, 99, 100], [256]], [0.5, -0.5]),
        make_group([257, 65, 66], [[67, 68, 69, 70, 71, 72], [258]], [0.1, -0.1]),
    ])  # fmt: skip
    packed = pack_batch(batch, PAD)
    with torch.no_grad():
        logps, entropy = completion_logps(tiny_model, packed, with_entropy=True)
    assert logps.shape == packed.completion_ids.shape == entropy.shape
    rows = [(grp.prompt_ids, c) for grp in batch.groups for c in grp.completion_ids]
    for i, (prompt, comp) in enumerate(rows):
        expected = direct_logps(tiny_model, prompt, comp)
        torch.testing.assert_close(logps[i, : len(comp)], expected, atol=1e-5, rtol=0)
    valid = packed.completion_mask.bool()
    assert torch.isfinite(entropy[valid]).all()
    assert (entropy[valid] > 0).all() and (entropy[valid] <= math.log(tiny_model.config.vocab_size) + 1e-4).all()


def test_completion_logps_is_differentiable(tiny_model):
    packed = pack_batch(mixed_batch(), PAD)
    logps, entropy = completion_logps(tiny_model, packed)
    assert entropy is None
    (logps * packed.completion_mask).sum().backward()
    grads = [p.grad for p in tiny_model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


# ------------------------------------------------------------------ GRPOLearner
PROMPT = [80, 114, 111, 109, 112, 116, 58]  # "Prompt:"
GOOD = [65, 66, 67, 68]  # completion A, advantage +1
BAD = [120, 121, 122]  # completion B, advantage -1


def summed_logps(model, completions=(GOOD, BAD)) -> list[float]:
    was_training = model.training
    model.eval()
    out = [float(direct_logps(model, PROMPT, c).sum()) for c in completions]
    model.train(was_training)
    return out


def on_policy_batch(model) -> TrainBatch:
    """Group (A: +1, B: -1) whose sampling logprobs are the model's own, so the IS weights are 1."""
    logps = [direct_logps(model, PROMPT, c).tolist() for c in (GOOD, BAD)]
    return TrainBatch(groups=[make_group(PROMPT, [GOOD, BAD], [1.0, -1.0], logprobs=logps)])


def make_learner(model, micro_batch_size=2, lr=1e-3, **loss_kw) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=micro_batch_size,
        loss=LossSettings(**loss_kw),
        pad_token_id=PAD,
    )


def test_learner_raises_positive_and_lowers_negative_advantage(tiny_model):
    before_a, before_b = summed_logps(tiny_model)
    batch = on_policy_batch(tiny_model)
    learner = make_learner(tiny_model)
    first = learner.step(batch)
    for _ in range(2):
        learner.step(batch)
    after_a, after_b = summed_logps(tiny_model)
    assert after_a > before_a + 0.1
    assert after_b < before_b - 0.1
    for key in ("loss", "entropy", "grad_norm", "clip_ratio/region_mean", "sampling/importance_sampling_ratio/mean"):
        assert key in first and math.isfinite(first[key]), key
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["clip_ratio/region_mean"] == 0.0  # on-policy: ratio 1, nothing clipped
    assert first["grad_norm"] > 0
    assert first["entropy"] > 0
    assert first["num_tokens"] == len(GOOD) + len(BAD)
    assert first["learning_rate"] == 1e-3
    assert "kl" not in first


def test_learner_reports_kl_when_beta_positive(tiny_model):
    batch = on_policy_batch(tiny_model)
    learner = make_learner(tiny_model, beta=0.1)
    first = learner.step(batch)
    second = learner.step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the initial policy
    assert second["kl"] > 0.0  # the policy moved away from the reference


def test_learner_ignores_masked_truncated_completion(tiny_model):
    """With mask_truncated_completions a truncated completion contributes no tokens and no change on its own."""
    logps = [direct_logps(tiny_model, PROMPT, c).tolist() for c in (GOOD, BAD)]
    batch = TrainBatch(groups=[make_group(PROMPT, [GOOD, BAD], [0.0, -1.0], truncated=[False, True], logprobs=logps)])
    before = [p.detach().clone() for p in tiny_model.parameters()]
    metrics = make_learner(tiny_model, mask_truncated_completions=True).step(batch)
    assert metrics["num_tokens"] == len(GOOD)
    assert metrics["grad_norm"] == pytest.approx(0.0, abs=1e-8)  # A has advantage 0, B is masked
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, tiny_model.parameters(), strict=True))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_micro_batching_gives_the_same_step(tiny_model, loss_type):
    """Gradient accumulation over 1-completion micro-batches equals one 4-completion micro-batch."""
    other = copy.deepcopy(tiny_model)
    logps = [direct_logps(tiny_model, PROMPT, c).tolist() for c in (GOOD, BAD, GOOD[:2], BAD[:1])]
    batch = TrainBatch(
        groups=[make_group(PROMPT, [GOOD, BAD, GOOD[:2], BAD[:1]], [1.0, -1.0, 0.5, -0.5], logprobs=logps)]
    )
    whole = make_learner(tiny_model, micro_batch_size=4, loss_type=loss_type).step(copy.deepcopy(batch))
    split = make_learner(other, micro_batch_size=1, loss_type=loss_type).step(copy.deepcopy(batch))
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-6)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    # The step leaves the (clipped) accumulated gradients in .grad; compare those, not the Adam-normalised update.
    for a, b in zip(tiny_model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)
