"""A `gloo` weight-transfer backend for vLLM's pluggable weight-transfer factories.

vLLM 0.32 ships only accelerator data planes (nccl, ipc, ...), so on CPU the trainer pushes
weights through this backend instead. It plugs into the *same* control plane as NCCL
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`): CI exercises the production path with only the data plane swapped.

Importing this module registers the backend under the name ``gloo`` in both
`WeightTransferEngineFactory` (inference worker side) and `WeightTransferTrainerFactory`
(trainer side). The vLLM server imports it through
``--worker-extension-cls async_grpo.transports.weights.gloo.GlooWorkerExtension`` and selects it with
``--weight-transfer-config '{"backend":"gloo"}'``. This module imports only torch and vLLM, so it is
safe inside the vLLM worker process.

Wire format: both sides cut the parameter list (names, dtypes, shapes, in metadata order) into
buckets of consecutive same-dtype tensors of at most `bucket_bytes` each, and each bucket travels as
one flat gloo broadcast from trainer rank 0. The cut is a pure function of the metadata
(`plan_buckets`), so the two sides cannot disagree. The stages overlap: the trainer packs bucket k + 1
while bucket k is on the wire, and the worker receives bucket k + 1 while it loads bucket k.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

logger = logging.getLogger(__name__)

BACKEND_NAME = "gloo"
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024  # bytes per flat broadcast
ABORT_POLL_S = 0.5  # the sender checks its update_weights call this often while a broadcast waits (seconds)
DEFAULT_TIMEOUT_S = 300.0


def _dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`. Raises ValueError for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight update metadata")
    return dtype


def plan_buckets(metas: list[ParamMeta], bucket_bytes: int) -> list[list[int]]:
    """Cut parameters (in order) into buckets of consecutive same-dtype tensors.

    Args:
        metas: parameter metadata, in the order both sides iterate.
        bucket_bytes: soft cap on one bucket's size (bytes); a larger tensor gets its own bucket.

    Returns:
        Lists of indices into `metas`, one list per bucket, covering every index once in order.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_dtype: torch.dtype | None = None
    for i, m in enumerate(metas):
        nbytes = torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size()
        if current and (m.dtype != current_dtype or current_bytes + nbytes > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
        current_dtype = m.dtype
    if current:
        buckets.append(current)
    return buckets


def _new_gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group over `store` that leaves torch's default group untouched."""
    return dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))


def _start_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Post a broadcast of `tensor` from rank 0 and return its pending work (gloo runs posted collectives in order)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def _wait(work: dist.Work, abort: Future | None = None) -> None:
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
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


# Trainer -> inference worker (through POST /update_weights)
@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata: parallel lists, one entry per parameter, in send order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names/dtype_names/shapes lengths differ: {len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )

    def metas(self) -> list[ParamMeta]:
        """The metadata as `ParamMeta` records."""
        return [
            ParamMeta(n, _dtype_from_name(d), tuple(s))
            for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]


# ---------------------------------------------------------------------------- inference side
class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inference-worker engine: receives bucketed gloo broadcasts and loads them layerwise.

    Uses vLLM's layerwise reload lifecycle exactly like the NCCL engine, so quantized or
    repacked CPU layers are re-processed after loading.
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (blocks until the trainer joins, up to timeout_s)."""
        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        rank = init_info.rank_offset + worker_rank
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        self.store = dist.TCPStore(
            init_info.master_address, init_info.master_port, init_info.world_size, is_master=False, timeout=timeout
        )
        self.group = _new_gloo_group(self.store, rank, init_info.world_size, init_info.timeout_s)
        self.bucket_bytes = init_info.bucket_bytes
        logger.info("gloo weight transfer joined as rank %d of %d", rank, init_info.world_size)

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
        """Receive every bucket and hand the tensors to `model.load_weights`; bucket k + 1 is posted (and arrives)
        while bucket k loads, so at most two buckets are held at once."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized; call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        metas = update_info.metas()
        buckets = plan_buckets(metas, self.bucket_bytes)
        sizes = [[torch.Size(metas[i].shape).numel() for i in bucket] for bucket in buckets]

        def post(k: int) -> tuple[torch.Tensor, dist.Work]:
            flat = torch.empty(sum(sizes[k]), dtype=metas[buckets[k][0]].dtype)
            return flat, _start_broadcast(self.group, flat)

        with disable_mtp_completeness_check():
            pending = post(0) if buckets else None
            for k, bucket in enumerate(buckets):
                flat, work = pending
                _wait(work)
                pending = post(k + 1) if k + 1 < len(buckets) else None  # the next bucket arrives while this loads
                pieces = flat.split(sizes[k])
                self.model.load_weights(
                    [(metas[i].name, piece.view(metas[i].shape)) for i, piece in zip(bucket, pieces, strict=True)]
                )

    def shutdown(self) -> None:
        """Drop the group and the store connection."""
        self.group = None
        self.store = None


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
@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for the gloo backend.

    Attributes:
        master_address: address the trainer's TCPStore listens on, reachable by the vLLM workers.
        master_port: its port (pick a free one).
        world_size: 1 (trainer sender) + the server's world size (`GET /get_world_size`).
        bucket_bytes: flat-broadcast size cap (bytes).
        timeout_s: rendezvous and broadcast timeout (seconds).
    """

    backend: ClassVar[str] = BACKEND_NAME

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer-side sender: hosts the rendezvous, broadcasts buckets while the server receives.

    `send_weights` drives the full round: start -> update (RPC on a side thread, concurrent with the
    broadcast, since both block inside the same collective) -> finish.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool, bucket_bytes: int):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None

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
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
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
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = _new_gloo_group(engine.store, 0, init_info.world_size, init_info.timeout_s)
            future.result(timeout=init_info.timeout_s)
        return engine

    def send_weights(self) -> None:
        """Push every parameter of the source to the server (start, update+broadcast, finish)."""
        assert self.source is not None
        metas = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        if self.group is None:
            raise RuntimeError("trainer_init() must run before send_weights()")
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in metas],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in metas],
            shapes=[list(m.shape) for m in metas],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, asdict(update_info))
            self._broadcast_all(metas, abort=future)
            future.result()
        finally:
            # If the broadcast failed the server-side RPC may never return; do not join it.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def _broadcast_all(self, metas: list[ParamMeta], abort: Future | None = None) -> None:
        """Broadcast every bucket; bucket k + 1 is packed while bucket k is on the wire (two held at once)."""
        assert self.source is not None and self.group is not None
        tensors = dict(_checked(self.source, metas))
        pending: tuple[torch.Tensor, dist.Work] | None = None
        for bucket in plan_buckets(metas, self.bucket_bytes):
            flat = torch.cat([tensors[metas[i].name].detach().reshape(-1).cpu() for i in bucket])
            work = _start_broadcast(self.group, flat)
            if pending is not None:
                _wait(pending[1], abort)
            pending = (flat, work)  # the tensor stays referenced until its broadcast is done
        if pending is not None:
            _wait(pending[1], abort)

    def shutdown(self) -> None:
        """Drop the group and close the store."""
        self.group = None
        self.store = None


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
