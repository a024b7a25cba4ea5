"""Push trainer weights into a vLLM server through vLLM's native weight-transfer control plane.

One round is: pause (mode=keep, so in-flight requests freeze instead of failing) -> start ->
update (concurrent with the data-plane broadcast) -> finish(weight_version) -> resume. The data
plane is vLLM's NCCL backend on GPU and our registered gloo backend on CPU; both are created
through `WeightTransferTrainerFactory`, so the trainer never special-cases the medium.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from urllib.parse import urlparse

import requests
import torch
from vllm.distributed.weight_transfer import ModuleSource, WeightSource, WeightTransferTrainerFactory

from async_grpo.inference.client import VersionedWeightSyncClient, VLLMControlClient
from async_grpo.inference.server import free_port
from async_grpo.transports.weights.push import PushReport

logger = logging.getLogger(__name__)


WEIGHT_SYNC_MODES = ("full", "delta")


def resolve_backend(backend: str) -> str:
    """`auto` -> `nccl` when CUDA is available, else `gloo`."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def rendezvous_address(vllm_url: str) -> str:
    """Address the vLLM workers use to reach this trainer's weight-transfer rendezvous.

    For a server on this host (loopback URL) it is 127.0.0.1. Otherwise it is the pod IP (`POD_IP`,
    set from the downward API in the PyTorchJob) or, failing that, this host's resolved hostname.
    """
    host = urlparse(vllm_url).hostname or ""
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return "127.0.0.1"
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


class WeightPusher:
    """Sends the trainer's parameters to one vLLM server each time `push(version)` is called (a `push.WeightPush`).

    Args:
        source: the parameters to send: vLLM's `WeightSource` (`Learner.named_parameters_for_push()`; HF
            parameter names, as vLLM's `load_weights` expects), or a `torch.nn.Module` (wrapped in `ModuleSource`).
        server_url: vLLM base URL (dev mode on).
        backend: "gloo", "nccl" or "auto".
        master_address: address of this trainer that the vLLM workers can reach for the rendezvous.
        timeout_s: timeout for the rendezvous, each control-plane call and each broadcast (seconds).
        bucket_bytes: gloo only: most bytes per flat broadcast (`gloo_wire.plan_buckets`); None: the backend's default
            (`gloo.DEFAULT_BUCKET_BYTES`). Smaller buckets hold less memory twice; more of them overlap packing,
            the wire and vLLM's load.
        mode: `weight_sync_mode`: "full" sends every tensor whole; "delta" (gloo only) sends each tensor's changed
            elements against the last push (`transports.weights.delta`), keeping a snapshot of the last push on both
            sides (one copy of the pushed weights each).

    Attributes:
        last_report: the latest push's `PushReport` (wire bytes: what the gloo backend sent, else the dense bytes).

    Raises:
        ValueError: `mode` is not full or delta, or delta with a backend other than gloo.
    """

    def __init__(
        self,
        source: WeightSource | torch.nn.Module,
        server_url: str,
        *,
        backend: str = "auto",
        master_address: str = "127.0.0.1",
        timeout_s: float = 300.0,
        bucket_bytes: int | None = None,
        mode: str = "full",
    ):
        if mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync_mode={mode!r} is not one of {', '.join(WEIGHT_SYNC_MODES)}")
        self.source = ModuleSource(source) if isinstance(source, torch.nn.Module) else source
        self.backend = resolve_backend(backend)
        self.control = VLLMControlClient(server_url, timeout_s=timeout_s)
        self.client = VersionedWeightSyncClient(server_url, timeout=timeout_s)
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        if mode == "delta" and self.backend != "gloo":
            raise ValueError(
                f"weight_sync_mode=delta needs the gloo data plane, and weight_sync_backend resolved to "
                f"{self.backend!r}. Fix: set weight_sync_backend: gloo, or weight_sync_mode: full."
            )
        self.engine = None
        self.last_report = PushReport()

    def setup(self) -> None:
        """Rendezvous with the server's workers (once).

        Raises:
            ValueError: unknown backend.
            requests.HTTPError / RuntimeError: the server rejected the handshake or timed out.
        """
        world_size = 1 + self.control.world_size()
        port = free_port()
        if self.backend == "gloo":
            from async_grpo.transports.weights.gloo import DEFAULT_BUCKET_BYTES, GlooTrainerInitInfo

            init_info = GlooTrainerInitInfo(
                master_address=self.master_address,
                master_port=port,
                world_size=world_size,
                timeout_s=self.timeout_s,
                rank=0,
                bucket_bytes=self.bucket_bytes or DEFAULT_BUCKET_BYTES,
                delta=self.mode == "delta",
            )
        elif self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            init_info = NCCLTrainerInitInfo(
                master_address=self.master_address, master_port=port, world_size=world_size, rank=0
            )
        else:
            raise ValueError(f"weight_sync_backend={self.backend!r} is not one of gloo, nccl, auto")
        t0 = time.perf_counter()
        self.engine = WeightTransferTrainerFactory.trainer_init(init_info, client=self.client, source=self.source)
        logger.info(
            "weight transfer (%s) ready in %.2f s, world size %d", self.backend, time.perf_counter() - t0, world_size
        )

    def push(self, version: int, *, full: bool = False) -> float:
        """Pause the server, send all weights tagged `version`, resume. Returns the seconds it took.

        `full`: in delta mode, send every weight whole this time (the next deltas are against this push). The server
        is resumed even when the send fails, so generation never stays paused.
        """
        if self.engine is None:
            self.setup()
        if full and self.mode == "delta":  # delta runs on our gloo engine only (checked in __init__)
            self.engine.restart_delta()
        t0 = time.perf_counter()
        self.control.pause(mode="keep")
        try:
            self.client.next_version = str(version)
            with torch.no_grad():
                self.engine.send_weights()
        except BaseException:
            try:  # best effort: never leave the server paused, but keep the original error
                self.control.resume()
            except requests.RequestException as err:
                logger.warning("could not resume vLLM after a failed weight push: %s", err)
            raise
        self.control.resume()
        seconds = time.perf_counter() - t0
        dense = sum(math.prod(m.shape) * m.dtype.itemsize for m in self.source.metadata())
        wire = self.engine.last_sent_bytes if self.backend == "gloo" else dense  # vLLM's NCCL engine does not count
        self.last_report = PushReport(seconds=seconds, wire_bytes=wire, dense_bytes=dense)
        return seconds

    def close(self) -> None:
        """Tear down the transfer group."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
