"""Delta weight sync: send only the elements whose pushed bits changed since the last push.

`weight_sync_mode: delta` (TRL's name for the same idea, AsyncGRPO's delta weight sync). Both ends keep a snapshot
of the last pushed tensors in the pushed dtype: the trainer compares each new tensor with its snapshot bit for bit
and sends the smallest of four encodings; the vLLM worker rebuilds the full tensor from its own snapshot and the
payload, then loads it exactly as a full push would. The rebuilt tensor is the new tensor bit for bit (the
comparison and the patch both run on integer views of the same bytes: NaN payloads, -0.0 and subnormals survive), so
the served weights after a delta push are identical to those after a full push.

After one optimizer step most bfloat16 elements keep their bits (the update is below half a bfloat16 ulp), and most
of those that change move by one or two ulps, so the patch is small; at high learning rates (or in float32) most
elements change by many ulps and the encoder falls back to `full`.

Encodings (`ENCODINGS`), for a tensor of `numel` elements of `itemsize` bytes with `count` changed elements:

- `full`: every element (numel x itemsize bytes);
- `same`: nothing changed (0 bytes);
- `indices`: int32 flat indices then the changed values (count x (4 + itemsize) bytes), vLLM's sparse patch layout;
- `mask`: a little-endian bit mask of the changed elements (ceil(numel / 8) bytes) then their values;
- `mask_steps` (itemsize 2 or 4): the mask, then for each changed element its step in the integer order of its bit
  pattern (new bits - old bits) as one signed byte, -128 meaning "escaped": those `escapes` elements' new values follow
  whole (ceil(numel / 8) + count + escapes x itemsize bytes). A bfloat16 element moved by k ulps (same sign) steps by
  k, so one byte usually carries it.

Every payload travels as raw bytes, padded to `ALIGN` bytes so the receiver can view each piece in place. This module
imports only torch, so it is safe inside the vLLM worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Encoding = Literal["full", "same", "indices", "mask", "mask_steps"]
ENCODINGS: tuple[Encoding, ...] = ("full", "same", "indices", "mask", "mask_steps")
ESCAPE = -128  # a `mask_steps` step that says "the value follows whole"
_STEP_DTYPE = {2: torch.int32, 4: torch.int64}  # integer arithmetic on bit patterns of this width, without overflow
ALIGN = 8  # bytes: every payload starts at a multiple of this, so any dtype can be viewed in place
INDEX_DTYPE = torch.int32  # flat indices (vLLM's SparseWeightPatch uses int32 too)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` flattened and viewed as same-width integers (its bytes, compared and copied exactly).

    Raises:
        ValueError: an element size with no integer of the same width (e.g. complex128).
    """
    flat = tensor.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
        width = _BITS_DTYPE.get(flat.element_size())
        if width is None:
            raise ValueError(f"delta weight sync cannot compare {flat.dtype} tensors bit for bit")
        return flat.view(width)
    return flat


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def payload_bytes(encoding: Encoding, numel: int, count: int, itemsize: int, escapes: int = 0) -> int:
    """Bytes one tensor's payload takes on the wire before padding.

    Args:
        encoding: one of ENCODINGS.
        numel: elements in the full tensor.
        count: changed elements (`full`: numel).
        itemsize: bytes per element of the pushed dtype.
        escapes: `mask_steps` only: changed elements whose value follows whole.

    Raises:
        ValueError: unknown encoding.
    """
    if encoding == "full":
        return numel * itemsize
    if encoding == "same":
        return 0
    if encoding == "indices":
        return count * (INDEX_DTYPE.itemsize + itemsize)
    if encoding == "mask":
        return math.ceil(numel / 8) + count * itemsize
    if encoding == "mask_steps":
        return math.ceil(numel / 8) + count + escapes * itemsize
    raise ValueError(f"unknown delta encoding {encoding!r}; expected one of {ENCODINGS}")


@dataclass(frozen=True)
class Patch:
    """One tensor's encoded update, ready for the wire.

    Attributes:
        encoding: one of ENCODINGS.
        count: changed elements (`full`: all of them).
        pieces: the payload as uint8 tensors in wire order; empty for `same`.
        escapes: `mask_steps` only: changed elements sent whole.
    """

    encoding: Encoding
    count: int
    pieces: tuple[torch.Tensor, ...]
    escapes: int = 0

    @property
    def nbytes(self) -> int:
        """Unpadded payload bytes."""
        return sum(p.numel() for p in self.pieces)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector `(n,)` packed 8 per byte, little-endian within a byte: `(ceil(n / 8),)` uint8."""
    n = mask.numel()
    grouped = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8)
    grouped[:n] = mask
    return (grouped.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask`: `(ceil(n / 8),)` uint8 -> bool `(n,)`."""
    return ((packed.unsqueeze(1) >> _BIT_SHIFTS) & 1).view(-1)[:n].bool()


def encode(new: torch.Tensor, previous: torch.Tensor | None) -> Patch:
    """The smallest encoding of `new` against `previous` (the snapshot of the last push; None: send it whole).

    Args:
        new: the tensor to push, any shape, in the pushed dtype, on the CPU.
        previous: the same tensor as last pushed (same shape and dtype), or None.

    Raises:
        ValueError: shape or dtype differ from the snapshot.
    """
    flat = new.reshape(-1)
    if previous is None:
        return Patch("full", flat.numel(), (_as_bytes(flat),))
    if previous.shape != new.shape or previous.dtype != new.dtype:
        raise ValueError(
            f"delta weight sync: tensor changed from {previous.dtype} {tuple(previous.shape)} to "
            f"{new.dtype} {tuple(new.shape)} between pushes; push in weight_sync_mode: full"
        )
    new_bits, old_bits = bits(new), bits(previous)
    changed = new_bits != old_bits
    count = int(changed.sum())
    if count == 0:
        return Patch("same", 0, ())
    numel, itemsize = flat.numel(), flat.element_size()
    steps, escapes = _steps(new_bits[changed], old_bits[changed], itemsize)
    sizes = {e: payload_bytes(e, numel, count, itemsize) for e in ("full", "indices", "mask")}
    if steps is not None:
        sizes["mask_steps"] = payload_bytes("mask_steps", numel, count, itemsize, int(escapes.sum()))
    best = min(sizes, key=lambda e: (sizes[e], e != "full"))  # ties go to full (no snapshot read needed)
    if best == "full":
        return Patch("full", numel, (_as_bytes(flat),))
    if best == "indices":
        index = changed.nonzero().squeeze(1)
        return Patch("indices", count, (_as_bytes(index.to(INDEX_DTYPE)), _as_bytes(flat[index])))
    if best == "mask":
        return Patch("mask", count, (pack_mask(changed), _as_bytes(flat[changed])))
    return Patch(
        "mask_steps",
        count,
        (pack_mask(changed), _as_bytes(steps), _as_bytes(flat[changed][escapes])),
        escapes=int(escapes.sum()),
    )


def _steps(new_bits: torch.Tensor, old_bits: torch.Tensor, itemsize: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Each changed element's step new - old in its bit pattern's integer order as int8 (ESCAPE where it does not
    fit), and the escaped elements' mask; (None, empty) for element sizes `mask_steps` does not cover."""
    wide = _STEP_DTYPE.get(itemsize)
    if wide is None:
        return None, torch.zeros(0, dtype=torch.bool)
    step = new_bits.to(wide) - old_bits.to(wide)
    escapes = (step <= ESCAPE) | (step > 127)
    return step.masked_fill(escapes, ESCAPE).to(torch.int8), escapes


def decode(
    encoding: Encoding,
    count: int,
    payload: torch.Tensor,
    previous: torch.Tensor | None,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    escapes: int = 0,
) -> torch.Tensor:
    """Rebuild the full tensor from a payload and the receiver's snapshot of the last push (patched in place).

    Args:
        encoding, count, escapes: as the sender's `Patch`.
        payload: the payload bytes, `(payload_bytes(...),)` uint8, starting at an ALIGN-aligned offset.
        previous: the receiver's snapshot of this tensor (needed for every encoding but `full`).
        dtype, shape: the tensor's pushed dtype and shape.

    Returns:
        For `full` a view of `payload`; otherwise `previous`, its changed elements overwritten.

    Raises:
        RuntimeError: a delta encoding without a snapshot, or a snapshot of another shape or dtype.
        ValueError: a payload of the wrong size, an unknown encoding, or `mask_steps` whose escapes disagree.
    """
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = payload_bytes(encoding, numel, count, itemsize, escapes)
    if payload.numel() != expected:
        raise ValueError(f"delta payload of {payload.numel()} bytes where {encoding} needs {expected}")
    if encoding == "full":
        return payload.view(dtype).view(shape)
    if previous is None or previous.dtype != dtype or tuple(previous.shape) != tuple(shape):
        raise RuntimeError(
            f"a {encoding} weight update needs this worker's snapshot of the last push ({dtype} {tuple(shape)}), "
            "and it has none that matches; the trainer must send a full push"
        )
    if encoding == "same":
        return previous
    target = bits(previous)
    if encoding == "indices":
        values = _values(payload[count * INDEX_DTYPE.itemsize :], dtype)
        target[payload[: count * INDEX_DTYPE.itemsize].view(INDEX_DTYPE).long()] = values
        return previous
    changed = unpack_mask(payload[: math.ceil(numel / 8)], numel)
    if encoding == "mask":
        target[changed] = _values(payload[math.ceil(numel / 8) :], dtype)
        return previous
    if encoding != "mask_steps" or itemsize not in _STEP_DTYPE:
        raise ValueError(f"unknown delta encoding {encoding!r} for {dtype}; expected one of {ENCODINGS}")
    start = math.ceil(numel / 8)
    steps = payload[start : start + count].view(torch.int8)
    escaped = steps == ESCAPE
    if int(escaped.sum()) != escapes:
        raise ValueError(f"mask_steps payload escapes {int(escaped.sum())} elements where its metadata says {escapes}")
    wide = _STEP_DTYPE[itemsize]
    new = target[changed].to(wide) + steps.to(wide)
    new[escaped] = _values(payload[start + count :], dtype).to(wide)
    target[changed] = new.to(target.dtype)
    return previous


def _values(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes as values of `dtype`, as their integer bit patterns (copied first when misaligned for `dtype`)."""
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return bits(raw.view(dtype))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy only if it was not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)
