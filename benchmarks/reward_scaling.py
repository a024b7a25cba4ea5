"""Reward throughput with 1, 2 and 4 reward workers on a CPU-bound reward function.

The real `RewardPool` (spawned worker processes) scores `--groups` groups of G completions, all submitted at once as
the orchestrator does, with a reward that burns `--busy-ms` of CPU per completion. Prints groups/s per worker count
and the scaling efficiency throughput(N) / (N x throughput(1)), measured in this one run. On a machine with C cores,
N > C cannot scale past C.

    .venv/bin/python benchmarks/reward_scaling.py [--groups 24 --busy-ms 20 --workers 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

BUSY_REWARD = '''
import time


def busy_reward(prompts, completions, completion_ids=None, *, busy_ms=20, **kwargs):
    """A CPU-bound reward: spins for busy_ms of CPU time per completion, then scores the length."""
    out = []
    for c in completions:
        end = time.process_time() + busy_ms[0] / 1000.0
        x = 0
        while time.process_time() < end:
            x += 1
        out.append(float(len(c)))
    return out
'''


def throughput(spec: str, workers: int, groups: int, g: int, busy_ms: int) -> float:
    """Groups per second (wall clock) for `groups` groups submitted at once to a pool of `workers` processes."""
    from async_grpo.rewards.pool import RewardPool

    with RewardPool([spec], num_workers=workers, timeout_s=600) as pool:
        warm = [pool.submit(["p"] * g, ["x"] * g, [[1]] * g, {"busy_ms": [1] * g}) for _ in range(workers)]
        for f in warm:  # start every worker before timing
            f.result(timeout=120)
        t0 = time.perf_counter()
        futures = [pool.submit(["p"] * g, ["ab"] * g, [[1, 2]] * g, {"busy_ms": [busy_ms] * g}) for _ in range(groups)]
        for f in futures:
            f.result(timeout=600)
        return groups / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--generations", type=int, default=8, help="completions per group (G)")
    p.add_argument("--busy-ms", type=int, default=20, help="CPU milliseconds per completion")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    path = Path(tempfile.mkdtemp(prefix="reward-scaling-")) / "busy.py"
    path.write_text(BUSY_REWARD)
    spec = f"{path}:busy_reward"
    rates = {n: throughput(spec, n, args.groups, args.generations, args.busy_ms) for n in args.workers}
    base = rates[args.workers[0]] / args.workers[0]
    print(
        json.dumps(
            {
                "cores": os.cpu_count(),
                "groups": args.groups,
                "completions_per_group": args.generations,
                "cpu_ms_per_completion": args.busy_ms,
                "groups_per_s": rates,
            },
            indent=2,
        )
    )
    for n, r in rates.items():
        print(f"{n} worker(s): {r:.2f} groups/s, efficiency {r / (n * base):.2f} of linear scaling")


if __name__ == "__main__":
    main()
