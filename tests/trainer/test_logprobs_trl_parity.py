"""Per-token logprobs and entropies of the trainer against TRL 1.16's own code, on the tiny Qwen2 in float32.

Oracle: ``GRPOTrainer._get_per_token_logps_and_entropies`` on a copy patched with TRL's fused LM head
(``tests/algorithms/_trl_oracle.py``). Ours: ``completion_logps_from_model`` on ``pack_batch`` tensors,
full logits (``logits_to_keep``) and the chunked LM head.

What the two do differently, and what each test pins down:

- Positions. TRL passes only ``input_ids`` and ``attention_mask``; Qwen2 then uses
  ``position_ids = arange(P + T)`` for every row, so a row with k left pads starts its prompt at
  position k. We pass ``cumsum(attention_mask) - 1`` (clamped at 0): each row starts at 0, as vLLM sees
  it (vLLM never pads). Qwen2 has no absolute position embedding and RoPE attention scores depend only
  on ``m - n``, so the offset cancels in exact arithmetic. In float32 it does not quite: transformers
  computes the rotary angles ``position * inv_freq`` in float32 (even for a float64 model), and shifted
  angles round differently, so ragged rows differ by a few ulp. With equal-length prompts (no left
  padding) positions agree on every real token (right padding sits after them, and attention is causal)
  and the logprobs are bit-identical.
- LM head. TRL folds the logits through an online logsumexp over the flattened (B * L, H) hidden states;
  we run ``F.linear`` + ``selective_log_softmax`` on (B, T, H). Same float32 logits, same logprobs here.
- Entropy. TRL: ``log Z - sum_v p_v z_v``; ours: ``-sum_v p_v log p_v``. Equal in exact arithmetic, but
  each is a float32 reduction over V terms of magnitude ~H ~ log V, so they differ by a few ulp.
- Padding. TRL returns 0 at padding; ours returns the (meaningless) logprob of the pad token there. The
  loss masks both; comparisons below are on real completion tokens only.
- Temperature. TRL divides the logits by ``args.temperature`` (as vLLM's ``processed_logprobs`` do);
  the trainer scores at temperature 1 (see ``test_trl_divides_logits_by_temperature``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from algorithms._trl_oracle import GRPOTrainer, trl_fused_model, trl_per_token_logps_and_entropies

from async_grpo.algorithms import selective_log_softmax
from async_grpo.trainer.logprobs import completion_logps_from_model
from async_grpo.trainer.packing import PackedBatch, pack_batch
from async_grpo.transports.messages import TrainBatch

from .test_trainer import PAD, make_group

pytestmark = pytest.mark.skipif(GRPOTrainer is None, reason="trl (dev dependency) is not installed")

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0
CHUNK_SIZES = [None, 1, 3, 64]  # None: full logits; 64 > T: a single block


def ulps(values: torch.Tensor, k: int) -> float:
    """``k`` float32 ulps at the largest magnitude in ``values`` (ulp(x) = eps * 2**floor(log2|x|))."""
    top = values.abs().max().item()
    return k * EPS32 * 2.0 ** math.floor(math.log2(top))


def entropy_tol(entropy: torch.Tensor, vocab: int) -> float:
    """Rounding bound for two float32 entropy formulas: a V-term reduction of values summing to H carries
    up to ceil(log2 V) * eps * H of rounding error (pairwise-summation bound, Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., sec. 4.2). H ~ log V ~ 5.8 here, whose ulp is 4.8e-7, so
    the requested 1e-6 would be 2 ulp: below what two different V-term formulas can promise."""
    return math.ceil(math.log2(vocab)) * EPS32 * entropy.abs().max().item()


def byte_batch(prompt_lens: list[int], completion_lens: list[list[int]], seed: int) -> TrainBatch:
    """One group per prompt; random byte tokens (ids 0..255), as the tiny tokenizer produces."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    groups = [
        make_group(tokens(p), [tokens(c) for c in comps], [0.0] * len(comps))
        for p, comps in zip(prompt_lens, completion_lens, strict=True)
    ]
    return TrainBatch(groups=groups)


# Same prompt length everywhere (no left padding), ragged completions (right padding).
EQUAL = pack_batch(byte_batch([9, 9], [[6, 2, 11], [1, 8]], seed=1), PAD)
# Prompt lengths 2..13: up to 11 left pads per row.
RAGGED = pack_batch(byte_batch([2, 13, 6, 1], [[6, 2], [9], [4, 11], [7]], seed=2), PAD)


def ours(model, mb: PackedBatch, chunk_size: int | None = None, position_ids: torch.Tensor | None = None):
    pos = mb.position_ids if position_ids is None else position_ids
    return completion_logps_from_model(
        model, mb.input_ids, mb.attention_mask, pos, mb.completion_ids, chunk_size=chunk_size, with_entropy=True
    )


def trl(trl_model, mb: PackedBatch):
    return trl_per_token_logps_and_entropies(trl_model, mb.input_ids, mb.attention_mask, mb.completion_ids.size(1))


def arange_positions(mb: PackedBatch) -> torch.Tensor:
    """The positions Qwen2 uses when TRL passes no position_ids: 0..P+T-1 on every row."""
    return torch.arange(mb.input_ids.size(1)).expand_as(mb.input_ids)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trl_model(model):
    return trl_fused_model(model).eval()


@pytest.fixture(scope="module")
def trl_out(trl_model):
    with torch.no_grad():
        return {"equal": trl(trl_model, EQUAL), "ragged": trl(trl_model, RAGGED)}


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_equal_length_prompts_match_trl(model, trl_out, chunk_size):
    mask = EQUAL.completion_mask.bool()
    assert not EQUAL.attention_mask[:, 0].eq(0).any()  # no left padding
    assert mask.sum() < mask.numel()  # but ragged completions: right padding is exercised
    trl_logps, trl_ent = trl_out["equal"]
    with torch.no_grad():
        logps, ent = ours(model, EQUAL, chunk_size)
    torch.testing.assert_close(logps[mask], trl_logps[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[mask], trl_ent[mask], rtol=0, atol=entropy_tol(trl_ent[mask], 320))
    assert trl_logps[~mask].eq(0).all() and trl_ent[~mask].eq(0).all()  # TRL zeroes padding; ours is masked later


def test_trl_passes_no_positions_so_left_padded_rows_start_at_their_pad_count(model, trl_model):
    seen = []
    hook = trl_model.model.rotary_emb.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
    try:
        with torch.no_grad():
            trl(trl_model, RAGGED)
    finally:
        hook.remove()
    assert len(seen) == 1
    first_real = RAGGED.attention_mask.argmax(-1)  # = number of left pads
    assert first_real.tolist() == [13 - p for p in (2, 2, 13, 6, 6, 1)]
    rows = torch.arange(len(RAGGED))
    trl_pos = seen[0].expand_as(RAGGED.input_ids)
    assert torch.equal(trl_pos, arange_positions(RAGGED))
    assert torch.equal(trl_pos[rows, first_real], first_real)  # TRL: the first prompt token sits at the pad count
    assert RAGGED.position_ids[rows, first_real].eq(0).all()  # ours: at 0, as in vLLM


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_ragged_prompts_differ_from_trl_only_through_positions(model, trl_out, chunk_size):
    mask = RAGGED.completion_mask.bool()
    trl_logps, trl_ent = trl_out["ragged"]
    with torch.no_grad():
        same_pos, same_pos_ent = ours(model, RAGGED, chunk_size, position_ids=arange_positions(RAGGED))
        logps, ent = ours(model, RAGGED, chunk_size)
    # given TRL's positions, ours reproduces TRL: the positions are the only difference
    torch.testing.assert_close(same_pos[mask], trl_logps[mask], rtol=0, atol=1e-6)
    # with our positions, only float32 rotary-angle rounding remains (the offset cancels exactly, see
    # test_position_offset_cancels_in_float64): a few ulp of |logp| ~ 6, where 1e-6 would be 2 ulp
    torch.testing.assert_close(logps[mask], trl_logps[mask], rtol=0, atol=ulps(trl_logps[mask], 4))
    tol = entropy_tol(trl_ent[mask], 320)
    torch.testing.assert_close(same_pos_ent[mask], trl_ent[mask], rtol=0, atol=tol)
    torch.testing.assert_close(ent[mask], trl_ent[mask], rtol=0, atol=tol)


def test_ragged_rows_equal_unpadded_single_row_forward(model):
    """Each padded row equals its own unpadded forward, which is what vLLM computes."""
    mask = RAGGED.completion_mask.bool()
    with torch.no_grad():
        logps, _ = ours(model, RAGGED)
        for i in range(len(RAGGED)):
            keep = RAGGED.attention_mask[i].bool()
            ids = RAGGED.input_ids[i][keep].unsqueeze(0)
            n = int(mask[i].sum())
            single, _ = completion_logps_from_model(
                model, ids, torch.ones_like(ids), torch.arange(ids.size(1))[None], ids[:, ids.size(1) - n :]
            )
            # float32: the padded row's attention reduces over masked keys too, so a few ulp of rounding
            torch.testing.assert_close(logps[i, :n], single[0], rtol=0, atol=ulps(single, 4))


def _f64_rotary(self, x, position_ids):
    """Qwen2RotaryEmbedding.forward with the angles in float64 (transformers forces float32)."""
    dim = self.config.hidden_size // self.config.num_attention_heads
    inv_freq = 1.0 / self.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _f64_logps(model, input_ids, attention_mask, position_ids, n: int) -> torch.Tensor:
    hidden = model.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state[:, -(n + 1) : -1]
    return torch.log_softmax(model.lm_head(hidden), -1).gather(-1, input_ids[:, -n:, None]).squeeze(-1)


def test_position_offset_cancels_in_float64(model, monkeypatch):
    """In float64 (rotary angles too) TRL's arange positions, ours, and the unpadded row agree to 1e-12."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    monkeypatch.setattr(Qwen2RotaryEmbedding, "forward", _f64_rotary)
    m64 = copy.deepcopy(model).double()
    mask = RAGGED.completion_mask.bool()
    n = RAGGED.completion_ids.size(1)
    with torch.no_grad():
        ours64 = _f64_logps(m64, RAGGED.input_ids, RAGGED.attention_mask, RAGGED.position_ids, n)
        trl_pos64 = _f64_logps(m64, RAGGED.input_ids, RAGGED.attention_mask, arange_positions(RAGGED), n)
        torch.testing.assert_close(ours64[mask], trl_pos64[mask], rtol=0, atol=1e-12)
        # positions are consumed (only their differences cancel): stretching them changes the logprobs
        stretched = _f64_logps(m64, RAGGED.input_ids, RAGGED.attention_mask, 3 * RAGGED.position_ids, n)
        assert (stretched[mask] - ours64[mask]).abs().max() > 1e-3
        for i in range(len(RAGGED)):
            ids = RAGGED.input_ids[i][RAGGED.attention_mask[i].bool()].unsqueeze(0)
            k = int(mask[i].sum())
            single = _f64_logps(m64, ids, torch.ones_like(ids), torch.arange(ids.size(1))[None], k)
            torch.testing.assert_close(ours64[i, :k], single[0], rtol=0, atol=1e-12)


def test_gradients_match_trl(model):
    """d(sum_t w_t logp_t)/d(params) through our autograd and through TRL's custom backward."""
    ours_model, trl_copy = copy.deepcopy(model), trl_fused_model(model)
    mask = RAGGED.completion_mask
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    logps, _ = ours(ours_model, RAGGED, chunk_size=3)
    (logps * w).sum().backward()
    trl_logps, _ = trl(trl_copy, RAGGED)
    (trl_logps * w).sum().backward()
    for (name, p), (trl_name, q) in zip(ours_model.named_parameters(), trl_copy.named_parameters(), strict=True):
        assert name == trl_name
        # sums over B * T tokens reassociated differently: 1e-5 of the largest entry (measured ~1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5 * q.grad.abs().max().item(), msg=name)


def test_trl_divides_logits_by_temperature(model):
    """TRL scores log_softmax(logits / temperature), like vLLM's processed_logprobs; the trainer uses
    temperature 1, so with temperature != 1 the two conventions differ by far more than rounding."""
    trl_hot = trl_fused_model(model, temperature=0.7).eval()
    mask = EQUAL.completion_mask.bool()
    n = EQUAL.completion_ids.size(1)
    with torch.no_grad():
        trl_logps, _ = trl(trl_hot, EQUAL)
        logits = (
            model(
                input_ids=EQUAL.input_ids,
                attention_mask=EQUAL.attention_mask,
                position_ids=EQUAL.position_ids,
                logits_to_keep=n + 1,
            )
            .logits[:, :-1]
            .float()
        )
        scaled = selective_log_softmax(logits / 0.7, EQUAL.completion_ids)
        ours_t1, _ = ours(model, EQUAL)
    torch.testing.assert_close(scaled[mask], trl_logps[mask], rtol=0, atol=ulps(trl_logps[mask], 4))
    assert (ours_t1[mask] - trl_logps[mask]).abs().max() > 1e-3
