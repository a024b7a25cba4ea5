"""Delta weight sync's codec: a patch rebuilds the new tensor bit for bit, in the fewest bytes of its encodings."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.transports.weights import delta
from async_grpo.transports.weights.gloo import GlooWeightTransferEngine
from async_grpo.transports.weights.gloo_wire import GlooWeightTransferUpdateInfo, plan_buckets


def _wire(patch: delta.Patch) -> torch.Tensor:
    """The patch as the receiver sees it: its pieces back to back, at an ALIGN-aligned offset of a bigger buffer."""
    buffer = torch.empty(64 + delta.padded(patch.nbytes), dtype=torch.uint8)
    at = 64
    for piece in patch.pieces:
        buffer[at : at + piece.numel()] = piece
        at += piece.numel()
    return buffer[64 : 64 + patch.nbytes]


def _roundtrip(new: torch.Tensor, previous: torch.Tensor | None) -> tuple[delta.Patch, torch.Tensor]:
    patch = delta.encode(new, previous)
    receiver = None if previous is None else previous.clone()
    rebuilt = delta.decode(
        patch.encoding, patch.count, _wire(patch), receiver, new.dtype, tuple(new.shape), patch.escapes
    )
    return patch, rebuilt


def _changed(previous: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    new = previous.clone()
    flat = new.view(-1)
    index = torch.randperm(flat.numel(), generator=gen)[: int(fraction * flat.numel())]
    flat[index] = (flat[index].float() + 0.5).to(new.dtype)
    return new


def _ulps(previous: torch.Tensor, fraction: float, steps: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """`previous` with `fraction` of its elements moved by one of `steps` in their bit pattern's integer order."""
    gen = torch.Generator().manual_seed(seed)
    new = previous.clone()
    flat = delta.bits(new)
    index = torch.randperm(flat.numel(), generator=gen)[: int(fraction * flat.numel())]
    choice = torch.tensor(steps)[torch.randint(len(steps), (index.numel(),), generator=gen)]
    flat[index] = (flat[index].long() + choice).to(flat.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "fraction, encoding",
    [(0.0, "same"), (0.001, "indices"), (0.2, "mask"), (1.0, "full")],
)
def test_each_encoding_rebuilds_the_new_tensor_bit_for_bit(dtype, fraction, encoding):
    previous = torch.randn(37, 53, generator=torch.Generator().manual_seed(1)).to(dtype)  # 1961: not a multiple of 8
    new = _changed(previous, fraction)
    patch, rebuilt = _roundtrip(new, previous)
    assert patch.encoding == encoding
    assert torch.equal(delta.bits(rebuilt), delta.bits(new))
    numel, itemsize = new.numel(), new.element_size()
    count = int((delta.bits(new) != delta.bits(previous)).sum())
    assert patch.count == (numel if encoding == "full" else count)
    sizes = [delta.payload_bytes(e, numel, count, itemsize) for e in ("full", "indices", "mask")]
    assert patch.nbytes == (0 if count == 0 else min(sizes))  # the smallest encoding is chosen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_small_steps_travel_as_one_byte_each_and_big_ones_escape(dtype):
    """An optimizer step moves most changed elements by a few ulps: `mask_steps` sends one byte for each of those,
    and the value whole for the rest (a step of exactly -128, or beyond +-127, must escape)."""
    previous = torch.randn(4001, generator=torch.Generator().manual_seed(2)).to(dtype)
    new = _ulps(previous, 0.3, (1, -1, 2, -3, 127, -127, -128, 128, 5000))
    patch, rebuilt = _roundtrip(new, previous)
    assert patch.encoding == "mask_steps"
    assert torch.equal(delta.bits(rebuilt), delta.bits(new))
    step = delta.bits(new).long() - delta.bits(previous).long()
    assert patch.escapes == int(((step <= -128) | (step > 127)).sum()) > 0
    assert patch.nbytes == math.ceil(4001 / 8) + patch.count + patch.escapes * new.element_size()


def test_bits_not_values_decide_what_changed():
    """-0.0 == 0.0 and NaN != NaN as floats; the patch follows the bits (a NaN payload and a sign flip travel, the
    same NaN does not)."""
    previous = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 4, dtype=torch.float32)
    new = previous.clone()
    new[0] = -0.0
    new[8] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # another NaN payload
    patch, rebuilt = _roundtrip(new, previous)
    assert patch.count == 2
    assert torch.equal(delta.bits(rebuilt), delta.bits(new))
    flipped = torch.tensor([0.0, -0.0] * 8, dtype=torch.bfloat16)  # the sign bit: a step of -32768, escaped
    patch, rebuilt = _roundtrip(flipped, torch.zeros(16, dtype=torch.bfloat16))
    assert patch.count == 8 and torch.equal(delta.bits(rebuilt), delta.bits(flipped))


def test_the_first_push_is_full_and_decode_returns_a_view():
    new = torch.randn(10, 3).to(torch.bfloat16)
    patch, rebuilt = _roundtrip(new, None)
    assert patch.encoding == "full" and patch.nbytes == new.numel() * 2
    assert torch.equal(delta.bits(rebuilt), delta.bits(new))


def test_mask_packing_roundtrips():
    for n in (1, 7, 8, 9, 1000):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3
        packed = delta.pack_mask(mask)
        assert packed.numel() == math.ceil(n / 8)
        assert torch.equal(delta.unpack_mask(packed, n), mask)
    assert delta.pack_mask(torch.tensor([True, False, True])).tolist() == [0b101]  # little-endian within a byte


def test_a_patch_needs_the_snapshot_it_was_made_against():
    previous = torch.randn(64)
    patch = delta.encode(_changed(previous, 0.05), previous)
    assert patch.encoding in ("indices", "mask")
    with pytest.raises(RuntimeError, match="full push"):
        delta.decode(patch.encoding, patch.count, _wire(patch), None, torch.float32, (64,))
    with pytest.raises(RuntimeError, match="full push"):
        delta.decode(patch.encoding, patch.count, _wire(patch), torch.zeros(65), torch.float32, (64,))
    with pytest.raises(ValueError, match="bytes"):
        delta.decode(patch.encoding, patch.count, _wire(patch)[1:], previous, torch.float32, (64,))
    with pytest.raises(ValueError, match="weight_sync_mode: full"):
        delta.encode(torch.zeros(3), torch.zeros(4))


def test_buckets_cover_every_payload_once_in_order():
    sizes = [16, 0, 40, 8, 0, 64, 8]
    buckets = plan_buckets(sizes, 48)
    assert buckets == [[0], [2, 3], [5], [6]]  # 16 + 40 > 48; 64 alone over the cap; empty payloads skipped
    assert [i for b in buckets for i in b] == [i for i, n in enumerate(sizes) if n]


def test_update_info_validates_and_sizes_payloads():
    info = GlooWeightTransferUpdateInfo(names=["a", "b"], dtype_names=["bfloat16", "float32"], shapes=[[3], [2, 2]])
    assert info.encodings == ["full", "full"] and info.counts == [3, 4]
    assert info.payload_bytes() == [8, 16]  # 6 bytes padded to 8
    patched = GlooWeightTransferUpdateInfo(
        names=["a"], dtype_names=["float32"], shapes=[[100]], encodings=["indices"], counts=[3], base_round=1, round=2
    )
    assert patched.payload_bytes() == [delta.padded(3 * (4 + 4))]
    with pytest.raises(ValueError, match="unknown encoding"):
        GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[4]], encodings=["zip"], counts=[1])
    with pytest.raises(ValueError, match="<= numel 4"):
        GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[4]], encodings=["mask"], counts=[5])


def test_a_worker_refuses_patches_against_a_push_it_does_not_hold():
    """A restarted server (or a failed receive) holds no snapshot of the trainer's last push: the worker raises
    before receiving anything and drops what it held, so the trainer's failed push restarts with a full one."""
    engine = object.__new__(GlooWeightTransferEngine)  # only the receive bookkeeping is exercised
    engine.group, engine.delta = object(), True
    engine.snapshot, engine.snapshot_round = {"a": torch.zeros(4)}, 3
    info = GlooWeightTransferUpdateInfo(
        names=["a"], dtype_names=["float32"], shapes=[[4]], encodings=["indices"], counts=[1], base_round=2, round=3
    )
    with pytest.raises(RuntimeError, match="holds 3; the trainer must send a full push"):
        engine.receive_weights(info)
    assert engine.snapshot == {} and engine.snapshot_round is None
