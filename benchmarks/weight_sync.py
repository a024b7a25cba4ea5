"""Weight-push time against the machine's raw collective for the same bytes, and delta against full pushes.

1. A real `vllm serve` (CPU build: the gloo data plane; GPU: NCCL) on a locally built Qwen2 of the chosen shape;
   `WeightPusher.push` is timed by wall clock over `--pushes` rounds (pause, start, update + broadcast, finish,
   resume: everything a training step waits for), for each `--modes` (`weight_sync_mode` full and delta; delta
   needs gloo). Before each push one AdamW step at `--learning-rate` (the demo's 3e-4 by default) on a next-token
   loss moves the weights, so delta pushes send what an optimizer step changed.
2. The full push's bytes, cut into the same buckets, broadcast by `torch.distributed` (gloo on CPU) between two fresh
   local processes: the ceiling the data plane can reach here.

Prints the push seconds of each mode against the raw broadcast, and the bytes each mode sent against the dense bytes,
measured in this one run. For the 0.5B shape use `--learning-rate 0` (AdamW's state would take 4 GB more).

    .venv/bin/python benchmarks/weight_sync.py [--shape demo|tiny|qwen0.5b] [--vllm-dtype bfloat16] [--pushes 5]
        [--bucket-mb 64] [--modes full delta] [--learning-rate 3e-4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
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


def train_step(model, optimizer, tokens: int, vocab: int, gen) -> None:
    """One AdamW step on a next-token loss over `tokens` random token ids: real gradients, so the weights move the
    way an optimizer moves them (Adam's per-element step is about the learning rate)."""
    import torch

    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=["tiny", "demo", "qwen0.5b"],
        default="tiny",
        help="tiny: --hidden / --layers; demo: the demo's builtin:tiny (0.48M parameters); qwen0.5b: Qwen2.5-0.5B's "
        "shape with random weights (494M parameters)",
    )
    p.add_argument(
        "--vllm-dtype", default="float32", help="the server's dtype; 16-bit ones are pushed cast (CastSource)"
    )
    p.add_argument("--hidden", type=int, default=512, help="model width (head dim 32)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pushes", type=int, default=5, help="timed pushes per mode (after one warm-up push)")
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="MiB per flat broadcast (default: the backend's, 64 MiB)"
    )
    p.add_argument("--modes", nargs="+", default=["full", "delta"], choices=["full", "delta"])
    p.add_argument(
        "--learning-rate",
        type=float,
        default=3e-4,
        help="one AdamW step at this rate before every push (the demo's rate by default); 0: push unchanged weights",
    )
    p.add_argument("--train-tokens", type=int, default=64, help="tokens in each AdamW step's batch")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource

    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.tiny_model import build_tiny_model
    from async_grpo.transports.weights import delta
    from async_grpo.transports.weights.cast import for_server
    from async_grpo.transports.weights.gloo_wire import DEFAULT_BUCKET_BYTES, plan_buckets
    from async_grpo.transports.weights.sync import WeightPusher, resolve_backend

    bucket_bytes = DEFAULT_BUCKET_BYTES if args.bucket_mb is None else int(args.bucket_mb * 1024 * 1024)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    if args.shape == "qwen0.5b":
        from overlap import build_model  # benchmarks/ is on sys.path when this script runs

        path = build_model(work, argparse.Namespace(shape="qwen0.5b"))
    elif args.shape == "demo":
        path = build_tiny_model(work / "model", seed=0)
    else:
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    source = for_server(ModuleSource(model), args.vllm_dtype)
    metas = source.metadata()
    nbytes = sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in metas)
    backend = resolve_backend("auto")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VLLMServer(
        build_server_command(path, port=port, weight_transfer_backend=backend, dtype=args.vllm_dtype),
        server_env(1),
        work / "vllm.log",
        url,
        400.0,
    )
    results: dict[str, dict] = {}
    server.start()
    print(f"vLLM server log: {work / 'vllm.log'}", file=sys.stderr)
    try:
        for mode in args.modes:
            pusher = WeightPusher(source, url, backend=backend, timeout_s=300, bucket_bytes=bucket_bytes, mode=mode)
            try:
                pusher.push(0)  # warm-up: rendezvous, first allocation (and the full push a delta chain starts from)
                push_s, sent = [], []
                for i in range(args.pushes):
                    if args.learning_rate > 0:
                        train_step(model, optimizer, args.train_tokens, model.config.vocab_size, gen)
                    push_s.append(pusher.push(i + 1))
                    sent.append(pusher.last_report.wire_bytes)
            finally:
                pusher.close()
            results[mode] = {
                "push_s_median": statistics.median(push_s),
                "push_s": push_s,
                "bytes_per_push_median": statistics.median(sent),
            }
    finally:
        server.stop()
    payloads = [delta.padded(torch.Size(m.shape).numel() * m.dtype.itemsize) for m in metas]
    buckets = plan_buckets(payloads, bucket_bytes)
    raw_s = raw_broadcast_seconds([sum(payloads[i] for i in b) for b in buckets], "uint8", args.pushes)
    print(
        json.dumps(
            {
                "backend": backend,
                "shape": args.shape,
                "vllm_dtype": args.vllm_dtype,
                "learning_rate": args.learning_rate,
                "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                "dense_bytes_per_push": nbytes,
                "buckets": len(buckets),
                "raw_broadcast_s_median": raw_s,
                "raw_MB_per_s": nbytes / raw_s / 1e6,
                "modes": results,
            },
            indent=2,
        )
    )
    for mode, r in results.items():
        print(
            f"{mode} push: {r['push_s_median']:.3f} s = {raw_s / r['push_s_median']:.2f} x the raw {backend} "
            f"broadcast of the full bytes ({raw_s:.3f} s); {r['bytes_per_push_median'] / nbytes:.3f} of the dense bytes"
        )


if __name__ == "__main__":
    main()
