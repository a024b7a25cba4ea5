"""On-policy distillation against GRPO alone, from the same student: held-out reward by step and by wall-clock second.

examples/distill_cpu.yaml as a user runs it (`async-grpo train examples/distill_cpu.yaml seed=S ...`), five ways:

- `grpo`: GRPO alone (`teacher_model_name_or_path=null`): the reward functions' group advantage only;
- `distill`: the teacher alone on the sampled tokens (`distillation_only=true`, `distillation_loss=reverse_kl`): each
  token's advantage is distillation_weight x (log p_teacher - log p_student), the reverse-KL term of
  `algorithms.distillation`;
- `distill_grpo`: both (`distillation_loss=reverse_kl`): the GRPO advantage plus the teacher's per-token term;
- `topk`: the teacher alone, dense (`distillation_only=true`, `distillation_loss=forward_kl`): at every position the
  forward KL from the teacher's top-k (`distillation_topk`) to the student joins the loss;
- `topk_grpo`: the GRPO advantage plus the dense term (`distillation_loss=forward_kl`, the example's default).

Everything else is the example's: the tiny student (`builtin:tiny`, seed S) after a short supervised warm start
(`warmup_sft_steps`), the reverse task and its reward functions, G=8, 128 completions per step, temperature 1, dapo,
max_staleness 2, the learning rate, float32, one trainer thread beside one vLLM CPU server. The teacher is the tiny
model trained longer on the task (`async-grpo make-tiny-model <dir> --sft-steps N`, built once when `--teacher-dir`
has no model yet). One vLLM server serves it for every run (`teacher_url`), started once here, so its start-up
(about 40 s, which a run that serves its own teacher pays before training) is outside every run's time.

Each run is a child process with its own MLflow store; its held-out reward (`eval/reward`: `eval_num_prompts` fixed
prompts x `num_generations_eval` samples at fixed seeds, the same for every system) is read at every `eval_steps`
steps, with its MLflow timestamp. Wall seconds count from the step-0 evaluation (logged just before the orchestrator
starts: the servers' start-up and the warm start are outside), so they include the evaluations, equally for every
system. The target is `--target` (held-out reward, weighted sum of the two functions, at most 1.5), else the
students' median step-0 reward + `--margin`; with `--relative`, each run's own step-0 reward + `--margin` (the
student's warm start differs by seed: 0.56, 0.85 and 0.92 at seeds 0-2).

Prints, per system, the median and range (min-max over seeds) of the steps and of the seconds until the held-out
reward first reaches the target ("not reached" for a run that never did), the final reward and its gain over the
run's own start (mean and standard deviation over seeds: the students' starts differ by seed), and the ratios
(`ratio_lines`: each teacher-alone system / grpo, each teacher + GRPO system / the better of grpo and its teacher
alone); writes
`distillation.csv` (system, seed, step, wall_s, heldout_reward) and `distillation.png` (held-out reward against steps
and against wall seconds: every run, the per-system mean, the target line) into `--out`.

    .venv/bin/python benchmarks/distillation.py [--seeds 0 1 2] [--systems grpo distill distill_grpo topk topk_grpo]
        [--target 1.0] [--set KEY=VALUE ...] [--out runs/bench-distillation]
    .venv/bin/python benchmarks/distillation.py --reduced     # CI's form: seed 0, grpo and topk_grpo, a few steps
    .venv/bin/python benchmarks/distillation.py --summarize runs/bench-distillation/distillation.csv --relative
"""

from __future__ import annotations

import argparse
import csv
import math
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from time_to_reward import Child, child_env, metric_history  # noqa: E402  (the benchmarks' process handling, shared)

EXAMPLE = ROOT / "examples" / "distill_cpu.yaml"
SYSTEMS = {  # system -> the overrides that make it, beside the example's config
    "grpo": ["teacher_model_name_or_path=null"],
    "distill": ["distillation_only=true", "distillation_loss=reverse_kl"],
    "distill_grpo": ["distillation_loss=reverse_kl"],
    "topk": ["distillation_only=true", "distillation_loss=forward_kl"],
    "topk_grpo": ["distillation_loss=forward_kl"],
}
DISTILLING = ("distill", "distill_grpo", "topk", "topk_grpo")
WITH_REWARD = {"distill_grpo": "distill", "topk_grpo": "topk"}  # teacher + GRPO -> the teacher alone, same loss
REDUCED_SET = ["max_steps=8", "eval_steps=4", "eval_num_prompts=16", "warmup_sft_steps=30", "save_model=false"]
REDUCED_TEACHER_SFT_STEPS = 60
POLL_S = 1.0


@dataclass
class Run:
    """One system at one seed.

    Attributes:
        system: a key of SYSTEMS.
        seed: the run's seed.
        points: (step, wall seconds since the step-0 evaluation, held-out reward), by step.
        exit_code: the child's exit code (None: stopped at the timeout).
        drops: groups dropped for a failed teacher or reward (`dropped_groups/<reason>`, the run's last value).
    """

    system: str
    seed: int
    points: list[tuple[int, float, float]] = field(default_factory=list)
    exit_code: int | None = None
    drops: dict[str, float] = field(default_factory=dict)

    def first_at(self, target: float) -> tuple[int, float] | None:
        """(step, wall seconds) of the first evaluation at or above `target`; None when none reached it."""
        return next(((s, w) for s, w, r in self.points if r >= target), None)


def build_teacher(folder: Path, sft_steps: int, timeout_s: float) -> None:
    """`async-grpo make-tiny-model <folder> --sft-steps <sft_steps>` when `folder` holds no model yet.

    Raises:
        RuntimeError: the build failed or ran past `timeout_s` seconds (its log's tail in the message).
    """
    if (folder / "config.json").is_file():
        print(f"teacher: {folder} (already built)", flush=True)
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.with_name(folder.name + ".build.log")
    command = [sys.executable, "-m", "async_grpo.cli", "make-tiny-model", str(folder), "--sft-steps", str(sft_steps)]
    child = Child(command, log, child_env())
    try:
        code = child.wait(timeout_s)
    finally:
        child.stop(grace_s=30.0)
    if code != 0:
        raise RuntimeError(f"building the teacher {folder} ended with exit code {code}:\n{child.tail(20)}")
    print(f"teacher: {child.tail(1).strip()}", flush=True)


def start_teacher(folder: Path, out: Path, overrides: list[str]):
    """The teacher served as a run serves it (`launch.local.start_teacher_server`: a plain vLLM server with the
    example's dtype, context length, seed, KV cache and threads; log `out/vllm-teacher.log`), started and healthy;
    the caller closes it.

    Raises:
        VLLMStartupError: it did not come up within the example's vllm_startup_timeout_s.
    """
    from async_grpo.config.io import load_config
    from async_grpo.launch.local import start_teacher_server

    config = load_config(EXAMPLE, [*overrides, f"teacher_model_name_or_path={folder}", f"output_dir={out}"])
    t0 = time.monotonic()
    _, server = start_teacher_server(config)
    print(f"teacher server: {server.url} ({time.monotonic() - t0:.0f} s to start)", flush=True)
    return server


def run_one(system: str, seed: int, teacher_url: str, args: argparse.Namespace, out: Path) -> Run:
    """`async-grpo train examples/distill_cpu.yaml` for `system` at `seed` in a child process bounded by
    `args.timeout_s` seconds, and its held-out curve read back from its MLflow store."""
    folder = out / f"{system}-seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    teacher = [f"teacher_url={teacher_url}", "teacher_model_name_or_path=null"] if system in DISTILLING else []
    command = [sys.executable, "-m", "async_grpo.cli", "train", str(EXAMPLE), f"output_dir={folder}", f"seed={seed}",
               *args.set, *teacher, *SYSTEMS[system]]  # fmt: skip
    env = {k: v for k, v in child_env().items() if not k.startswith("MLFLOW_")}  # the run's own sqlite store
    run = Run(system, seed)
    child = Child(command, folder / "train.log", env)
    t0 = time.monotonic()
    try:
        while child.wait(POLL_S) is None and time.monotonic() - t0 < args.timeout_s:
            child.remember_descendants()
        run.exit_code = child.process.poll()
    finally:
        child.stop(grace_s=60.0)
    db = folder / "mlflow.db"
    history = metric_history(db, "eval/reward")
    if history:
        start = history[0][1]
        run.points = [(step, ts - start, value) for step, ts, value in history]
    for reason in ("teacher_error", "teacher_timeout", "reward_error"):
        values = metric_history(db, f"dropped_groups/{reason}")
        if values:
            run.drops[reason] = values[-1][2]
    if run.exit_code != 0:
        print(f"  {folder.name}: exit code {run.exit_code}; the log's tail:\n{child.tail(20)}", flush=True)
    return run


def spread(values: list[float]) -> str:
    """`median (min-max)` of `values`, or "-" when empty."""
    if not values:
        return "-"
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def mean_sd(values: list[float]) -> str:
    """`mean +- standard deviation` (over seeds) of `values`, or "-" when empty."""
    if not values:
        return "-"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def summary(
    runs: list[Run], systems: list[str], target: float, relative: float | None = None
) -> tuple[list[str], dict[str, float]]:
    """The table's lines, and per system the median steps / seconds to target over the runs that reached it (inf
    when a run did not: a median over fewer runs would flatter the system). With `relative`, each run's target is
    its own step-0 reward + `relative` (the students' starts differ by seed) instead of `target`."""
    goal = f"each run's start + {relative:g}" if relative is not None else f"{target:.3f}"
    lines = [
        f"target: held-out reward >= {goal}",
        "system        | steps to target | seconds to target | final | gain over its start",
    ]
    medians: dict[str, float] = {}
    for system in systems:
        mine = [r for r in runs if r.system == system]
        hits = [r.first_at(target if relative is None else r.points[0][2] + relative) for r in mine if r.points]
        steps = [h[0] for h in hits if h]
        secs = [h[1] for h in hits if h]
        finals = [r.points[-1][2] for r in mine if r.points]
        gains = [r.points[-1][2] - r.points[0][2] for r in mine if r.points]
        reached = f"{len(steps)}/{len(mine)} reached"
        lines.append(
            f"{system:<13} | {spread(steps):<15} | {spread(secs):<17} | {mean_sd(finals)} ({reached}) | {mean_sd(gains)}"
        )
        whole = len(steps) == len(mine) and mine
        medians[f"{system}/steps"] = statistics.median(steps) if whole else math.inf
        medians[f"{system}/seconds"] = statistics.median(secs) if whole else math.inf
    return lines, medians


def ratio_lines(medians: dict[str, float], systems: list[str]) -> list[str]:
    """Each teacher-alone system / grpo, and each teacher + GRPO system / the better of grpo and its teacher alone
    (`WITH_REWARD`), in steps and in seconds to the target, for the systems that ran."""
    lines = []
    for unit in ("steps", "seconds"):
        for alone in ("distill", "topk"):
            if {alone, "grpo"} <= set(systems):
                value = fmt_ratio(medians[f"{alone}/{unit}"], medians[f"grpo/{unit}"])
                lines.append(f"{alone} / grpo ({unit} to target): {value}")
        for both, alone in WITH_REWARD.items():
            others = [medians[f"{s}/{unit}"] for s in ("grpo", alone) if s in systems]
            if both in systems and others:
                value = fmt_ratio(medians[f"{both}/{unit}"], min(others))
                lines.append(f"{both} / the better of grpo and {alone} ({unit} to target): {value}")
    return lines


def fmt_ratio(num: float, den: float) -> str:
    """`num / den` as `0.42x`, or why there is none."""
    if math.isinf(num) and math.isinf(den):
        return "neither reached the target"
    if math.isinf(num):
        return "numerator did not reach the target"
    if math.isinf(den):
        return "denominator did not reach the target"
    return f"{num / den:.2f}x"


def write_csv(runs: list[Run], path: Path) -> None:
    """One row per evaluation: system, seed, step, wall_s, heldout_reward."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["system", "seed", "step", "wall_s", "heldout_reward"])
        for run in runs:
            for step, wall, reward in run.points:
                writer.writerow([run.system, run.seed, step, f"{wall:.2f}", f"{reward:.4f}"])


def plot(runs: list[Run], systems: list[str], target: float, path: Path, relative: float | None = None) -> None:
    """Held-out reward against steps (left) and wall seconds (right): each run thin, each system's mean over seeds
    at each evaluation step thick, the target dashed. With `relative`, the gain over each run's own start is drawn
    instead, and the target line is at `relative`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    colors = {"grpo": "tab:blue", "distill": "tab:orange", "distill_grpo": "tab:green", "topk": "tab:red",
              "topk_grpo": "tab:purple"}  # fmt: skip
    shift = {id(r): (r.points[0][2] if relative is not None and r.points else 0.0) for r in runs}
    runs = [Run(r.system, r.seed, [(st, w, v - shift[id(r)]) for st, w, v in r.points]) for r in runs]
    for system in systems:
        mine = [r for r in runs if r.system == system and r.points]
        for r in mine:
            by_step.plot([p[0] for p in r.points], [p[2] for p in r.points], color=colors[system], alpha=0.3, lw=0.8)
            by_time.plot([p[1] for p in r.points], [p[2] for p in r.points], color=colors[system], alpha=0.3, lw=0.8)
        steps = sorted({p[0] for r in mine for p in r.points})
        common = [s for s in steps if all(any(p[0] == s for p in r.points) for r in mine)]  # every seed evaluated
        if common:
            mean = [statistics.mean(next(p[2] for p in r.points if p[0] == s) for r in mine) for s in common]
            wall = [statistics.mean(next(p[1] for p in r.points if p[0] == s) for r in mine) for s in common]
            by_step.plot(common, mean, color=colors[system], lw=2.2, label=f"{system} (mean of {len(mine)})")
            by_time.plot(wall, mean, color=colors[system], lw=2.2, label=f"{system} (mean of {len(mine)})")
    for ax, xlabel in ((by_step, "optimizer step"), (by_time, "wall seconds since the first step")):
        line = target if relative is None else relative
        ax.axhline(line, color="black", ls="--", lw=1, label=f"target {'+' if relative is not None else ''}{line:.2f}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_step.set_ylabel("held-out reward" if relative is None else "held-out reward gain over the run's start")
    by_time.legend(loc="lower right", fontsize=8)
    fig.suptitle("on-policy distillation vs GRPO from the same student (examples/distill_cpu.yaml)")
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--target", type=float, help="held-out reward to reach; default: median step-0 reward + --margin")
    p.add_argument("--margin", type=float, default=0.2, help="the default target's margin over the start")
    p.add_argument(
        "--relative", action="store_true", help="each run's target is its own start + --margin (starts differ by seed)"
    )
    p.add_argument("--teacher-dir", type=Path, default=ROOT / "runs" / "distill_teacher")
    p.add_argument("--teacher-sft-steps", type=int, default=2000, help="the teacher's supervised steps when built")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-distillation")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="the longest one run may take (seconds)")
    p.add_argument("--reduced", action="store_true", help="CI: seed 0, grpo and topk_grpo, a few steps")
    p.add_argument(
        "--summarize", type=Path, metavar="CSV", help="no runs: the table, ratios and figure of an earlier CSV"
    )
    args = p.parse_args(argv)
    if args.reduced:
        args.seeds, args.systems = [0], ["grpo", "topk_grpo"]
        args.set = REDUCED_SET + args.set
        args.teacher_sft_steps = REDUCED_TEACHER_SFT_STEPS
        args.timeout_s = min(args.timeout_s, 600.0)
        if args.teacher_dir == ROOT / "runs" / "distill_teacher":
            args.teacher_dir = args.out / "teacher"
    return args


def read_csv(path: Path) -> list[Run]:
    """The runs of a CSV `write_csv` wrote (exit codes unknown: 0)."""
    runs: dict[tuple[str, int], Run] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            key = (row["system"], int(row["seed"]))
            run = runs.setdefault(key, Run(*key, exit_code=0))
            run.points.append((int(row["step"]), float(row["wall_s"]), float(row["heldout_reward"])))
    return list(runs.values())


def report(runs: list[Run], systems: list[str], args: argparse.Namespace) -> None:
    """Print the table and ratios at the target (`--target`, else the median start + `--margin`); write the figure
    (and, unless summarizing a CSV, the CSV) into `args.out`."""
    starts = [r.points[0][2] for r in runs if r.points]
    target = args.target if args.target is not None else statistics.median(starts) + args.margin
    lines, medians = summary(runs, systems, target, args.margin if args.relative else None)
    lines += ratio_lines(medians, systems)
    print("\n".join(lines), flush=True)
    if args.summarize is None:
        write_csv(runs, args.out / "distillation.csv")
    plot(runs, systems, target, args.out / "distillation.png", args.margin if args.relative else None)
    print(f"wrote {args.out / 'distillation.csv'} and {args.out / 'distillation.png'}", flush=True)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the benchmark as Ctrl-C does: the `finally` blocks stop the child run (and its vLLM) and the
    teacher server, so nothing is left running."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the systems x seeds, print the table and ratios, write the CSV and figure. Exits 1 when a run failed."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize is not None:
        runs = read_csv(args.summarize)
        report(runs, [s for s in SYSTEMS if any(r.system == s for r in runs)], args)
        return 0
    build_teacher(args.teacher_dir, args.teacher_sft_steps, args.timeout_s)
    server = start_teacher(args.teacher_dir, args.out, args.set) if set(args.systems) & set(DISTILLING) else None
    runs: list[Run] = []
    try:
        for seed in args.seeds:
            for system in args.systems:
                t0 = time.monotonic()
                run = run_one(system, seed, f"{server.url}/v1" if server else "", args, args.out)
                runs.append(run)
                last = run.points[-1] if run.points else None
                print(
                    f"{system} seed {seed}: {len(run.points)} evaluations, start "
                    f"{run.points[0][2] if run.points else float('nan'):.3f}, final "
                    f"{last[2] if last else float('nan'):.3f} at step {last[0] if last else '-'} "
                    f"({last[1] if last else float('nan'):.0f} s), drops {run.drops} "
                    f"[{time.monotonic() - t0:.0f} s with start-up]",
                    flush=True,
                )
    finally:
        if server is not None:
            server.close()
    report(runs, args.systems, args)
    return 0 if all(r.exit_code == 0 and r.points for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
