"""Resident memory over a long run: the slope, in MB per 1,000 steps, of every process role of a local run.

Runs the tiny demo (`examples/tiny_cpu.yaml`: a launched vLLM CPU server, two reward workers, the trainer with its
orchestrator thread) for `--steps` steps with no periodic evaluation, reads the per-step resident memory the run
logs (`memory/rss_mb/trainer`, `memory/rss_mb/vllm`, `memory/rss_mb/workers`, from `runner.memory`) back from its
MLflow store, and prints, per role, the memory at the end of the warm-up and at the end, and the least-squares slope
after the warm-up (`runner.memory.slope_per_1000_steps`; the first `--warmup-fraction` of the steps are left out:
allocator pools, caches and the prefix cache fill up first). Exits 1 when a slope exceeds `--max-slope-mb` in a run
of at least 1,000 steps (issue 28's bar: 5 MB per 1,000 steps); shorter runs only report.

The vLLM CPU server's KV cache (`vllm_kv_cache_gib`, VLLM_CPU_KVCACHE_SPACE) is allocated once but its pages become
resident only when a block is first written, and with prefix caching freed blocks are reused least recently used
first, so the server's RSS climbs until every block has been used once. For the vllm role the run therefore also
passes when its whole growth, from the first logged step to the last, stays within the KV cache's size plus
`--max-slope-mb` per 1,000 steps: growth explained and bounded. The report prints both.

    .venv/bin/python benchmarks/memory.py [--steps 2000] [--max-slope-mb 5] [--out runs/memory-benchmark]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("trainer", "vllm", "workers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--max-slope-mb", type=float, default=5.0, help="MB per 1,000 steps, per role")
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--warmup-sft-steps", type=int, default=1500)
    parser.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import mlflow

    from async_grpo.runner.memory import slope_per_1000_steps

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="memory-benchmark-"))
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"output_dir={out}", f"max_steps={args.steps}", "eval_strategy=no", "eval_num_prompts=8",
           f"warmup_sft_steps={args.warmup_sft_steps}", "log_completions=false", "save_steps=0",
           f"mlflow_tracking_uri=sqlite:///{out.resolve() / 'mlflow.db'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    t0 = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        return result.returncode
    client = mlflow.MlflowClient(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])[0]
    report, over = {"steps": args.steps, "wall_s": round(wall, 1)}, []
    kv_cache_mb = 1024.0 * float(run.data.params.get("vllm_kv_cache_gib", 1))
    print(
        f"{args.steps} steps in {wall:.0f} s; resident memory after the first {args.warmup_fraction:.0%} of the steps:"
    )
    for role in ROLES:
        history = sorted(client.get_metric_history(run.info.run_id, f"memory/rss_mb/{role}"), key=lambda m: m.step)
        steps, values = [float(m.step) for m in history], [m.value for m in history]
        slope = slope_per_1000_steps(steps, values, args.warmup_fraction)
        start = next(v for s, v in zip(steps, values, strict=True) if s >= args.warmup_fraction * args.steps)
        report[role] = {"mb_after_warmup": round(start, 1), "mb_at_end": round(values[-1], 1),
                        "slope_mb_per_1000_steps": round(slope, 2), "samples": len(values)}  # fmt: skip
        print(f"  {role:8s} {start:8.1f} MB -> {values[-1]:8.1f} MB; slope {slope:+.2f} MB per 1,000 steps")
        growth = values[-1] - values[0]
        report[role]["growth_mb_from_step_1"] = round(growth, 1)
        bounded = False
        if role == "vllm":
            bound = kv_cache_mb + args.max_slope_mb * args.steps / 1000
            bounded = growth <= bound
            print(
                f"           growth from step 1: {growth:+.1f} MB; KV cache {kv_cache_mb:.0f} MB (bound {bound:.0f} MB)"
            )
            report[role]["kv_cache_mb"] = kv_cache_mb
        if args.steps >= 1000 and slope > args.max_slope_mb and not bounded:
            over.append(role)
    print(json.dumps(report))
    if over:
        print(f"memory grows faster than {args.max_slope_mb:g} MB per 1,000 steps in: {over}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
