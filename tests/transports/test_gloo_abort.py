"""A weight broadcast to a server whose API process died gives up as soon as the `update_weights` call failed,
instead of blocking for the whole gloo timeout: `kill -9` of a vLLM API server leaves its worker alive in the
transfer group, never told to receive (found by tests/integration/test_replicas.py, which then hung 300 s)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    from async_grpo.transports.weights.gloo_wire import start_broadcast, wait_broadcast

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:  # the orphaned worker: in the group, never receiving
        time.sleep(6)
        os._exit(0)
    failed: Future = Future()
    failed.set_exception(ConnectionError("the API server is gone"))
    t0 = time.monotonic()
    try:
        wait_broadcast(start_broadcast(dist.group.WORLD, torch.zeros(32 * 1024 * 1024)), abort=failed)
        result = "returned"
    except RuntimeError as err:
        result = f"{err} | cause: {err.__cause__!r}"
    with open(out, "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}\n{result}")
    os._exit(0)


def test_broadcast_gives_up_once_the_update_call_failed(tmp_path):
    out = tmp_path / "rank0.txt"
    ctx = mp.start_processes(_rank, args=(_free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    ctx.join(timeout=30)
    seconds, result = out.read_text().split("\n", 1)
    assert "abandoned" in result and "API server is gone" in result
    assert float(seconds) < 5.0  # not the 60 s group timeout
