"""Wall-clock seconds until the held-out reward first reaches a target, after the same warm start for every system.

Users buy time until the model is good, not seconds per step. On a workload (`--workload`: a run config every
system mirrors, and the model it starts from) this measures, per system and seed, how many seconds of training it
takes for the held-out reward to first reach `--target`:

- `demo`: examples/tiny_cpu.yaml (the 0.5M-parameter tiny byte-level model, `builtin:reverse`, its reward functions
  and weights, G=8 completions of up to 12 tokens at temperature 1, dapo, beta 0, epsilon 0.2 / 0.28, learning rate
  3e-4 constant, 128 completions per optimizer step, float32, one torch thread). Its step is bound by vLLM's one core,
  so every system ties there (docs/performance.md).
- `add18m`: benchmarks/time_to_reward_add.yaml on the 18M-parameter Qwen2 of `benchmarks/vs_trl.py` (hidden 512, 8
  layers, 16 heads, 4 KV heads, intermediate 1024, the tiny tokenizer), built here with seed 0: `builtin:add`, 64
  completions of up to 8 tokens per step, the trainer on both cores. The trainer is most of a step there.

The systems:

- `ours_async`: async-grpo as the workload's config runs it (max_staleness 2, a real vLLM CPU server beside the trainer);
- `ours_on_policy`: the same with max_staleness 0 (the trainer waits for each step's rollouts);
- `trl_grpo`: TRL 1.16's synchronous `trl.GRPOTrainer` (use_vllm=False: generation with transformers on the CPU),
  with the same model, prompts (the task's train split for the seed), G, max_completion_length, temperature, loss,
  beta, epsilon / epsilon_high, learning rate and scheduler, completions per optimizer step (per_device 64 x
  gradient_accumulation 2: one generation of 16 prompts x 8 per step), reward functions and weights, float32
  (bf16=False), gradient checkpointing off (async-grpo's default; TRL's default is on) and torch threads;
- `trl_async`: TRL's `AsyncGRPOTrainer`, run through `benchmarks/trl_async_cpu.py` (its CPU seams: weight pushes
  through our gloo backend into a real vLLM CPU server, an SDPA stand-in for its FA3 tree attention). Skipped with a
  message when that file does not import, or lacks the names `run_trl_async` uses.

The same warm start for everyone: the workload's model gets the runner's own supervised warm start
(`runner.builders.warm_start`: the config's `warmup_sft_steps` at `warmup_sft_learning_rate`) ONCE, in this process,
and is saved as a Hugging Face folder; every run starts from that folder with `warmup_sft_steps=0`.

Timing. Each run is a child process with a wall-clock budget (`--budget-s`) counted from its training start
(async-grpo: the MLflow timestamp of its step-0 held-out reward, logged right before the orchestrator starts, on one
held-out prompt, so vLLM's start-up and that tiny evaluation are outside; TRL: `on_train_begin`, after the model
load; for `trl_async` its rollout worker's start-up, which TRL runs inside `train()`, is therefore inside the
budget). Checkpoints are written during the run and scored afterwards, never inside a timed run:

- async-grpo: its own resumable checkpoints (`save_steps`, `<output_dir>/checkpoint-<step>/model/`); a checkpoint's
  time is the MLflow timestamp of its step's metrics (logged after the step's weight push, before its checkpoint) minus
  the run's start, minus the seconds of every checkpoint written before it (`checkpoint/seconds`). The run is stopped by
  SIGTERM once its time passes the budget (it ends the step and writes a last checkpoint: `checkpoint_on_signal`).
- TRL: a `TrainerCallback` saves the model at the first step end after each multiple of `--checkpoint-every-s` and at
  the budget (then stops training), and records the same time: seconds since `on_train_begin` minus the seconds of
  the earlier saves.

So the reported seconds exclude checkpoint saving itself for both. async-grpo saves every `--ours-save-steps` steps
(a tiny model: a few hundredths of a second each); of those, the first at or after each multiple of
`--checkpoint-every-s` is scored, the same wall-clock grid TRL's callback saves on.

Scoring. One vLLM CPU server (`build_server_command` / `server_env`, as a run's) starts on the warm-started model;
each checkpoint is loaded and pushed into it with `WeightPusher` (gloo), and `evaluation.evaluate_reward` scores it
with the run's own rollout and reward functions on the task's held-out split: `--eval-prompts` prompts (the config's
`eval_num_prompts`) x `--eval-generations` samples (its `num_generations_eval`) at the training temperature, the same
per-prompt seeds for every checkpoint. The warm start itself is scored the same way (time 0).

Target: `--target`, else the warm start's held-out reward + `--margin` (the workload's default). The demo's 0.04
comes from a pilot
on 2026-11-28 (seeds 0-2, 70 s budgets, 5 s grid, ours_async with --ours-set vllm_sync_interval=2, and trl_grpo):
from today's warm start of 0.880, every run of both systems was above +0.05 after 70 s and below +0.07, and all six
first reached +0.04 within 20-55 s; a target at +0.04 is reached by every run well inside the budget. The margin was
then fixed and measured on new seeds (3-5; docs/performance.md). The earlier default, 0.07, was set on a warm start
of 1.312 that the demo no longer produces.
The default budget (100 s) and grid (5 s) make the default invocation (3 systems x 3 seeds) take about 30 minutes on
2 cores: an async-grpo run costs its budget + about 40 s (vLLM start-up, stop), a TRL run its budget + about 12 s,
the warm start about 100 s, scoring about 2.5 s per checkpoint.

Prints per system the median and range (min-max) over seeds of the time to target ("not reached (> budget)" for a
run that never reached it), and the ratios our default / the faster TRL trainer and our default / our on-policy;
writes `time_to_reward.csv` (system, seed, wall_s, step, heldout_reward) and `time_to_reward.png` (held-out reward
against seconds, one line per system and seed, the target as a horizontal line) into `--out`.

    .venv/bin/python benchmarks/time_to_reward.py [--workload demo|add18m] [--seeds 0 1 2] [--budget-s S]
        [--checkpoint-every-s S]
        [--systems ours_async ours_on_policy trl_grpo [trl_async]] [--target R | --margin M] [--out DIR]
        [--warm-start DIR] [--reduced]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
VS_TRL_DIMS = dict(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=1024)
TRL_ASYNC_ADAPTER = ROOT / "benchmarks" / "trl_async_cpu.py"
SYSTEMS = ("ours_async", "ours_on_policy", "trl_grpo", "trl_async")
DEFAULT_SYSTEMS = SYSTEMS  # trl_async is skipped, with the reason, when its CPU adapter does not load
OURS_STALENESS = {"ours_async": 2, "ours_on_policy": 0}
TRL_SYSTEMS = ("trl_grpo", "trl_async")
UNBOUNDED_STEPS = 1_000_000  # max_steps of a run the budget stops (the demo's schedule is constant)
SETUP_TIMEOUT_S = 600.0  # a run's start-up (model load, vLLM start) before its training must have begun
STOP_TIMEOUT_S = 120.0  # a stopped run's exit (last step, last checkpoint, cleanup)
POLL_S = 0.5  # how often the parent reads a running async-grpo run's MLflow store


@dataclass(frozen=True)
class Checkpoint:
    """One saved model of one run.

    Attributes:
        step: optimizer steps trained.
        wall_s: seconds since the run's training start, checkpoint saving excluded.
        path: the Hugging Face model folder.
    """

    step: int
    wall_s: float
    path: str


@dataclass(frozen=True)
class Workload:
    """What every system trains in one invocation.

    Attributes:
        name: the `--workload` name.
        config: the run config (YAML) async-grpo runs and the TRL systems mirror (model, task, rewards, batch, loss,
            optimizer, threads).
        model_dims: `tiny_model.build_tiny_model` dimensions of the model to build (seed 0) and warm-start; None: the
            config's own `builtin:tiny`.
        title: the figure's title.
        budget_s, checkpoint_every_s, margin, ours_save_steps: the defaults of `--budget-s`, `--checkpoint-every-s`,
            `--margin` and `--ours-save-steps` (a checkpoint of the 18M model and its optimizer takes 0.3-2 s to
            write: excluded from the times, but not from the benchmark's own wall time).
        overrides: `key=value` overrides of `config` for every system (`--set`: a learning-rate sweep, say).
    """

    name: str
    config: Path
    model_dims: dict[str, int] | None
    title: str
    budget_s: float
    checkpoint_every_s: float
    margin: float
    ours_save_steps: int
    overrides: tuple[str, ...] = ()


WORKLOADS = {
    "demo": Workload(
        "demo", DEMO_CONFIG, None, "tiny_cpu.yaml's reverse task (the 0.5M-parameter tiny model)", 100.0, 5.0, 0.04, 2
    ),
    "add18m": Workload(
        "add18m",
        ROOT / "benchmarks" / "time_to_reward_add.yaml",
        VS_TRL_DIMS,
        "builtin:add on the 18M-parameter Qwen2 of vs_trl.py",
        900.0,
        60.0,
        0.10,
        5,
    ),  # fmt: skip
}


# ---------------------------------------------------------------------------------------------------------- config
def workload_config(workload: Workload, overrides: list[str] | None = None):
    """The workload's run config as a `GRPOConfig`: its YAML, its `overrides`, then `overrides` (`key=value`, the
    CLI's syntax).

    Raises:
        ConfigError: an override names no field or fails validation.
    """
    from async_grpo.config.io import load_config

    return load_config(workload.config, [*workload.overrides, *(overrides or [])])


def make_warm_start(
    out: Path, workload: Workload, sft_steps: int | None = None, sft_learning_rate: float | None = None
) -> tuple[Path, dict[str, float]]:
    """The workload's model after the runner's supervised warm start, saved once as a Hugging Face folder
    `out/model`.

    Exactly what `GRPORecipe.setup` does before GRPO on the workload's config
    (`runner.warm_model.save_warm_started_model`: the model loaded in float32, `torch.manual_seed(seed)`, then
    `builders.warm_start` on the task's reference answers on the config's torch threads), from `builtin:tiny` built
    with the config's seed, or from the workload's `model_dims` built under `out/base-model` with seed 0.

    Args:
        out: a folder; the result goes to `out/model`.
        workload: the config and model to warm-start.
        sft_steps, sft_learning_rate: warm-start steps and learning rate instead of the config's.

    Returns:
        (model folder, metrics): the `warmup/*` metrics of `builders.warm_start` plus `warmup/seconds`.
    """
    from async_grpo.runner.warm_model import save_warm_started_model
    from async_grpo.tiny_model import build_tiny_model

    overrides = [f"output_dir={out / 'base'}"]
    if workload.model_dims is not None:
        base = build_tiny_model(out / "base-model", seed=0, **workload.model_dims)
        overrides.append(f"model_name_or_path={base}")
    if sft_steps is not None:
        overrides.append(f"warmup_sft_steps={sft_steps}")
    if sft_learning_rate is not None:
        overrides.append(f"warmup_sft_learning_rate={sft_learning_rate}")
    return save_warm_started_model(workload_config(workload, overrides), out / "model")


# ---------------------------------------------------------------------------------------------------------- processes
class Child:
    """A child process of this benchmark, in its own session, stopped by PID (its descendants too, by PID).

    Args:
        command: the command line.
        log: file receiving its stdout and stderr.
        env: its environment.
    """

    def __init__(self, command: list[str], log: Path, env: dict[str, str]):
        import psutil

        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.log = log
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        self._psutil = psutil
        self._descendants: dict[int, Any] = {}

    def remember_descendants(self) -> None:
        """Record the PIDs the child spawned so far (vLLM, reward workers), so `stop` can end exactly those."""
        try:
            for p in self._psutil.Process(self.process.pid).children(recursive=True):
                self._descendants.setdefault(p.pid, p)
        except self._psutil.NoSuchProcess:
            pass

    def signal(self, signum: int) -> None:
        """Send `signum` to the child (not its descendants) if it still runs."""
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` seconds for the child's exit; its exit code, or None if it still runs."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the child, wait `grace_s` seconds, SIGKILL it, then SIGKILL every recorded descendant still
        alive. Returns its exit code (None if it had to be killed and did not report one)."""
        self.remember_descendants()
        code = self.process.poll()
        if code is None:
            self.signal(signal.SIGTERM)
            code = self.wait(grace_s)
            if code is None:
                self.process.kill()
                code = self.wait(grace_s)
        alive = [p for p in self._descendants.values() if p.is_running()]
        for p in alive:
            try:
                p.kill()
            except self._psutil.NoSuchProcess:
                pass
        self._psutil.wait_procs(alive, timeout=grace_s)
        self._log.close()
        return code

    def tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the child's log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def child_env(threads: int | None = None) -> dict[str, str]:
    """This environment for a child run: no hub access, this checkout's `src` first on PYTHONPATH; with `threads`,
    OMP_NUM_THREADS (TRL: the trainer's threads)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# ---------------------------------------------------------------------------------------------------------- ours
def metric_history(db: Path, key: str) -> list[tuple[int, float, float]]:
    """(step, timestamp s, value) of metric `key` in the one run of an MLflow sqlite store, read-only (never creates
    or migrates the store the child is writing); [] while the store or its table does not exist yet."""
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute("SELECT step, timestamp, value FROM metrics WHERE key = ?", (key,)).fetchall()
    except sqlite3.Error:
        return []
    return sorted((int(s), t / 1000.0, float(v)) for s, t, v in rows)


def run_ours(system: str, seed: int, model: Path, args: argparse.Namespace, out: Path) -> list[Checkpoint]:
    """One async-grpo run (`async-grpo train <the workload's config> ...` in a child process) from the warm-started
    `model`, stopped by SIGTERM once `args.budget_s` seconds of training (checkpoint saving excluded) have passed.

    Overrides of the workload's config: the model folder, no warm start, max_staleness (`OURS_STALENESS[system]`), seed, no
    periodic held-out evaluation (the step-0 one on one prompt marks the training start), a checkpoint every
    `args.ours_save_steps` steps, no final model, max_steps unbounded (the schedule is constant), `args.threads`
    torch threads when given.

    Returns:
        Every checkpoint the run wrote, by step, with its training time (see the module docstring).

    Raises:
        RuntimeError: the run failed or never started training within SETUP_TIMEOUT_S (the log tail is included).
    """
    out.mkdir(parents=True, exist_ok=True)
    db = out / "mlflow.db"
    overrides = [
        f"model_name_or_path={model}", "warmup_sft_steps=0", f"max_staleness={OURS_STALENESS[system]}",
        f"seed={seed}", "eval_strategy='no'", "eval_num_prompts=1", "num_generations_eval=1",
        f"save_steps={args.ours_save_steps}", "save_model=false", f"max_steps={UNBOUNDED_STEPS}",
        f"output_dir={out}", f"mlflow_tracking_uri=sqlite:///{db}", "checkpoint_on_signal=true",
    ]  # fmt: skip
    if args.threads:
        overrides.append(f"torch_num_threads={args.threads}")
    overrides += args.ours_set
    command = [sys.executable, "-m", "async_grpo.cli", "train", str(args.workload.config), *args.workload.overrides]
    command += overrides
    child = Child(command, out / "run.log", child_env())
    started = time.time()
    t0: float | None = None
    stopped = False
    try:
        while child.process.poll() is None:
            time.sleep(POLL_S)
            child.remember_descendants()
            if t0 is None:
                start = metric_history(db, "eval/reward")
                if start:
                    t0 = start[0][1]
                elif time.time() - started > SETUP_TIMEOUT_S:
                    raise RuntimeError(f"{system} seed {seed}: no training start within {SETUP_TIMEOUT_S:.0f} s")
                continue
            saved = sum(v for _, _, v in metric_history(db, "checkpoint/seconds"))
            if time.time() - t0 - saved >= args.budget_s:
                child.signal(signal.SIGTERM)  # the step ends, a last checkpoint is written, every process stops
                stopped = True
                break
        code = child.wait(STOP_TIMEOUT_S)
    finally:
        final = child.stop()
    code = final if code is None else code
    if not stopped or t0 is None or code not in (0, 130):
        raise RuntimeError(f"{system} seed {seed} ended with exit code {code} (stopped: {stopped}):\n{child.tail()}")
    return ours_checkpoints(out, t0)


def ours_checkpoints(out: Path, t0: float) -> list[Checkpoint]:
    """The checkpoints of the async-grpo run in `out` with their training times: the timestamp of each step's
    `loss` (logged after the step's push, before its periodic checkpoint) - `t0` - the `checkpoint/seconds` logged
    before it.

    Raises:
        RuntimeError: a checkpoint's step has no logged metrics.
    """
    from async_grpo.checkpoint_layout import MODEL_DIR, complete_checkpoints

    db = out / "mlflow.db"
    stamps = {step: t for step, t, _ in metric_history(db, "loss")}
    saves = [(t, v) for _, t, v in metric_history(db, "checkpoint/seconds")]
    found = []
    for step, path in complete_checkpoints(out):
        if step not in stamps:
            raise RuntimeError(f"{path}: step {step} has no `loss` in {db}")
        saved = sum(v for t, v in saves if t <= stamps[step])
        found.append(Checkpoint(step, stamps[step] - t0 - saved, str(path / MODEL_DIR)))
    return found


# ---------------------------------------------------------------------------------------------------------- TRL
def trl_spec(system: str, seed: int, model: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """What a TRL child run needs (JSON): the workload config's values TRL takes, the budget and the checkpoint
    grid."""
    config = workload_config(args.workload)
    o, b, c, s, loss = config.optim, config.batch, config.compute, config.sampling, config.loss
    return {
        "config": str(args.workload.config), "config_overrides": list(args.workload.overrides), "system": system, "seed": seed, "model": str(model), "out": str(out), "budget_s": args.budget_s,
        "checkpoint_every_s": args.checkpoint_every_s, "dataset": config.data.dataset,
        "reward_funcs": list(config.rewards.reward_funcs), "reward_weights": list(config.rewards.reward_weights),
        "threads": args.threads or c.torch_num_threads, "num_generations": s.num_generations,
        "max_completion_length": s.max_completion_length, "temperature": s.temperature, "top_p": s.top_p,
        "per_device_train_batch_size": b.per_device_train_batch_size,
        "gradient_accumulation_steps": b.gradient_accumulation_steps, "learning_rate": o.learning_rate,
        "lr_scheduler_type": o.lr_scheduler_type, "loss_type": loss.loss_type, "beta": loss.beta,
        "epsilon": loss.epsilon, "epsilon_high": config.epsilon_high_value,
        "scale_rewards": config.rewards.scale_rewards,
        "max_grad_norm": o.max_grad_norm, "weight_decay": o.weight_decay, "adam_beta1": o.adam_beta1,
        "adam_beta2": o.adam_beta2, "adam_epsilon": o.adam_epsilon,
        "gradient_checkpointing": c.gradient_checkpointing, "max_staleness": 2,
    }  # fmt: skip


def run_trl(system: str, seed: int, model: Path, args: argparse.Namespace, out: Path) -> list[Checkpoint]:
    """One TRL run (`trl_child` in a child process) from the warm-started `model`; its callback stops it at the
    budget. A child that outlives the budget by SETUP_TIMEOUT_S is stopped.

    Returns:
        The checkpoints its callback saved, with their training times.

    Raises:
        RuntimeError: the run failed (the log tail is included).
    """
    out.mkdir(parents=True, exist_ok=True)
    spec = trl_spec(system, seed, model, args, out)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    command = [sys.executable, str(Path(__file__).resolve()), "--child-trl", str(out / "spec.json")]
    child = Child(command, out / "run.log", child_env(spec["threads"]))
    try:
        deadline = time.monotonic() + args.budget_s + SETUP_TIMEOUT_S
        code = None
        while code is None and time.monotonic() < deadline:
            child.remember_descendants()
            code = child.wait(5.0)
    finally:
        final = child.stop()
    code = final if code is None else code
    if code != 0:
        raise RuntimeError(f"{system} seed {seed} ended with exit code {code}:\n{child.tail()}")
    rows = [json.loads(line) for line in (out / "checkpoints.jsonl").read_text().splitlines()]
    return [Checkpoint(r["step"], r["wall_s"], r["path"]) for r in rows]


def wall_clock_checkpoints(out: Path, every_s: float, budget_s: float):
    """A transformers `TrainerCallback` that saves the model (HF folder `out/ckpt-<step>`) at the first step end
    after each multiple of `every_s` seconds of training and at `budget_s` (then stops training), and appends
    {step, wall_s, path, save_s} to `out/checkpoints.jsonl`; wall_s counts from `on_train_begin` with the earlier
    saves' seconds taken out."""
    from transformers import TrainerCallback

    class WallClockCheckpoints(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.saved_s = 0.0
            self.next_s = every_s

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            wall = time.perf_counter() - self.t0 - self.saved_s
            if wall < self.next_s and wall < budget_s:
                return control
            while self.next_s <= wall:
                self.next_s += every_s
            t_save = time.perf_counter()
            path = out / f"ckpt-{state.global_step}"
            model.save_pretrained(path)
            if processing_class is not None:
                processing_class.save_pretrained(path)
            save_s = time.perf_counter() - t_save
            self.saved_s += save_s
            row = {"step": state.global_step, "wall_s": wall, "path": str(path), "save_s": save_s}
            with open(out / "checkpoints.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if wall >= budget_s:
                control.should_training_stop = True
            return control

    return WallClockCheckpoints()


def trl_child(spec_path: Path) -> None:
    """The child side of `run_trl`: TRL 1.16's `GRPOTrainer` (`trl_grpo`) or the `trl_async` hook on the spec's
    workload, with `wall_clock_checkpoints`.

    Raises:
        ValueError: unknown system in the spec.
    """
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    if spec["system"] == "trl_grpo":
        run_trl_grpo(spec)
    elif spec["system"] == "trl_async":
        run_trl_async(spec)
    else:
        raise ValueError(f"unknown TRL system {spec['system']!r}")


def trl_common(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig / AsyncGRPOConfig arguments both TRL trainers share, from a `trl_spec`."""
    return dict(
        output_dir=spec["out"], per_device_train_batch_size=spec["per_device_train_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"], temperature=spec["temperature"],
        learning_rate=spec["learning_rate"], lr_scheduler_type=spec["lr_scheduler_type"],
        max_grad_norm=spec["max_grad_norm"], weight_decay=spec["weight_decay"], adam_beta1=spec["adam_beta1"],
        adam_beta2=spec["adam_beta2"], adam_epsilon=spec["adam_epsilon"], max_steps=UNBOUNDED_STEPS,
        logging_steps=10, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=spec["seed"],
        gradient_checkpointing=spec["gradient_checkpointing"], top_p=spec["top_p"], epsilon=spec["epsilon"],
        epsilon_high=spec["epsilon_high"], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def trl_workload(spec: dict[str, Any]) -> tuple[Any, list[Any]]:
    """(train dataset, reward functions) of a `trl_spec`: the task's train split for the seed, exactly as
    async-grpo loads it (`data.load_prompt_dataset`), and the reward specs resolved to their functions."""
    from async_grpo.data import load_prompt_dataset
    from async_grpo.rewards.loading import resolve_reward_func

    dataset = load_prompt_dataset(spec["dataset"], split="train", seed=spec["seed"])
    return dataset, [resolve_reward_func(f) for f in spec["reward_funcs"]]


def run_trl_grpo(spec: dict[str, Any]) -> None:
    """TRL's synchronous `GRPOTrainer` (use_vllm=False) on a `trl_spec`, until its budget."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    dataset, reward_funcs = trl_workload(spec)
    config = GRPOConfig(
        **trl_common(spec), use_vllm=False, loss_type=spec["loss_type"], beta=spec["beta"],
        scale_rewards=spec["scale_rewards"], reward_weights=spec["reward_weights"],
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32),
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        callbacks=[wall_clock_checkpoints(Path(spec["out"]), spec["checkpoint_every_s"], spec["budget_s"])],
    )
    trainer.train()


class WeightedReward:
    """One TRL reward function: the weighted sum of several (for a trainer without `reward_weights`: TRL's
    AsyncGRPOConfig has none). Under sum_then_normalize the advantages are those of the weighted functions.
    Picklable (TRL's async rollout worker is a spawned process) when the functions are module-level.

    Args:
        funcs: (F,) reward functions with TRL's signature.
        weights: (F,) their weights.
    """

    def __init__(self, funcs: list[Any], weights: list[float]):
        self.funcs, self.weights = list(funcs), list(weights)
        self.__name__ = "+".join(f"{w:g}*{f.__name__}" for f, w in zip(funcs, weights, strict=True))

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        """(G,) sum over functions of weight x reward; a None (not applicable) reward counts 0, as TRL's nansum."""
        total = [0.0] * len(completions)
        for func, weight in zip(self.funcs, self.weights, strict=True):
            for i, r in enumerate(func(prompts=prompts, completions=completions, **kwargs)):
                total[i] += 0.0 if r is None else weight * r
        return total


# HOOK (trl_async): the names `run_trl_async` takes from benchmarks/trl_async_cpu.py (another branch builds it).
TRL_ASYNC_NAMES = ("CPUAsyncGRPOTrainer", "GlooWeightTransfer", "verbatim_chat_tokenizer", "as_conversational")


def load_trl_async_adapter() -> tuple[Any | None, str]:
    """benchmarks/trl_async_cpu.py as a module, or (None, why not): missing, failing to import, or lacking one of
    `TRL_ASYNC_NAMES`."""
    if not TRL_ASYNC_ADAPTER.is_file():
        return None, f"{TRL_ASYNC_ADAPTER.relative_to(ROOT)} does not exist"
    spec = importlib.util.spec_from_file_location("trl_async_cpu", TRL_ASYNC_ADAPTER)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # any import failure means: skip the system
        return None, f"{TRL_ASYNC_ADAPTER.relative_to(ROOT)} failed to import: {err!r}"
    missing = [name for name in TRL_ASYNC_NAMES if not hasattr(module, name)]
    if missing:
        return None, f"{TRL_ASYNC_ADAPTER.relative_to(ROOT)} lacks {', '.join(missing)}"
    return module, ""


def run_trl_async(spec: dict[str, Any]) -> None:
    """HOOK: TRL's `AsyncGRPOTrainer` on a `trl_spec` through benchmarks/trl_async_cpu.py's CPU adapter, beside a
    vLLM CPU server started by our launcher (float32, the workload's max-model-len, seed 0), max_staleness 2, a weight
    push after every step, until its budget. The prompts become one user message each, rendered verbatim
    (the adapter's `as_conversational` / `verbatim_chat_tokenizer`), so the model sees the same prompt tokens.

    Raises:
        RuntimeError: the adapter is unavailable (`load_trl_async_adapter`).
        VLLMStartupError: the server did not come up.
    """
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from async_grpo.config.io import load_config
    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env

    adapter, why = load_trl_async_adapter()
    if adapter is None:
        raise RuntimeError(why)
    config = load_config(spec["config"], spec["config_overrides"])
    dataset, reward_funcs = trl_workload(spec)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = build_server_command(
        spec["model"], port=port, dtype="float32", max_model_len=config.inference.vllm_max_model_len, seed=0
    )
    server = VLLMServer(command, server_env(1), Path(spec["out"]) / "vllm.log", url, 400.0)
    trl_config = AsyncGRPOConfig(
        **trl_common(spec), token_budget=0, dtype="float32", vllm_server_base_url=url,
        max_staleness=spec["max_staleness"], weight_sync_steps=1,
        max_inflight_tasks=spec["per_device_train_batch_size"] * spec["gradient_accumulation_steps"],
        vllm_server_timeout=400.0,
    )  # fmt: skip
    try:
        server.launch()
        trainer = adapter.CPUAsyncGRPOTrainer(
            model=spec["model"],
            reward_funcs=[WeightedReward(reward_funcs, spec["reward_weights"])],
            args=trl_config,
            train_dataset=adapter.as_conversational(dataset),
            processing_class=adapter.verbatim_chat_tokenizer(Path(spec["model"])),
            callbacks=[wall_clock_checkpoints(Path(spec["out"]), spec["checkpoint_every_s"], spec["budget_s"])],
            weight_transfer=adapter.GlooWeightTransfer(url),
        )
        if hasattr(adapter, "StopRolloutsAtEnd"):
            trainer.add_callback(adapter.StopRolloutsAtEnd(trainer))
        server.wait_until_healthy()
        trainer.train()
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------------- scoring
class CheckpointScorer:
    """Held-out reward of model folders on one vLLM CPU server: each folder's weights are pushed into the server
    (`WeightPusher`, gloo) and scored by `evaluation.evaluate_reward` with the run's rollout and reward functions.

    Args:
        base: the warm-started model folder (the server starts on it; every checkpoint has its shapes).
        workload: the workload (its config: task, rewards, sampling, server flags).
        num_prompts: held-out prompts (the task's eval split, in order).
        num_generations: samples per prompt, at the training temperature.
        log_dir: where the server's log goes.
    Use as a context manager; `score(folder)` returns the held-out reward (weighted sum, mean over completions).
    """

    def __init__(self, base: Path, workload: Workload, num_prompts: int, num_generations: int, log_dir: Path):
        self.config = workload_config(
            workload,
            [
                f"model_name_or_path={base}",
                f"eval_num_prompts={num_prompts}",
                f"num_generations_eval={num_generations}",
            ],
        )
        self.base = base
        self.log_dir = log_dir
        self.version = 0
        self.server = self.pusher = self.pool = self.rollout = None

    def __enter__(self) -> CheckpointScorer:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from async_grpo.data import load_prompt_items
        from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
        from async_grpo.rewards.pool import RewardPool
        from async_grpo.runner.builders import build_rollout, dataset_options
        from async_grpo.transports.weights.sync import WeightPusher

        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(self.base)
        self.items, _ = load_prompt_items(
            tokenizer, config.data.dataset, "eval", seed=config.seed, max_prompt_length=config.data.max_prompt_length,
            limit=config.data.eval_num_prompts, **dataset_options(config, "eval"),
        )  # fmt: skip
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = build_server_command(
            str(self.base), port=port, dtype=config.inference.vllm_dtype,
            max_model_len=config.inference.vllm_max_model_len, weight_transfer_backend="gloo", seed=config.seed,
        )  # fmt: skip
        self.server = VLLMServer(
            command, server_env(config.inference.vllm_kv_cache_gib), self.log_dir / "vllm-score.log", self.url, 600.0
        )
        try:
            self.server.launch()
            self.pool = RewardPool.from_config(config)
            self.rollout = build_rollout(
                config, self.pool, tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), self.items
            )
            self.model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            self.server.wait_until_healthy()
            self.pusher = WeightPusher(self.model, self.url, backend="gloo")
            self.pusher.setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def score(self, folder: str | Path) -> float:
        """The held-out reward of the model in `folder` (a Hugging Face folder of the base model's architecture).

        Raises:
            EvaluationError: every held-out group failed.
        """
        import torch
        from transformers import AutoModelForCausalLM

        from async_grpo.evaluation import evaluate_reward
        from async_grpo.inference.client import AsyncVLLMClient
        from async_grpo.runner.builders import sampling_settings

        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict())
        self.version += 1
        self.pusher.push(self.version)
        config = self.config
        metrics, _ = evaluate_reward(
            self.rollout, lambda: AsyncVLLMClient(self.url, str(self.base), timeout_s=120.0), self.items,
            sampling_settings(config, evaluation=True), reward_names=self.pool.names,
            reward_weights=self.pool.weights, seed=config.seed, version=self.version,
        )  # fmt: skip
        return metrics["eval/reward"]

    def __exit__(self, *exc: Any) -> None:
        for close in (
            lambda: self.pusher and self.pusher.close(),
            lambda: self.pool and self.pool.close(),
            lambda: self.rollout and hasattr(self.rollout, "close") and self.rollout.close(),
            lambda: self.server and self.server.close(),
        ):
            try:
                close()
            except Exception as err:  # keep closing the rest
                print(f"warning: scorer cleanup: {err!r}", file=sys.stderr)


def on_grid(checkpoints: list[Checkpoint], every_s: float, budget_s: float) -> list[Checkpoint]:
    """The checkpoints to score: the first at or after each multiple of `every_s` seconds, up to the first at or
    after `budget_s` (TRL's callback saves exactly those; async-grpo saves more often), and the last one when none
    reached `budget_s` (the run's end), in time order."""
    chosen: list[Checkpoint] = []
    mark = every_s
    ordered = sorted(checkpoints, key=lambda c: c.wall_s)
    for c in ordered:
        if c.wall_s >= mark or c.wall_s >= budget_s:
            chosen.append(c)
            while mark <= c.wall_s:
                mark += every_s
            if c.wall_s >= budget_s:
                break
    if ordered and ordered[-1].wall_s < budget_s and (not chosen or chosen[-1] is not ordered[-1]):
        # the run's last checkpoint (written at the stop signal) ended a step that began before the budget and
        # stamped its metrics just under it: it is the run's end, so it is scored too
        chosen.append(ordered[-1])
    return chosen


def prune(saved: list[Checkpoint], kept: list[Checkpoint]) -> None:
    """Delete the folders of `saved` checkpoints that are not `kept` (async-grpo's `checkpoint-<step>` folders off
    the scoring grid: the model folder's parent, which holds the optimizer state)."""
    import shutil

    keep = {c.path for c in kept}
    for c in saved:
        if c.path not in keep:
            folder = Path(c.path)
            shutil.rmtree(folder.parent if folder.parent.name.startswith("checkpoint-") else folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- summary
def time_to_target(points: list[tuple[float, int, float]], target: float) -> float:
    """Seconds at the first (wall_s, step, reward) point, in time order, whose reward reaches `target`; math.inf if
    none (the run's last checkpoint is the one saved at the end of the step that passed its budget)."""
    for wall, _step, reward in sorted(points):
        if reward >= target:
            return wall
    return math.inf


def fmt_s(seconds: float, budget_s: float) -> str:
    """Seconds as text; math.inf as "not reached (> budget)"."""
    return f"{seconds:.1f} s" if math.isfinite(seconds) else f"not reached (> {budget_s:.0f} s)"


def fmt_ratio(num: float, den: float) -> str:
    """num / den as text, or the bound it is known to satisfy when one side was not reached (math.inf)."""
    if math.isfinite(num) and math.isfinite(den):
        return f"{num / den:.2f}x"
    if math.isfinite(num):
        return "< 1 (the denominator never reached the target)"
    if math.isfinite(den):
        return "> 1 (the numerator never reached the target)"
    return "undefined (neither reached the target)"


def plot(rows: list[dict[str, Any]], target: float, path: Path, title: str) -> None:
    """Held-out reward against training seconds, one line per (system, seed), the target as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = dict(zip(SYSTEMS, ("tab:blue", "tab:green", "tab:red", "tab:orange"), strict=True))
    styles = ("-", "--", ":", "-.")
    runs = sorted({(r["system"], r["seed"]) for r in rows})
    for system, seed in runs:
        pts = sorted((r["wall_s"], r["heldout_reward"]) for r in rows if (r["system"], r["seed"]) == (system, seed))
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=colors[system],
            linestyle=styles[seed % len(styles)], label=f"{system} seed {seed}",
        )  # fmt: skip
    ax.axhline(target, color="black", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("training wall-clock seconds (checkpoint saving excluded)")
    ax.set_ylabel("held-out reward")
    ax.set_title(f"time to reward: {title}, same warm start")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(times: dict[str, list[float]], systems: list[str], budget_s: float) -> tuple[list[str], dict[str, float]]:
    """Lines of the per-system summary (median and min-max over seeds) and the ratios; the medians by system.

    Args:
        times: per system, one time to target per seed (math.inf: not reached).
    """
    lines, medians = [], {}
    for system in systems:
        ts = times.get(system)
        if not ts:
            continue
        medians[system] = statistics.median(ts)
        reached = sum(math.isfinite(t) for t in ts)
        lines.append(
            f"{system}: time to target median {fmt_s(medians[system], budget_s)}, range {fmt_s(min(ts), budget_s)}"
            f" - {fmt_s(max(ts), budget_s)} ({reached}/{len(ts)} seeds reached it)"
        )
    ours = medians.get("ours_async")
    trl = [s for s in TRL_SYSTEMS if s in medians]
    if ours is not None and trl:
        fastest = min(trl, key=lambda s: medians[s])
        lines.append(f"ratio our default / {fastest} (median time to target): {fmt_ratio(ours, medians[fastest])}")
    if ours is not None and "ours_on_policy" in medians:
        lines.append(
            f"ratio our default / our on-policy (median time to target): {fmt_ratio(ours, medians['ours_on_policy'])}"
        )
    return lines, medians


# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); `--reduced` fills in the CI sizes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="demo", help="what every system trains")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS))
    p.add_argument("--budget-s", type=float, default=None, help="training seconds per run (default: the workload's)")
    p.add_argument(
        "--checkpoint-every-s", type=float, default=None, help="the scored checkpoints' grid (seconds; the workload's)"
    )
    p.add_argument(
        "--ours-save-steps", type=int, default=None, help="async-grpo's save_steps (scored on the grid; workload's)"
    )
    p.add_argument("--target", type=float, default=None, help="held-out reward to reach (default: warm start + margin)")
    p.add_argument("--margin", type=float, default=None, help="the target's margin over the warm start (workload's)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: eval_num_prompts)")
    p.add_argument("--eval-generations", type=int, default=None, help="samples each (default: num_generations_eval)")
    p.add_argument("--warmup-sft-steps", type=int, default=None, help="warm-start steps (default: the config's)")
    p.add_argument("--warmup-sft-learning-rate", type=float, default=None, help="warm-start rate (the config's)")
    p.add_argument("--warm-start", type=Path, default=None, help="reuse this warm-started model folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads of every trainer (default: config's)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary one)")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        dest="workload_set",
        help="overrides of the workload's config for every system (warm start, ours, TRL, scoring)",
    )
    p.add_argument(
        "--ours-set", nargs="+", default=[], metavar="KEY=VALUE",
        help="further overrides of the workload's config for both async-grpo systems, after the benchmark's own",
    )  # fmt: skip
    p.add_argument(
        "--reduced", action="store_true", help="CI size: 1 seed, ours_async + trl_grpo, short budgets, a 0.5M model"
    )
    p.add_argument("--child-trl", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workload = dataclasses.replace(WORKLOADS[args.workload], overrides=tuple(args.workload_set))
    args.budget_s = args.workload.budget_s if args.budget_s is None else args.budget_s
    args.checkpoint_every_s = args.checkpoint_every_s or args.workload.checkpoint_every_s
    args.margin = args.workload.margin if args.margin is None else args.margin
    args.ours_save_steps = args.ours_save_steps or args.workload.ours_save_steps
    if args.reduced:
        args.seeds, args.budget_s, args.checkpoint_every_s = [args.seeds[0]], 10.0, 5.0
        if args.workload.model_dims is not None:  # the built model at builtin:tiny's size: the plumbing, not the speed
            args.workload = dataclasses.replace(args.workload, model_dims={})
        if args.systems == list(DEFAULT_SYSTEMS):
            args.systems = ["ours_async", "trl_grpo"]
        args.eval_prompts = args.eval_prompts or 16
        args.eval_generations = args.eval_generations or 2
        args.warmup_sft_steps = args.warmup_sft_steps if args.warmup_sft_steps is not None else 100
    config = workload_config(args.workload, args.ours_set)  # a bad --ours-set fails here, before the warm start
    args.eval_prompts = args.eval_prompts or config.data.eval_num_prompts
    args.eval_generations = args.eval_generations or config.data.num_generations_eval
    return args


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the benchmark as Ctrl-C does: the `finally` blocks stop the running child (`Child.stop`: it and
    the descendants it started, by PID) and the scoring server, so nothing is left running."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Warm start once, run every (system, seed) with its budget, score the checkpoints, print and write the
    summary (see the module docstring)."""
    args = parse_args(argv)
    if args.child_trl is not None:
        trl_child(args.child_trl)
        return
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out or Path(tempfile.mkdtemp(prefix="time-to-reward-"))
    out.mkdir(parents=True, exist_ok=True)
    systems = list(dict.fromkeys(args.systems))
    if "trl_async" in systems:
        adapter, why = load_trl_async_adapter()
        if adapter is None:
            print(f"trl_async: skipped: {why}")
            systems.remove("trl_async")
    print(f"workload {args.workload.name}: {args.workload.title} ({args.workload.config.relative_to(ROOT)})")
    if args.warm_start is not None:
        model, warm = args.warm_start, {}
        print(f"warm start: reusing {model}")
    else:
        model, warm = make_warm_start(
            out / "warm-start", args.workload, args.warmup_sft_steps, args.warmup_sft_learning_rate
        )
        print(
            f"warm start: {model} ({warm['warmup/steps']:.0f} SFT steps at lr {warm['warmup/learning_rate']:g} in "
            f"{warm['warmup/seconds']:.0f} s; held-out sequence accuracy "
            f"{warm['warmup/heldout_sequence_accuracy']:.2f})"
        )
    runs: dict[tuple[str, int], list[Checkpoint]] = {}
    for seed in args.seeds:
        for system in systems:
            t0 = time.perf_counter()
            folder = out / "runs" / f"{system}-seed{seed}"
            run = run_ours if system in OURS_STALENESS else run_trl
            saved = run(system, seed, model, args, folder)
            runs[system, seed] = on_grid(saved, args.checkpoint_every_s, args.budget_s)
            prune(saved, runs[system, seed])
            last = runs[system, seed][-1] if runs[system, seed] else None
            print(
                f"ran {system} seed {seed}: {len(runs[system, seed])} checkpoints scored on the grid, last at step "
                f"{last.step if last else 0} ({last.wall_s if last else 0:.1f} s); {time.perf_counter() - t0:.0f} s"
                " with start-up and stop",
                flush=True,
            )
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with CheckpointScorer(model, args.workload, args.eval_prompts, args.eval_generations, out) as scorer:
        warm_reward = scorer.score(model)
        for (system, seed), checkpoints in runs.items():
            rows.append(dict(system=system, seed=seed, wall_s=0.0, step=0, heldout_reward=warm_reward))
            for c in checkpoints:
                rows.append(
                    dict(system=system, seed=seed, wall_s=c.wall_s, step=c.step, heldout_reward=scorer.score(c.path))
                )
    n_scored = len(rows) - len(runs) + 1
    print(f"scored {n_scored} models ({args.eval_prompts} held-out prompts x {args.eval_generations}) in "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    target = args.target if args.target is not None else warm_reward + args.margin
    how = "--target" if args.target is not None else f"warm start {warm_reward:.3f} + margin {args.margin:g}"
    print(f"held-out reward of the warm start: {warm_reward:.3f}; target {target:.3f} ({how}); budget "
          f"{args.budget_s:.0f} s per run; seeds {' '.join(map(str, args.seeds))}")  # fmt: skip
    print(f"times: seconds of training since each run's start (start-up excluded), checkpoint saving excluded, "
          f"checkpoints scored on a {args.checkpoint_every_s:g} s grid")  # fmt: skip
    times: dict[str, list[float]] = {}
    for (system, seed), _ in runs.items():
        points = [
            (r["wall_s"], r["step"], r["heldout_reward"]) for r in rows if (r["system"], r["seed"]) == (system, seed)
        ]
        times.setdefault(system, []).append(time_to_target(points, target))
    lines, _ = summarize(times, systems, args.budget_s)
    for line in lines:
        print(line)
    csv_path, png_path = out / "time_to_reward.csv", out / "time_to_reward.png"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["system", "seed", "wall_s", "step", "heldout_reward"])
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, target, png_path, args.workload.title)
    (out / "summary.json").write_text(
        json.dumps({"workload": args.workload.name, "target": target, "warm_start_reward": warm_reward, "warm": warm,
                    "times": {k: [t if math.isfinite(t) else None for t in v] for k, v in times.items()},
                    "runs": {f"{s}-seed{k}": [asdict(c) for c in v] for (s, k), v in runs.items()}}, indent=1)
    )  # fmt: skip
    print(f"csv: {csv_path}")
    print(f"png: {png_path}")


if __name__ == "__main__":
    main()
