"""Zero-advantage skipping: counted, and the step equals the unskipped one. dapo / cispo drop single
completions (`GRPOLearner.row_skipping`); the other loss types, and a top-entropy mask, skip whole micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import BAD, GOOD, PAD, PROMPT, direct_logps, make_group


def make_learner(model, skip: bool, micro_batch_size: int = 2, **loss_kw) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=micro_batch_size,
        loss=LossSettings(**loss_kw),
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


def assert_same_parameters(a_model, b_model, atol: float = 1e-6) -> None:
    for a, b in zip(a_model.parameters(), b_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("loss_kw", [{"loss_type": "grpo"}, {"loss_type": "dapo", "top_entropy_quantile": 0.5}])
def test_micro_batch_skipping_is_counted_and_exact(tiny_model, loss_kw):
    other = copy.deepcopy(tiny_model)
    skipping = make_learner(tiny_model, skip=True, **loss_kw)
    plain = make_learner(other, skip=False, **loss_kw)
    assert not skipping.row_skipping
    batch = batch_with_a_flat_group(tiny_model)
    m1 = skipping.step(batch)
    m2 = skipping.step(batch)
    plain.step(batch)
    plain.step(batch)
    assert m1["skipped_zero_adv_microbatches"] == 1.0 and m2["skipped_zero_adv_microbatches"] == 2.0
    assert m2["skipped_zero_adv_completions"] == 0.0
    assert_same_parameters(tiny_model, other)


def batch_with_scattered_zeros(model) -> TrainBatch:
    """Four groups of 2 whose zero-advantage completions share micro-batches with the others (no micro-batch of
    2 is all zeros, in row order or by length): only row skipping can leave them out."""
    logps = [direct_logps(model, PROMPT, c).tolist() for c in (GOOD, BAD)]
    return TrainBatch(
        groups=[
            make_group(PROMPT, [GOOD, BAD], [1.0, 0.0], logprobs=logps),
            make_group(PROMPT, [BAD, GOOD], [0.0, -0.5], logprobs=logps[::-1]),
            make_group(PROMPT, [GOOD, BAD], [0.0, 0.0], logprobs=logps),
            make_group(PROMPT, [BAD, GOOD], [0.7, -0.7], logprobs=logps[::-1]),
        ]
    )


@pytest.mark.parametrize("loss_kw", [{"loss_type": "dapo"}, {"loss_type": "cispo", "epsilon_high": 5.0}])
@pytest.mark.parametrize("streamed", [False, True])
def test_row_skipping_drops_single_completions_and_keeps_the_update(tiny_model, loss_kw, streamed):
    """dapo / cispo divide by the step's tokens, counted before the skip: dropping the 4 zero-advantage completions
    (2 steps: 8) leaves the parameters, loss and token count of the unskipped learner."""
    other = copy.deepcopy(tiny_model)
    skipping = make_learner(tiny_model, skip=True, micro_batch_size=2, **loss_kw)
    plain = make_learner(other, skip=False, micro_batch_size=2, **loss_kw)
    assert skipping.row_skipping and not plain.row_skipping
    batch = batch_with_scattered_zeros(tiny_model)
    chunks = [TrainBatch(groups=batch.groups[:2]), TrainBatch(groups=batch.groups[2:])]
    for step in (1, 2):
        got = skipping.step(iter(chunks) if streamed else batch)
        want = plain.step(iter(chunks) if streamed else batch)
        assert got["skipped_zero_adv_completions"] == 4.0 * step and got["skipped_zero_adv_microbatches"] == 0.0
        assert got["num_tokens"] == want["num_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    # other micro-batches sum the same terms in another order: float rounding, which AdamW's first steps (update
    # about lr * sign(g)) can lift to ~1e-6 where a gradient is near 0; a lost or double-counted term moves ~lr
    assert_same_parameters(tiny_model, other, atol=1e-5)


def test_old_logps_for_rollout_reuse_count_no_skipped_completion(tiny_model):
    learner = make_learner(tiny_model, skip=True)
    batch = batch_with_scattered_zeros(tiny_model)
    old = learner.old_logps(batch)
    assert learner.skipped_zero_adv_completions == 0
    assert learner.step(batch, old_logps=old)["skipped_zero_adv_completions"] == 4.0


def test_row_skipping_a_batch_without_signal_takes_no_forward_pass(tiny_model):
    learner = make_learner(tiny_model, skip=True)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    flat = TrainBatch(groups=[make_group(PROMPT, [GOOD, BAD], [0.0, 0.0])])
    metrics = learner.step(flat)
    assert metrics["skipped_zero_adv_completions"] == 2.0 and metrics["loss"] == 0.0
    assert metrics["num_tokens"] == float(len(GOOD) + len(BAD))
    for a, b in zip(tiny_model.parameters(), before, strict=True):
        assert torch.equal(a, b)
    state = learner.state_dict()
    assert state["skipped_zero_adv_completions"] == 2
    fresh = make_learner(copy.deepcopy(tiny_model), skip=True)
    fresh.load_state_dict(state)
    assert fresh.skipped_zero_adv_completions == 2


def test_the_learner_itself_refuses_skipping_with_a_kl_term(tiny_model):
    """Regression (shared/repros/skip_with_kl_guard.py): a skipped micro-batch would lose its KL gradient (118% off),
    so the learner refuses the combination even when built without the config's check."""
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
