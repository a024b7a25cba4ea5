"""Weight-push bandwidth against the machine's raw collective bandwidth for the same bytes.

1. A real `vllm serve` (CPU build: the gloo data plane; GPU: NCCL) on a locally built Qwen2 of the chosen size;
   `WeightPusher.push` is timed by wall clock over `--pushes` rounds (pause, start, update + broadcast, finish,
   resume: everything a training step waits for).
2. The same bytes, cut into the same buckets, broadcast by `torch.distributed` (gloo on CPU) between two fresh local
   processes: the ceiling the data plane can reach here.

Prints bytes per push, both bandwidths (MB/s) and push / raw, measured in this one run.

    .venv/bin/python benchmarks/weight_sync.py [--hidden 512 --layers 8 --pushes 5 --bucket-mb 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_rank(rank: int, port: int, sizes: list[int], dtype_name: str, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    bufs = [torch.ones(n, dtype=getattr(torch, dtype_name)) for n in sizes]
    dist.barrier()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for buf in bufs:
            dist.broadcast(buf, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def raw_broadcast_seconds(sizes: list[int], dtype_name: str, rounds: int) -> float:
    """Median seconds to broadcast buckets of `sizes` elements from rank 0 to rank 1 over gloo (two processes)."""
    import torch.multiprocessing as mp

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(
        _raw_rank, args=(_free_port(), sizes, dtype_name, rounds, out), nprocs=2, join=True, start_method="spawn"
    )
    return statistics.median(json.loads(Path(out).read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="model width (head dim 32)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pushes", type=int, default=5, help="timed pushes (after one warm-up push)")
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="MiB per flat broadcast (default: the backend's, 256 MiB)"
    )
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource

    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.tiny_model import build_tiny_model
    from async_grpo.transports.weights.gloo import DEFAULT_BUCKET_BYTES, plan_buckets

    bucket_bytes = DEFAULT_BUCKET_BYTES if args.bucket_mb is None else int(args.bucket_mb * 1024 * 1024)
    from async_grpo.transports.weights.sync import WeightPusher, resolve_backend

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    heads = args.hidden // 32
    path = build_tiny_model(
        work / "model",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        intermediate_size=2 * args.hidden,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    metas = ModuleSource(model).metadata()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    backend = resolve_backend("auto")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VLLMServer(
        build_server_command(path, port=port, weight_transfer_backend=backend),
        server_env(1),
        work / "vllm.log",
        url,
        400.0,
    )
    server.start()
    try:
        pusher = WeightPusher(model, url, backend=backend, timeout_s=300, bucket_bytes=bucket_bytes)
        pusher.push(0)  # warm-up: rendezvous, first allocation
        push_s = [pusher.push(i + 1) for i in range(args.pushes)]
        pusher.close()
    finally:
        server.stop()
    buckets = plan_buckets(metas, bucket_bytes)
    sizes = [sum(torch.Size(metas[i].shape).numel() for i in b) for b in buckets]
    raw_s = raw_broadcast_seconds(sizes, "float32", args.pushes)
    push_med = statistics.median(push_s)
    print(
        json.dumps(
            {
                "backend": backend,
                "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                "bytes_per_push": nbytes,
                "buckets": len(buckets),
                "push_s_median": push_med,
                "raw_broadcast_s_median": raw_s,
                "push_MB_per_s": nbytes / push_med / 1e6,
                "raw_MB_per_s": nbytes / raw_s / 1e6,
            },
            indent=2,
        )
    )
    print(f"weight push bandwidth = {raw_s / push_med:.2f} x the raw {backend} broadcast of the same bytes")


if __name__ == "__main__":
    main()
