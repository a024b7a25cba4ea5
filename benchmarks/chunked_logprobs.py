"""Peak memory of per-token logprobs (forward + backward): full (N, T, V) logits vs the chunked LM head.

Each variant runs in a fresh subprocess and reports its peak RSS (ru_maxrss), so the two do not share
an allocator high-water mark. Prints both peaks and their ratio, measured in this one run.

    .venv/bin/python benchmarks/chunked_logprobs.py [--n 8 --t 512 --h 256 --v 65536 --chunk 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _measure(n: int, t: int, h: int, v: int, chunk: int | None) -> dict:
    import torch

    from async_grpo.trainer.logprobs import chunked_token_logps

    torch.manual_seed(0)
    torch.set_num_threads(1)
    head = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, t, h, requires_grad=True)
    targets = torch.randint(0, v, (n, t))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    logps, _ = chunked_token_logps(hidden, head, targets, chunk or t)  # chunk = t: one block = full logits
    logps.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_mib": peak / 1024, "delta_mib": (peak - base) / 1024, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8, help="sequences")
    p.add_argument("--t", type=int, default=512, help="completion tokens per sequence")
    p.add_argument("--h", type=int, default=256, help="hidden size")
    p.add_argument("--v", type=int, default=65536, help="vocabulary size")
    p.add_argument("--chunk", type=int, default=64, help="positions per LM-head block")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(_measure(a.n, a.t, a.h, a.v, None if a.child == "full" else a.chunk)))
        return
    results = {}
    for variant in ("full", "chunked"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--n",
            str(a.n),
            "--t",
            str(a.t),
            "--h",
            str(a.h),
            "--v",
            str(a.v),
            "--chunk",
            str(a.chunk),
        ]
        results[variant] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout.strip().splitlines()[-1]
        )
    logits_mib = a.n * a.t * a.v * 4 / 2**20
    print(f"case: N={a.n} T={a.t} H={a.h} V={a.v} (float32 logits = {logits_mib:.0f} MiB), chunk={a.chunk}")
    for k, r in results.items():
        print(f"  {k:8s} peak RSS growth {r['delta_mib']:8.0f} MiB   forward+backward {r['seconds']:.2f} s")
    ratio = results["full"]["delta_mib"] / max(results["chunked"]["delta_mib"], 1e-9)
    print(
        f"  memory ratio full/chunked = {ratio:.1f}x; time ratio chunked/full = "
        f"{results['chunked']['seconds'] / results['full']['seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
