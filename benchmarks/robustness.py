"""Do the shipped CPU examples learn whatever the timing? Each example x seeds x {quiet machine, a busy neighbour}.

The asynchronous schedule (which policy version samples which group, how stale each batch is) differs on every run,
and more so on a loaded machine. A configuration proven in one run can collapse in another with the same seed
(issue 48: the tool-calling example fell from 1.33 to 0.28 held-out reward in about one run in five). This runs each
example as a user does, `async-grpo train examples/<name>.yaml output_dir=... seed=S`, one cell after another, and
reads its held-out reward (`eval/reward`, with its standard error `eval/reward_se`) from the run's MLflow store:

- `start`: before the first step (step 0); `final`: at the last step; `best`: the highest on the way;
- `gain`: final - start; `collapsed`: the run ended below its start, or its collapse guard fired
  (`collapse/detected`, `runner/collapse.py`, at the example's `on_collapse`, `warn` by default).

Conditions: `quiet` (nothing else runs) and `busy` (a process spinning on the first core of this process's CPU
affinity for the whole run, started before the run and ended by PID after it: the trainer, vLLM and the workers
then share that core with it, as beside another job on a node).

The default matrix is issue 48's: the demo (`tiny_cpu`) and the tool-calling example (`tools_cpu`) x seeds 0, 1, 2
x both conditions, and the agentic environment (`guess_cpu`), the same game played by an unmodified agent
(`agent_cpu`), the reward model (`reward_model_cpu`) and LoRA (`lora_cpu`) x seed 0 under the busy neighbour. That
is 16 runs, about 2 hours on 2 cores, plus about 17 minutes
to build the reward model (`runs/reverse-reward-model`) before its cell when it is not there yet. Prints a row per cell and
a summary per example (the mean gain, its spread over the seeds, and the smallest gain), and writes
`robustness.csv` and `robustness.md` (the table for docs/reproducibility.md) into `--out`. Exits 1 when a cell
collapsed or failed. `--examples` narrows the matrix to those examples, each with its own seeds and conditions;
`--seeds` and `--conditions` replace them.

    .venv/bin/python benchmarks/robustness.py [--examples tiny_cpu tools_cpu] [--seeds 0 1 2]
        [--conditions quiet busy] [--set KEY=VALUE ...] [--out DIR] [--timeout-s 3600]
    .venv/bin/python benchmarks/robustness.py --reduced     # CI's form: the demo, seed 0, busy, a few steps
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from time_to_reward import Child, child_env, metric_history  # noqa: E402  (the benchmarks' process handling, shared)

EXAMPLES = ROOT / "examples"
# issue 48's matrix: (example, seeds, conditions)
DEFAULT_MATRIX = [
    ("tiny_cpu", (0, 1, 2), ("quiet", "busy")),
    ("tools_cpu", (0, 1, 2), ("quiet", "busy")),
    ("guess_cpu", (0,), ("busy",)),
    ("agent_cpu", (0,), ("busy",)),
    ("reward_model_cpu", (0,), ("busy",)),
    ("lora_cpu", (0,), ("busy",)),
]
# CI's form: the demo's task and reward with a short warm start and a few steps (about a minute on one core)
# what an example reads that the repo does not ship: (the path, relative to the working directory, as the example
# names it; the script that builds it there). Built once, before the example's first cell, when the path is missing.
PREREQUISITES = {
    "reward_model_cpu": ("runs/reverse-reward-model", EXAMPLES / "reward_model" / "build_reverse_reward_model.py"),
}
REDUCED_SET = ["warmup_sft_steps=300", "max_steps=12", "eval_steps=6", "eval_num_prompts=16", "save_model=false"]
BUSY_LOOP = "while True:\n    pass\n"
POLL_S = 1.0


@dataclass
class Cell:
    """One run of the matrix and what its MLflow store says about it.

    Attributes:
        example: the example's name (examples/<example>.yaml).
        seed: its `seed`.
        condition: `quiet` or `busy`.
        start, final, best: held-out reward (`eval/reward`) at step 0, at the last step, and the highest logged.
        final_se: the final evaluation's standard error (`eval/reward_se`), NaN when not logged.
        gain: final - start.
        steps: the last step with a held-out reward.
        collapse_detected: the collapse guard fired (`collapse/detected` > 0 at some step).
        collapsed: final < start, or collapse_detected.
        wall_s: the run's wall-clock seconds (seconds), start-up included.
        exit_code: the run's exit code (None: killed at the timeout).
    """

    example: str
    seed: int
    condition: str
    start: float = float("nan")
    final: float = float("nan")
    best: float = float("nan")
    final_se: float = float("nan")
    gain: float = float("nan")
    steps: int = 0
    collapse_detected: bool = False
    collapsed: bool = False
    wall_s: float = 0.0
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        """The run finished (exit 0), logged a start and a final held-out reward, and did not collapse."""
        return self.exit_code == 0 and self.steps > 0 and not self.collapsed


class BusyNeighbour:
    """A Python process spinning on one core (`core`) until `stop`; a context manager."""

    def __init__(self, core: int):
        self.core = core
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> BusyNeighbour:
        core = self.core
        self.process = subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.sched_setaffinity(0, {core})
        )
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)


def read_cell(cell: Cell, db: Path) -> Cell:
    """Fill `cell` from the run's sqlite MLflow store `db` (see `Cell`)."""
    rewards = metric_history(db, "eval/reward")
    if rewards:
        cell.start, cell.final = rewards[0][2], rewards[-1][2]
        cell.best, cell.steps = max(v for _, _, v in rewards), rewards[-1][0]
        cell.gain = cell.final - cell.start
    se = metric_history(db, "eval/reward_se")
    if se:
        cell.final_se = se[-1][2]
    cell.collapse_detected = any(v > 0 for _, _, v in metric_history(db, "collapse/detected"))
    cell.collapsed = cell.collapse_detected or (bool(rewards) and cell.final < cell.start)
    return cell


def prepare(example: str, timeout_s: float) -> None:
    """Build what `example` reads and the repo does not ship (`PREREQUISITES`), once: skipped when the path exists.

    Raises:
        RuntimeError: the build failed or ran past `timeout_s` seconds (its log's tail in the message).
    """
    if example not in PREREQUISITES:
        return
    path, script = PREREQUISITES[example]
    if Path(path).exists():
        return
    print(f"{example}: building {path} first ({script.name})", flush=True)
    log = Path(path).with_name(Path(path).name + ".build.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    child = Child([sys.executable, str(script), path], log, child_env())
    try:
        code = child.wait(timeout_s)
    finally:
        child.stop(grace_s=30.0)
    if code != 0:
        raise RuntimeError(f"{example}: building {path} ended with exit code {code}:\n{child.tail(20)}")


def run_cell(example: str, seed: int, condition: str, args: argparse.Namespace, out: Path) -> Cell:
    """One run of `examples/<example>.yaml` at `seed` under `condition`, in a child process bounded by
    `args.timeout_s` seconds (then stopped, exit code None)."""
    folder = out / f"{example}-seed{seed}-{condition}"
    command = [sys.executable, "-m", "async_grpo.cli", "train", str(EXAMPLES / f"{example}.yaml"),
               f"output_dir={folder}", f"seed={seed}", *args.set]  # fmt: skip
    env = {k: v for k, v in child_env().items() if not k.startswith("MLFLOW_")}  # the run's own sqlite store
    cell = Cell(example, seed, condition)
    folder.mkdir(parents=True, exist_ok=True)
    neighbour = BusyNeighbour(min(os.sched_getaffinity(0))) if condition == "busy" else contextlib.nullcontext()
    t0 = time.monotonic()
    with neighbour:
        child = Child(command, folder / "train.log", env)
        try:
            while child.wait(POLL_S) is None and time.monotonic() - t0 < args.timeout_s:
                child.remember_descendants()
            cell.exit_code = child.process.poll()
        finally:
            child.stop(grace_s=60.0)
    cell.wall_s = time.monotonic() - t0
    read_cell(cell, folder / "mlflow.db")
    if cell.exit_code != 0:
        print(f"  {folder.name}: exit code {cell.exit_code}; the log's tail:\n{child.tail(20)}", flush=True)
    return cell


def summary_lines(cells: list[Cell]) -> list[str]:
    """Per example: cells, the mean gain, its spread over the cells (standard deviation), the smallest gain, and
    how many collapsed or failed."""
    lines = []
    for example in dict.fromkeys(c.example for c in cells):
        mine = [c for c in cells if c.example == example]
        gains = [c.gain for c in mine if c.steps]
        spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        bad = sum(not c.ok for c in mine)
        mean = statistics.fmean(gains) if gains else float("nan")
        smallest = min(gains) if gains else float("nan")
        lines.append(f"{example}: {len(mine)} cell(s), gain {mean:+.3f} (sd {spread:.3f} over cells), smallest "
                     f"{smallest:+.3f}; collapsed or failed: {bad}")  # fmt: skip
    return lines


def markdown(cells: list[Cell]) -> str:
    """The cells as a markdown table (docs/reproducibility.md)."""
    rows = ["| example | seed | condition | start | final (+- se) | gain | best | collapsed | wall s |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]  # fmt: skip
    for c in cells:
        state = "failed" if c.exit_code != 0 else ("yes" if c.collapsed else "no")
        rows.append(f"| {c.example} | {c.seed} | {c.condition} | {c.start:.3f} | {c.final:.3f} +- {c.final_se:.3f} | "
                    f"{c.gain:+.3f} | {c.best:.3f} | {state} | {c.wall_s:.0f} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=None, help="examples/<name>.yaml to run (default: the matrix)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default: the matrix's)")
    parser.add_argument("--conditions", nargs="+", choices=["quiet", "busy"], default=None,
                        help="conditions (default: the matrix's)")  # fmt: skip
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every run")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="each run's wall-clock bound (seconds)")
    parser.add_argument("--out", default=None, help="folder for the runs and the report (default: a temporary one)")
    parser.add_argument("--reduced", action="store_true", help="CI's form: the demo, seed 0, busy, a few steps")
    args = parser.parse_args(argv)
    if args.reduced:
        args.examples, args.seeds, args.conditions = ["tiny_cpu"], [0], ["busy"]
        args.set = REDUCED_SET + args.set
        args.timeout_s = min(args.timeout_s, 900.0)
    for name in args.examples or []:
        if not (EXAMPLES / f"{name}.yaml").is_file():
            parser.error(f"--examples {name}: no examples/{name}.yaml")
    return args


def matrix(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """The (example, seed, condition) cells to run: the default matrix, narrowed by the flags; an example named in
    `--examples` keeps its seeds and conditions from the matrix, one outside it gets seeds 0-2 x quiet and busy."""
    if args.examples is None:
        rows = DEFAULT_MATRIX
    else:
        known = {row[0]: row for row in DEFAULT_MATRIX}
        rows = [known.get(name, (name, (0, 1, 2), ("quiet", "busy"))) for name in args.examples]
    return [(example, seed, condition) for example, seeds, conditions in rows
            for seed in (args.seeds or seeds) for condition in (args.conditions or conditions)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still ends its runs (finally)
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="robustness-"))
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    for example, seed, condition in matrix(args):
        prepare(example, args.timeout_s)
        print(f"{example} seed {seed} {condition} ...", flush=True)
        cell = run_cell(example, seed, condition, args, out)
        cells.append(cell)
        print(f"  start {cell.start:.3f} final {cell.final:.3f} +- {cell.final_se:.3f} gain {cell.gain:+.3f} "
              f"best {cell.best:.3f} collapsed {cell.collapsed} ({cell.wall_s:.0f} s)", flush=True)  # fmt: skip
    with open(out / "robustness.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(cells[0])))
        writer.writeheader()
        writer.writerows(asdict(c) for c in cells)
    table = markdown(cells)
    (out / "robustness.md").write_text(table)
    print("\n" + table)
    for line in summary_lines(cells):
        print(line)
    print(f"cells {len(cells)}, collapsed or failed {sum(not c.ok for c in cells)}; report in {out}", flush=True)
    return 0 if all(c.ok for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
