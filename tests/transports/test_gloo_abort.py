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

from tests.forkserver import start_ranks


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
    ctx = start_ranks(_rank, args=(_free_port(), str(out)), nprocs=2, join=False)
    ctx.join(timeout=30)
    seconds, result = out.read_text().split("\n", 1)
    assert "abandoned" in result and "API server is gone" in result
    assert float(seconds) < 5.0  # not the 60 s group timeout


_ORPHAN = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=datetime.timedelta(seconds=60))
group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
time.sleep(40)  # joined, then never receives: its API server died before forwarding update_weights
"""

_SENDER = """
import subprocess, sys, time
import torch
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
from vllm.distributed.weight_transfer import ModuleSource
from async_grpo.transports.weights.gloo import GlooTrainerWeightTransferEngine
from async_grpo.transports.weights.gloo_wire import GlooTrainerInitInfo


class GoneServer(VLLMWeightSyncClient):
    def __init__(self):
        self.orphan = None
    def init_weight_transfer_engine(self, info):
        self.orphan = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(info["master_port"])])
    def start_weight_update(self):
        pass
    def update_weights(self, info):
        time.sleep(0.3)
        raise ConnectionError("the API server is gone")
    def finish_weight_update(self):
        pass


client = GoneServer()
info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=int(sys.argv[1]), world_size=2, timeout_s=60, rank=0)
engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=ModuleSource(torch.nn.Linear(64, 64)))
t0 = time.monotonic()
try:
    engine.send_weights()
    print("returned")
except RuntimeError as err:
    print(f"{err} | cause: {err.__cause__!r}")
engine.shutdown()
del engine
print(f"{time.monotonic() - t0:.2f}", flush=True)
client.orphan.kill()
"""


def test_a_push_to_a_worker_that_never_got_the_call_fails_and_tears_down_fast():
    """The sender posts no broadcast before every worker announced it is receiving, so a push to a server whose API
    process died leaves no collective behind: giving up, dropping the group and exiting take seconds, not the group
    timeout (a posted, never-received broadcast blocks the group's teardown for the whole 60 s timeout)."""
    import subprocess
    import sys

    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _SENDER, str(_free_port()), _ORPHAN], capture_output=True, text=True, timeout=120
    )
    total = time.monotonic() - t0
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "abandoned" in lines[0] and "API server is gone" in lines[0]
    assert float(lines[1]) < 5.0
    assert total < 30.0  # start-up, the push and the exit: not the 60 s group timeout
