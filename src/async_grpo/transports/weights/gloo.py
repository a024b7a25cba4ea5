"""A `gloo` weight-transfer backend for vLLM's pluggable weight-transfer factories.

vLLM 0.32 ships only accelerator data planes (nccl, ipc, ...), so on CPU the trainer pushes
weights through this backend instead. It plugs into the *same* control plane as NCCL
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`): CI exercises the production path with only the data plane swapped.

Importing this module registers the backend under the name ``gloo`` in both
`WeightTransferEngineFactory` (inference worker side) and `WeightTransferTrainerFactory`
(trainer side). The vLLM server imports it through
``--worker-extension-cls async_grpo.transports.weights.gloo.GlooWorkerExtension`` and selects it with
``--weight-transfer-config '{"backend":"gloo"}'``. This module imports only torch, vLLM and our torch-only
`delta`, `cast` and `gloo_wire`, so it is safe inside the vLLM worker process.

Each parameter travels as a payload of raw bytes (`delta.Patch`: the whole tensor in the pushed dtype, or in
`weight_sync_mode: delta` a patch against the last push), in the buckets and metadata `gloo_wire` defines. The
stages overlap: the trainer packs bucket k + 1 while bucket k is on the wire, and the worker
receives bucket k + 1 while it loads bucket k.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from async_grpo.transports.weights import delta
from async_grpo.transports.weights.cast import uncast
from async_grpo.transports.weights.gloo_wire import (
    BACKEND_NAME,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    new_gloo_group,
    plan_buckets,
    receiving_key,
    start_broadcast,
    wait_broadcast,
    wait_for_receivers,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- inference side
class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inference-worker engine: receives bucketed gloo broadcasts and loads them layerwise.

    Uses vLLM's layerwise reload lifecycle exactly like the NCCL engine, so quantized or
    repacked CPU layers are re-processed after loading. With `delta` it keeps the last push's tensors (the
    snapshot) and rebuilds each parameter from its patch before loading it.
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.rank = 0  # this worker's rank in the transfer group (the trainer is 0)
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.delta = False
        self.snapshot: dict[str, torch.Tensor] = {}  # name -> last pushed tensor (delta only)
        self.snapshot_round: int | None = None  # the trainer's round the snapshot holds; None: none

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (blocks until the trainer joins, up to timeout_s)."""
        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        rank = init_info.rank_offset + worker_rank
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        self.store = dist.TCPStore(
            init_info.master_address, init_info.master_port, init_info.world_size, is_master=False, timeout=timeout
        )
        self.group = new_gloo_group(self.store, rank, init_info.world_size, init_info.timeout_s)
        self.rank = rank
        self.bucket_bytes = init_info.bucket_bytes
        self.delta = init_info.delta
        self.snapshot, self.snapshot_round = {}, None
        logger.info("gloo weight transfer joined as rank %d of %d (delta %s)", rank, init_info.world_size, self.delta)

    def start_weight_update(self) -> None:
        """Begin layerwise reload (same as vLLM's NCCL engine)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Finish layerwise reload: re-run the model's post-load processing, then re-tie a tied LM head."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_lm_head(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round. Overrides the base only to skip `torch.accelerator.synchronize()`,
        which raises on CPU; gloo broadcasts here are synchronous (`.wait()`)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive every bucket, rebuild each parameter (`delta.decode`) and hand it to `model.load_weights`; bucket
        k + 1 is posted (and arrives) while bucket k loads, so at most two buckets are held at once.

        Raises:
            RuntimeError: not initialized, or delta patches against a push this worker does not hold (the snapshot
                is dropped, so the trainer's next, full, push starts over).
        """
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized; call /init_weight_transfer_engine first")
        patched = any(e != "full" for e in update_info.encodings)
        if patched and (not self.delta or update_info.base_round != self.snapshot_round):
            held = self.snapshot_round
            self.snapshot, self.snapshot_round = {}, None
            raise RuntimeError(
                f"delta weight update against push {update_info.base_round}, but this worker holds "
                f"{held if self.delta else 'no snapshot (delta off)'}; the trainer must send a full push"
            )
        if update_info.push_id and self.store is not None:  # the trainer posts its first bucket only after this
            self.store.set(receiving_key(update_info.push_id, self.rank), "1")
        try:
            self._receive(update_info)
        except BaseException:
            self.snapshot, self.snapshot_round = {}, None
            raise
        self.snapshot_round = update_info.round if self.delta else None

    def _receive(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        metas = update_info.metas()
        payload_bytes, unpadded = update_info.payload_bytes(), update_info.payload_bytes(padded=False)
        buckets = plan_buckets(payload_bytes, self.bucket_bytes)
        waited = loaded = 0.0

        def post(k: int) -> tuple[torch.Tensor, dist.Work]:
            flat = torch.empty(sum(payload_bytes[i] for i in buckets[k]), dtype=torch.uint8)
            return flat, start_broadcast(self.group, flat)

        def rebuild(i: int, payload: torch.Tensor) -> torch.Tensor:
            m = metas[i]
            tensor = delta.decode(
                update_info.encodings[i],
                update_info.counts[i],
                payload,
                self.snapshot.get(m.name),
                m.dtype,
                m.shape,
                update_info.escapes[i],
            )
            if self.delta:
                self.snapshot[m.name] = tensor
            return tensor

        with disable_mtp_completeness_check():
            # parameters with nothing on the wire (`same`) are loaded from the snapshot, ahead of the buckets
            empty = torch.empty(0, dtype=torch.uint8)
            unchanged = [i for i, n in enumerate(payload_bytes) if n == 0]
            if unchanged:
                self.model.load_weights([(metas[i].name, rebuild(i, empty).view(metas[i].shape)) for i in unchanged])
            pending = post(0) if buckets else None
            for k, bucket in enumerate(buckets):
                flat, work = pending
                t0 = time.perf_counter()
                wait_broadcast(work)
                t1 = time.perf_counter()
                pending = post(k + 1) if k + 1 < len(buckets) else None  # the next bucket arrives while this loads
                weights, offset = [], 0
                for i in bucket:
                    used = unpadded[i]
                    weights.append((metas[i].name, rebuild(i, flat[offset : offset + used]).view(metas[i].shape)))
                    offset += payload_bytes[i]
                self.model.load_weights(weights)
                waited, loaded = waited + t1 - t0, loaded + time.perf_counter() - t1
        logger.debug(
            "gloo weight receive: %d buckets, %.3f s waiting for the wire, %.3f s loading", len(buckets), waited, loaded
        )

    def shutdown(self) -> None:
        """Drop the group, the store connection and the snapshot."""
        self.group = None
        self.store = None
        self.snapshot, self.snapshot_round = {}, None


def retie_lm_head(model: torch.nn.Module) -> bool:
    """Point a tied LM head back at the (reloaded) input embedding and redo its post-load processing.

    vLLM ties `lm_head.weight` to `model.embed_tokens.weight` at construction, and its layerwise reload processes a
    tied parameter for one of its layers only (limitation 2 in `vllm.model_executor.model_loader.reload`). On the
    CPU build the head's processing packs a private GEMM copy of the weight (`cpu_linear`), so after a push that
    copy stayed the old embedding and vLLM sampled with a stale head (logprobs ~15 nats off on the tiny model).

    Returns:
        True when the model ties its embeddings and the head was refreshed.
    """
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    head.weight = embed.weight  # the reload may have replaced the embedding's parameter
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True


class GlooWorkerExtension:
    """vLLM worker extension whose only job is to get this module imported in the worker.

    Pass ``--worker-extension-cls async_grpo.transports.weights.gloo.GlooWorkerExtension``; importing
    the module registers the ``gloo`` backend before the worker builds its weight-transfer engine.
    """


# ---------------------------------------------------------------------------- trainer side
class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer-side sender: hosts the rendezvous, broadcasts buckets while the server receives.

    `send_weights` drives the full round: start -> update (RPC on a side thread, concurrent with the
    broadcast, since both block inside the same collective) -> finish. After each round `last_sent_bytes` holds the
    bytes that went on the wire.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool,
        bucket_bytes: int,
        delta: bool = False,
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.snapshot: dict[str, torch.Tensor] = {}  # name -> last pushed tensor, pushed dtype, CPU (delta only)
        self.round = 0  # completed pushes the worker's snapshot can match; 0: the next push is full
        self.pushes = 0  # pushes started on this group (`push_id` of the latest)
        self.world_size = 1  # trainer + the server's workers
        self.timeout_s = DEFAULT_TIMEOUT_S  # longest wait for the workers to start receiving a push (seconds)
        self.last_sent_bytes = 0
        self._buffers: list[torch.Tensor] = []  # two uint8 send buffers, reused push after push

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        """Open the TCPStore, ask the server to join, and join as rank 0.

        Raises:
            ValueError: no source given.
            RuntimeError / requests errors: the server rejected init or did not join within timeout_s.
        """
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource (e.g. ModuleSource(model))")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.bucket_bytes,
            delta=init_info.delta,
        )
        if not engine.is_sender:
            return engine
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        engine.store = dist.TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
            delta=init_info.delta,
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = new_gloo_group(engine.store, 0, init_info.world_size, init_info.timeout_s)
            future.result(timeout=init_info.timeout_s)
        engine.world_size, engine.timeout_s = init_info.world_size, init_info.timeout_s
        return engine

    def send_weights(self) -> None:
        """Push every parameter of the source to the server (start, update+broadcast, finish).

        In delta mode every tensor is compared with the snapshot first (the patches' sizes go in the update
        metadata); a failed round drops the snapshot, so the next push is full.

        Raises:
            RuntimeError: not initialized, or the broadcast failed or was abandoned.
            ValueError: the source disagrees with its own metadata.
        """
        assert self.source is not None
        metas = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        if self.group is None:
            raise RuntimeError("trainer_init() must run before send_weights()")
        try:
            self._send_round(metas)
        except BaseException:
            self.snapshot, self.round = {}, 0
            raise

    def restart_delta(self) -> None:
        """Send every tensor whole at the next push (a new delta chain starts from it); no-op in full mode."""
        self.snapshot, self.round = {}, 0

    def _send_round(self, metas: list[ParamMeta]) -> None:
        patches = self._encode_all(metas) if self.delta else None
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in metas],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas],
            encodings=[p.encoding for p in patches] if patches is not None else [],
            counts=[p.count for p in patches] if patches is not None else [],
            escapes=[p.escapes for p in patches] if patches is not None else [],
            base_round=self.round if patches is not None else 0,
            round=self.round + 1,
            push_id=self.pushes + 1,
        )
        self.pushes += 1
        stream = iter(patches) if patches is not None else self._full_patches()
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, asdict(update_info))
            self.last_sent_bytes = self._broadcast_all(
                metas,
                update_info.payload_bytes(),
                stream,
                abort=future,
                before_first=lambda: self._wait_for_receivers(update_info.push_id, future),
            )
            future.result()
        finally:
            # If the broadcast failed the server-side RPC may never return; do not join it.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()
        self.round += 1

    def _wait_for_receivers(self, push_id: int, update_call: Future) -> None:
        """Hold the first bucket until every worker has the `update_weights` call (`wait_for_receivers`)."""
        assert self.store is not None
        wait_for_receivers(self.store, push_id, self.world_size, update_call, self.timeout_s)

    def _full_patches(self) -> Iterator[delta.Patch]:
        """Every tensor whole, read from the source one at a time as the buckets are packed. A `CastSource`'s tensors
        are taken before its cast: packing casts them straight into the send buffer, without a cast copy (0.34 s
        against 0.09 s for a Qwen2.5-0.5B-shaped model to bfloat16, one thread)."""
        inner, _ = uncast(self.source)
        for _, tensor in _checked(inner, inner.metadata()):
            flat = tensor.detach().reshape(-1)
            yield delta.Patch("full", flat.numel(), (flat,))

    def _encode_all(self, metas: list[ParamMeta]) -> list[delta.Patch]:
        """Each tensor's smallest patch against the snapshot (all `full` without one); the snapshot becomes this
        push's tensors (patched in place after the first push)."""
        patches = []
        for name, tensor in _checked(self.source, metas):
            new = tensor.detach().cpu()
            previous = self.snapshot.get(name) if self.round else None
            patch = delta.encode(new, previous)
            if previous is None:
                self.snapshot[name] = new.clone()
            elif patch.encoding != "same":
                previous.copy_(new)
            patches.append(patch)
        return patches

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Send buffer k % 2, grown to hold `nbytes` (bytes)."""
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[k % 2].numel() < nbytes:
            self._buffers[k % 2] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[k % 2][:nbytes]

    def _broadcast_all(
        self,
        metas: list[ParamMeta],
        payload_bytes: list[int],
        patches: Iterator[delta.Patch],
        abort: Future | None = None,
        before_first: Callable[[], None] | None = None,
    ) -> int:
        """Pack the patches (one per parameter, in order) into buckets and broadcast them; bucket k + 1 is packed
        while bucket k is on the wire (two send buffers, reused). A uint8 piece is copied as bytes, any other is
        copied (and cast) as a tensor of its parameter's pushed dtype. `before_first` runs once, after bucket 0 is
        packed and before it is posted (the wait for the receivers). Returns the bytes broadcast."""
        assert self.group is not None
        pending: dist.Work | None = None
        sent = 0
        position = -1
        for k, bucket in enumerate(plan_buckets(payload_bytes, self.bucket_bytes)):
            flat = self._buffer(k, sum(payload_bytes[i] for i in bucket))
            offset = 0
            for i in bucket:
                while position < i:  # skip the parameters with nothing on the wire
                    patch, position = next(patches), position + 1
                at = offset
                for piece in patch.pieces:
                    if piece.dtype == torch.uint8:
                        flat[at : at + piece.numel()].copy_(piece)
                        at += piece.numel()
                    else:
                        nbytes = piece.numel() * metas[i].dtype.itemsize
                        flat[at : at + nbytes].view(metas[i].dtype).copy_(piece)
                        at += nbytes
                offset += payload_bytes[i]  # the padding after the payload is left as it was
            if k == 0 and before_first is not None:
                before_first()
            work = start_broadcast(self.group, flat)
            if pending is not None:
                wait_broadcast(pending, abort)
            pending, sent = work, sent + flat.numel()
        if pending is None and before_first is not None:  # nothing on the wire: the receivers still announce
            before_first()
        for _ in patches:  # drain the source (it may hold per-round state), nothing left to send
            pass
        if pending is not None:
            wait_broadcast(pending, abort)
        return sent

    def shutdown(self) -> None:
        """Drop the group, close the store, free the send buffers and the snapshot."""
        self.group = None
        self.store = None
        self._buffers, self.snapshot, self.round = [], {}, 0


def _checked(source: WeightSource, metas: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the source's tensors, failing loudly if they disagree with the declared metadata."""
    for (name, tensor), meta in zip(source, metas, strict=True):
        if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != tuple(meta.shape):
            raise ValueError(
                f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} where metadata declared "
                f"{meta.name!r} {meta.dtype} {tuple(meta.shape)}"
            )
        yield name, tensor


def register() -> None:
    """Register the gloo backend in both vLLM factories (idempotent)."""
    for factory, engine_cls in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        try:
            factory.register_engine(BACKEND_NAME, engine_cls)
        except ValueError:  # already registered (module imported twice)
            pass


register()
