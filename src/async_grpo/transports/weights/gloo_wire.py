"""The gloo weight push's wire: what the trainer and the vLLM worker agree on before any byte moves.

Both sides describe one push with the same metadata (`GlooWeightTransferUpdateInfo`: names, pushed dtypes, shapes,
and each payload's `delta` encoding), cut the padded payloads into the same buckets (`plan_buckets`, a pure function
of that metadata) and move each bucket as one flat uint8 gloo broadcast from trainer rank 0 (`start_broadcast`,
`wait_broadcast`). The engines that pack, send, receive and load live in `gloo`. This module imports only torch,
vLLM's weight-transfer base types and `delta`, so it is safe inside the vLLM worker.
"""

from __future__ import annotations

import datetime
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from async_grpo.transports.weights import delta

BACKEND_NAME = "gloo"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024  # bytes per flat broadcast
ABORT_POLL_S = 0.5  # the sender checks its update_weights call this often while a broadcast waits (seconds)
RECEIVER_POLL_S = 0.005  # the sender checks the store for the workers' receiving announcements this often (seconds)
DEFAULT_TIMEOUT_S = 300.0


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`. Raises ValueError for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight update metadata")
    return dtype


def plan_buckets(payload_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Cut payloads (in order) into buckets of consecutive payloads.

    Args:
        payload_bytes: each parameter's payload size in bytes, already padded to `delta.ALIGN` (0: nothing to send).
        bucket_bytes: soft cap on one bucket's size (bytes); a larger payload gets its own bucket.

    Returns:
        Lists of indices into `payload_bytes`, one list per bucket, covering every non-empty payload once, in order.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, nbytes in enumerate(payload_bytes):
        if nbytes == 0:
            continue
        if current and current_bytes + nbytes > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def new_gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group over `store` that leaves torch's default group untouched."""
    return dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))


def start_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Post a broadcast of `tensor` from rank 0 and return its pending work (gloo runs posted collectives in order)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def receiving_key(push_id: int, rank: int) -> str:
    """The TCPStore key worker `rank` sets once it has the `update_weights` call of push `push_id` in hand."""
    return f"receiving/{push_id}/{rank}"


def wait_for_receivers(store: dist.Store, push_id: int, world_size: int, abort: Future, timeout_s: float) -> None:
    """Block until every worker (ranks 1..world_size-1) announced it is receiving push `push_id`
    (`receiving_key`), then delete the announcements.

    The sender posts no broadcast before this returns. A worker that never got the call (its API server died first)
    is thus never waited on inside a gloo collective: a collective that one peer never joins cannot be cancelled,
    and tearing its group down blocks for the whole group timeout (measured: 19 s for a 20 s group timeout).

    Raises:
        RuntimeError: `abort` (the sender's `update_weights` call) failed first (cause chained), or `timeout_s`
            seconds passed.
    """
    keys = [receiving_key(push_id, rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if abort.done() and abort.exception() is not None:
            raise RuntimeError("weight push abandoned before any byte moved: update_weights failed") from (
                abort.exception()
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM workers did not start receiving push {push_id} within {timeout_s:.0f} s")
        time.sleep(RECEIVER_POLL_S)
    for key in keys:
        store.delete_key(key)


def wait_broadcast(work: dist.Work, abort: Future | None = None) -> None:
    """Wait for a posted broadcast. With `abort` (the sender's concurrent `update_weights` call), wait in slices of
    ABORT_POLL_S and give up once that call failed: a killed API server leaves its worker in the group, never told
    to receive, and a plain wait would block for the whole group timeout. Raises RuntimeError (cause chained)."""
    while True:
        try:
            return work.wait() if abort is None else work.wait(timeout=datetime.timedelta(seconds=ABORT_POLL_S))
        except RuntimeError as err:
            if abort is None or "timed out" not in str(err):
                raise
            if abort.done() and abort.exception() is not None:
                raise RuntimeError("weight broadcast abandoned: update_weights failed") from abort.exception()


# ---------------------------------------------------------------------------- wire structs
# Trainer -> inference worker (through POST /init_weight_transfer_engine)
@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side rendezvous info: the trainer hosts a TCPStore at master_address:master_port.

    Attributes:
        master_address: host of the trainer's TCPStore.
        master_port: its port.
        rank_offset: rank of this server's first worker in the transfer group (trainer is 0).
        world_size: trainer sender + all inference workers.
        bucket_bytes: flat-broadcast size cap (bytes); must match the trainer's.
        timeout_s: gloo operation timeout (seconds).
        delta: keep a snapshot of the last push (one copy of the model in the pushed dtype, bytes = the push's
            dense bytes) so the trainer may send `delta` patches against it (`weight_sync_mode: delta`).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    delta: bool = False


# Trainer -> inference worker (through POST /update_weights)
@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata: parallel lists, one entry per parameter, in send order.

    Attributes:
        names, dtype_names, shapes: each parameter's checkpoint name, pushed dtype ("bfloat16") and shape.
        encodings: each payload's `delta.ENCODINGS` entry; empty: every parameter is sent `full`.
        counts: each payload's changed elements (`full`: its numel); empty with `encodings`.
        escapes: each `mask_steps` payload's elements sent whole (0 for the other encodings); empty: all 0.
        base_round: the push the patches are against (the worker must hold its snapshot); 0: no snapshot needed.
        round: this push's number on the trainer (the worker's snapshot takes it after a complete receive).
        push_id: the trainer's count of pushes on this group; the worker announces it (`receiving_key`) before it
            posts its first receive. 0: a sender that does not wait for the announcement.

    Raises:
        ValueError: lists of different lengths, an unknown encoding, or a count outside [0, numel].
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    encodings: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    escapes: list[int] = field(default_factory=list)
    base_round: int = 0
    round: int = 0
    push_id: int = 0

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names/dtype_names/shapes lengths differ: {len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )
        if not self.encodings and not self.counts:
            self.encodings = ["full"] * len(self.names)
            self.counts = [math.prod(shape) for shape in self.shapes]
        self.escapes = self.escapes or [0] * len(self.names)
        if not (len(self.encodings) == len(self.counts) == len(self.escapes) == len(self.names)):
            raise ValueError(
                f"encodings/counts/escapes must have one entry per name: {len(self.encodings)}/{len(self.counts)}/"
                f"{len(self.escapes)} for {len(self.names)} names"
            )
        for name, encoding, count, escapes, shape in zip(
            self.names, self.encodings, self.counts, self.escapes, self.shapes, strict=True
        ):
            if encoding not in delta.ENCODINGS:
                raise ValueError(f"{name}: unknown encoding {encoding!r}; expected one of {delta.ENCODINGS}")
            if not 0 <= escapes <= count <= math.prod(shape):
                raise ValueError(f"{name}: need 0 <= escapes {escapes} <= count {count} <= numel {math.prod(shape)}")

    def metas(self) -> list[ParamMeta]:
        """The metadata as `ParamMeta` records."""
        return [
            ParamMeta(n, dtype_from_name(d), tuple(s))
            for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]

    def payload_bytes(self, padded: bool = True) -> list[int]:
        """Each parameter's payload size on the wire (bytes), in order; `padded`: with the padding to `delta.ALIGN`
        that follows it in its bucket."""
        sizes = [
            delta.payload_bytes(e, math.prod(m.shape), c, m.dtype.itemsize, x)
            for e, c, x, m in zip(self.encodings, self.counts, self.escapes, self.metas(), strict=True)
        ]
        return [delta.padded(n) for n in sizes] if padded else sizes


# Trainer-side init info (the factory dispatches on `backend`)
@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for the gloo backend.

    Attributes:
        master_address: address the trainer's TCPStore listens on, reachable by the vLLM workers.
        master_port: its port (pick a free one).
        world_size: 1 (trainer sender) + the server's world size (`GET /get_world_size`).
        bucket_bytes: flat-broadcast size cap (bytes); the trainer holds two send buffers of up to this size.
        timeout_s: rendezvous and broadcast timeout (seconds).
        delta: `weight_sync_mode: delta`: after the first push, send each parameter as its smallest patch against
            the last push (`delta.encode`); both sides keep a snapshot of the last push (the push's dense bytes).
    """

    backend: ClassVar[str] = BACKEND_NAME

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    delta: bool = False
