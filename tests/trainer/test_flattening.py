"""Padding-free batch flattening (`trainer.flattening`): the flat layout, and parity with the padded path for the
per-token logprobs, entropies, hidden states, the loss and the gradients (float32, tiny model), with sequences of
very different lengths and multi-turn loss masks (tool-output tokens inside a completion)."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.flattening import (
    FlattenedBatch,
    completion_hidden_states,
    completion_logps,
    flat_row_tokens,
    flatten,
)
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_trainer import PAD, make_group


def ragged_batch() -> TrainBatch:
    """Two groups: prompts of 3 and 1 tokens, completions of 2, 23 | 1, 9 tokens; multi-turn loss masks (0 on
    tool-output tokens in the middle of completions 1 and 3), off-policy sampling logprobs."""
    long = list(range(30, 53))
    groups = [
        make_group([1, 2, 3], [[10, 11], long], [1.0, -0.5]),
        make_group([4], [[20], [21, 22, 23, 24, 25, 26, 27, 28, 29]], [0.5, -1.5]),
    ]
    groups[0].loss_mask[1] = [1] * 5 + [0] * 10 + [1] * 8
    groups[1].loss_mask[1] = [1, 1, 0, 0, 0, 1, 1, 1, 1]
    for g in groups:
        g.sampling_logprobs = [[-0.3 - 0.01 * j for j in range(len(c))] for c in g.completion_ids]
    return TrainBatch(groups=groups)


def completion_real(packed) -> torch.Tensor:
    """(N, T) True on the completion tokens (padding excluded)."""
    t = packed.completion_ids.size(1)
    return packed.attention_mask[:, -t:].bool()


def test_flatten_layout_concatenates_real_tokens_and_restarts_positions():
    packed = pack_batch(
        TrainBatch(groups=[make_group([1, 2, 3], [[10, 11]], [1.0]), make_group([4], [[20, 21, 22]], [1.0])]), PAD
    )
    flat = flatten(packed)
    assert isinstance(flat, FlattenedBatch)
    assert flat.layout.input_ids.tolist() == [[1, 2, 3, 10, 11, 4, 20, 21, 22]]
    assert flat.layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # completion token j of a row is predicted by the token before it: flat positions 2, 3 | 5, 6, 7
    assert flat.layout.source.tolist() == [2, 3, 5, 6, 7]
    assert flat.layout.rows.tolist() == [0, 0, 1, 1, 1] and flat.layout.cols.tolist() == [0, 1, 0, 1, 2]
    torch.testing.assert_close(flat.completion_mask, packed.completion_mask)  # the loss sees the same tensors
    with pytest.raises(TypeError, match="cut the PackedBatch first"):
        flat.slice(0, 1)


def test_bounded_rows_pack_longest_first_and_pad_row_ends_as_their_own_sequence():
    # sequences of 5, 4 | 3, 2 tokens in rows of at most 6: [5], [4, 2], [3] (first fit, longest first)
    packed = pack_batch(
        TrainBatch(
            groups=[
                make_group([1, 2, 3], [[10, 11], [12]], [1.0, -1.0]),
                make_group([4], [[20, 21], [24]], [1.0, -1.0]),
            ]
        ),
        PAD,
    )
    flat = flatten(packed, row_tokens=6)
    assert flat.layout.input_ids.tolist() == [[1, 2, 3, 10, 11, 0], [1, 2, 3, 12, 4, 24], [4, 20, 21, 0, 0, 0]]
    assert flat.layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    # each completion token is predicted from the flat position (row * 6 + column) of the token before it
    assert flat.layout.source.tolist() == [2, 3, 8, 12, 13, 10]
    assert flatten(packed, row_tokens=0).layout.input_ids.size(1) == 5  # 0: as wide as the longest sequence


def test_row_tokens_follow_the_attention_implementation(tiny_model):
    assert flat_row_tokens(tiny_model) == 0  # sdpa: bounded rows
    assert flat_row_tokens(tiny_model, sharded=True) is None  # FSDP: only the root forward gathers the root's params
    tiny_model.config._attn_implementation = "flash_attention_2"
    assert flat_row_tokens(tiny_model) is None  # variable-length kernels: one row


@pytest.mark.parametrize("row_tokens", [None, 0], ids=["one-row", "bounded-rows"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logprobs_and_entropies_match_the_padded_path(tiny_model, attn, chunk_size, row_tokens):
    tiny_model.set_attn_implementation(attn)
    packed = pack_batch(ragged_batch(), PAD)
    want, want_ent = completion_logps(tiny_model, packed, with_entropy=True, chunk_size=chunk_size)
    flat = flatten(packed, row_tokens)
    assert flat.layout.input_ids.size(0) == (1 if row_tokens is None else 2)  # 26 | 3 + 10 + 2 + 1 tokens
    got, got_ent = completion_logps(tiny_model, flat, with_entropy=True, chunk_size=chunk_size)
    real = completion_real(packed)
    assert got.shape == want.shape == packed.completion_ids.shape
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent[real], want_ent[real], atol=1e-5, rtol=0)
    assert torch.count_nonzero(got[~real]) == 0 and torch.count_nonzero(got_ent[~real]) == 0


def test_attention_is_confined_to_each_sequence(tiny_model):
    """The same flat row with positions that do not restart (one long causal sequence) gives other logprobs: the
    parity above holds only because transformers confines attention to each packed sequence."""
    packed = pack_batch(ragged_batch(), PAD)
    flat = flatten(packed)
    want, _ = completion_logps(tiny_model, flat)
    leaky = copy.copy(flat)
    leaky.layout = copy.copy(flat.layout)
    leaky.layout.position_ids = torch.arange(flat.layout.input_ids.size(1)).unsqueeze(0)
    got, _ = completion_logps(tiny_model, leaky)
    real = completion_real(packed)
    assert torch.equal(got[0][real[0]], want[0][real[0]])  # the first sequence sees nothing before it either way
    assert (got[1:][real[1:]] - want[1:][real[1:]]).abs().max() > 1e-3


@pytest.mark.parametrize("row_tokens", [None, 0], ids=["one-row", "bounded-rows"])
def test_hidden_states_for_the_fused_loss_match_the_padded_path(tiny_model, row_tokens):
    packed = pack_batch(ragged_batch(), PAD)
    real = completion_real(packed)
    want = completion_hidden_states(tiny_model, packed)
    got = completion_hidden_states(tiny_model, flatten(packed, row_tokens))
    assert got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def test_a_prompt_less_row_is_refused():
    packed = pack_batch(TrainBatch(groups=[make_group([], [[10, 11]], [1.0])]), PAD)
    with pytest.raises(ValueError, match="at least one prompt token"):
        flatten(packed)


def learner(
    model,
    *,
    flattening: bool,
    micro: int = 2,
    max_tokens: int | None = None,
    group_by_length: bool = False,
    share_prompt_prefix: bool = False,
    **loss_kw,
) -> GRPOLearner:
    """A learner whose optimizer step is a no-op, so the model keeps the step's gradients for comparison."""
    out = GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1e9,
        micro_batch_size=micro,
        loss=LossSettings(max_completion_length=32, **loss_kw),
        pad_token_id=PAD,
        batch_flattening=flattening,
        max_tokens_per_microbatch=max_tokens,
        group_by_length=group_by_length,
        share_prompt_prefix=share_prompt_prefix,
    )
    out.optimizer.step = lambda *a, **k: None
    return out


def assert_same_step(want_model, want_metrics, got_model, got_metrics, atol=1e-5):
    assert got_metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7)
    assert got_metrics["num_tokens"] == want_metrics["num_tokens"]
    for (name, a), b in zip(want_model.named_parameters(), got_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("row_tokens", [None, 0], ids=["one-row", "bounded-rows"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_a_flattened_step_has_the_padded_loss_and_gradients(tiny_model, loss_type, row_tokens):
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type=loss_type, beta=0.05, vllm_importance_sampling_mode="token_truncate")
    padded = learner(tiny_model, flattening=False, **kw)
    flat = learner(other, flattening=True, **kw)
    flat.batching.flat_row_tokens = row_tokens
    old = padded.old_logps(ragged_batch())  # a reuse step: pi_old differs from the current policy
    old = [o - 0.02 for o in old]
    want = padded.step(ragged_batch(), old_logps=old)
    got = flat.step(ragged_batch(), old_logps=old)
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-5)


def test_a_flattened_step_with_the_fused_liger_loss_has_the_padded_step(tiny_model):
    pytest.importorskip("liger_kernel.chunked_loss")
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type="dapo", use_liger_kernel=True)
    want = learner(tiny_model, flattening=False, **kw).step(ragged_batch())
    got = learner(other, flattening=True, **kw).step(ragged_batch())
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)
