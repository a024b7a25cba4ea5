"""A chaos soak: one CPU run of the demo task with faults injected at seeded steps, against a fault-free run.

The run is `async-grpo train examples/tiny_cpu.yaml` with the local backend (a launched vLLM CPU server, pebble
reward workers, the trainer and its orchestrator), tracked on a real `mlflow server` (HTTP, sqlite backend). The
harness plays the part of Kubernetes: a trainer that dies is started again with the same command
(`resume_from_checkpoint=true`, as the trainer pod's config has), after the processes it left are ended by PID (as a
pod's container runtime would). The run lasts `--minutes` (at least: each fault is settled before the next), and
one fault of each kind is injected, in an order and at times (between 10 % and 70 % of `--minutes` after the first
trained step) drawn from `--seed`:

- `vllm_kill9`: SIGKILL of the vLLM server. Survived when the run logs "vLLM recovered" and trains on.
- `reward_worker_kill9`: SIGKILL of one reward worker process. Survived when the pool runs a new worker and the
  run trains on (a group being scored by it is dropped and counted, never lost).
- `trainer_kill9`: SIGKILL of the trainer. Survived when the restarted trainer resumes from the newest complete
  checkpoint that was on disk when it died, and trains on.
- `trainer_sigterm`: SIGTERM of the trainer. Survived when it exits within its grace with a checkpoint of its last
  step and its prompt ledger (`summary/prompts_lost`, 0) logged, and the restarted trainer resumes from that step.
- `mlflow_outage`: the MLflow server stopped for `--mlflow-outage-s` seconds, then started again on the same store.
  Survived when the trainer is still running when the server is back and no record is lost (below).
- `disk_full`: the checkpoint disk filled to the last byte until a checkpoint write fails with ENOSPC, then freed.
  Survived when the run logs the failed write (`checkpoint/failed_writes`), trains on, and writes a later
  checkpoint once there is space. The run folder is a size-limited tmpfs that bubblewrap (`bwrap --tmpfs --size`)
  mounts for this harness and its children only; where bwrap cannot mount one, this fault is reported as not
  injected (the run goes on without it).

The trainer runs with an unbounded `max_steps` (the demo's learning rate is constant, so the bound changes nothing
else); once every fault is settled and `--minutes` have passed, it is stopped with SIGTERM and started once more with
`max_steps` a few steps further, so the run ends as any run does, with its final held-out evaluation. When the last
fault is a trainer fault injected after `--minutes`, its restart is that last start. The fault-free
run of the same seed and config then trains exactly as many steps.

Then it prints the faults injected and survived; the prompts lost (the sum of every trainer's prompt ledger,
`summary/prompts_lost`, which a trainer logs when it finishes or stops; a trainer killed with SIGKILL logs none, and
its resumed successor draws every prompt after its checkpoint again); whether every step has its `loss` in MLflow
(records lost to the outage would show here); whether the last trainer left a process running; and the final
held-out reward (`eval/reward`, with its standard error `eval/reward_se`) against the fault-free run. It exits 1 when
a fault was not survived, a prompt, a step's metrics or a process was lost, or (with `--reward-check`, the full
soak's default) the final rewards differ by more than twice the standard error of their difference.

    .venv/bin/python benchmarks/chaos.py [--minutes 20] [--seed 0] [--mlflow-outage-s 60] [--out DIR] [--set KEY=VALUE ...]
    .venv/bin/python benchmarks/chaos.py --reduced [--model DIR]     # CI's form: 1 minute, a 5-s outage
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from time_to_reward import Child, child_env, metric_history  # noqa: E402  (the benchmarks' process handling, shared)

DEMO_CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
FAULTS = ("vllm_kill9", "reward_worker_kill9", "trainer_kill9", "trainer_sigterm", "mlflow_outage", "disk_full")
TRAINER_FAULTS = ("trainer_kill9", "trainer_sigterm")  # the trainer is started again after these
POLL_S = 0.5
START_TIMEOUT_S = 600.0  # a trainer's start-up (SFT warm start, vLLM start) before it logs a step
PROGRESS_TIMEOUT_S = 300.0  # the longest a started trainer may go without logging a new step
MLFLOW_START_TIMEOUT_S = 120.0
SIGTERM_EXIT_TIMEOUT_S = 120.0  # beyond checkpoint_signal_grace_s (60 s by default): the trainer's own bound
DISK_FULL_HOLD_STEPS = 3  # save_steps intervals the disk stays full at most, waiting for a failed write
UNBOUNDED_STEPS = 1_000_000  # max_steps until the last trainer start
FINAL_STEPS = 5  # steps the last trainer start trains past the stop that ends the faulted part
INNER_FLAG = "--inside-tmpfs"


@dataclass
class Fault:
    """One injected fault.

    Attributes:
        kind: one of FAULTS.
        at_s: seconds into the soak it is due; injected then, or once the fault before it is settled.
        injected_at_step: the run's newest step when it was injected; None if it was not.
        survived: whether the run survived it (see the module docstring); None until known.
        detail: what was seen, or why it was not injected.
    """

    kind: str
    at_s: float
    injected_at_step: int | None = None
    survived: bool | None = None
    detail: str = ""


# ---------------------------------------------------------------------------------------------------------- MLflow
class MlflowServer:
    """A real `mlflow server` on a sqlite store, in its own session, that the harness stops and starts again.

    Args:
        folder: holds `mlflow.db`, `mlartifacts/` and `mlflow-server.log`.
        port: the TCP port, the same across restarts.
    """

    def __init__(self, folder: Path, port: int):
        self.folder = folder
        self.port = port
        self.db = folder / "mlflow.db"
        folder.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{port}"
        self.child: Child | None = None

    def start(self) -> None:
        """Start the server and wait for its /health (at most MLFLOW_START_TIMEOUT_S seconds).

        Raises:
            RuntimeError: it exited or did not answer in time (its log tail is included).
        """
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.db}",
                   "--artifacts-destination", str(self.folder / "mlartifacts"), "--serve-artifacts",
                   "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]  # fmt: skip
        env = {k: v for k, v in child_env().items() if not k.startswith("MLFLOW_")}
        # tracking only: mlflow 3's job runner (on by default with a database store) starts seven huey consumer
        # processes of ~240 MB each beside the server, at every start, for jobs this soak never submits
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        self.child = Child(command, self.folder / "mlflow-server.log", env)
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.child.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited:\n{self.child.tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.child.remember_descendants()
                        return
            except OSError:
                pass
            time.sleep(POLL_S)
        raise RuntimeError(f"mlflow server did not answer /health within {MLFLOW_START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        """Stop the server and every process it started (by PID)."""
        if self.child is not None:
            self.child.stop(grace_s=15.0)
            self.child = None


def metric_rows(db: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of metric `key` in the sqlite store `db`, read-only (`time_to_reward.metric_history`); [] while
    it does not exist yet. The store holds this soak's one run."""
    return [(step, value) for step, _, value in metric_history(db, key)]


def traces_by_step(db: Path) -> dict[int, int]:
    """Episode traces the sqlite store `db` holds, by their `async_grpo.step` tag (a step the trainer trained again
    after a restart logs its traces again), read-only; {} before the first."""
    import sqlite3

    if not db.is_file():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            rows = conn.execute("SELECT value, COUNT(*) FROM trace_tags WHERE key = 'async_grpo.step' GROUP BY value")
            return {int(step): count for step, count in rows}
        except sqlite3.OperationalError:  # no trace table yet
            return {}


def newest_logged_step(db: Path) -> int:
    """The newest step with a logged `loss` (0 before the first)."""
    rows = metric_rows(db, "loss")
    return max((s for s, _ in rows), default=0)


# ---------------------------------------------------------------------------------------------------------- the run
def train_command(args: argparse.Namespace, run_dir: Path, tracking_uri: str, max_steps: int) -> list[str]:
    """The trainer's command line: the same for the first start and every restart (it resumes from the newest
    checkpoint in `run_dir` when there is one), but for `max_steps`."""
    command = [sys.executable, "-m", "async_grpo.cli", "train", str(DEMO_CONFIG), f"output_dir={run_dir}",
               f"max_steps={max_steps}", f"seed={args.seed}", f"save_steps={args.save_steps}", "save_total_limit=2",
               "resume_from_checkpoint=true", f"eval_num_prompts={args.eval_prompts}", "eval_strategy=no",
               "log_completions=false", f"mlflow_tracking_uri={tracking_uri}"]  # fmt: skip
    if args.model:
        command += [f"model_name_or_path={args.model}", "warmup_sft_steps=0"]
    elif args.warmup_sft_steps is not None:
        command.append(f"warmup_sft_steps={args.warmup_sft_steps}")
    return command + args.set


def children_matching(child: Child, *needles: str) -> list[Any]:
    """The live descendants of `child` whose command line contains every one of `needles` (psutil processes)."""
    import psutil

    found = []
    try:
        descendants = psutil.Process(child.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in descendants:
        try:
            line = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if all(n in line for n in needles):
            found.append(proc)
    return found


def reward_workers(child: Child) -> list[Any]:
    """The trainer's reward worker processes: its direct children started by multiprocessing's spawn (pebble's
    workers), not its resource tracker and not vLLM's processes."""
    pid = child.process.pid
    return [p for p in children_matching(child, "spawn_main") if p.ppid() == pid]


def wait_for(predicate, timeout_s: float, what: str, child: Child | None = None) -> None:
    """Poll `predicate()` every POLL_S seconds until it is true.

    Raises:
        RuntimeError: `timeout_s` seconds passed, or `child` exited meanwhile (`what` names the wait).
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if child is not None and child.process.poll() is not None and not predicate():  # it may have just flushed
            raise RuntimeError(f"the trainer exited (code {child.process.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def log_text(child: Child) -> str:
    return child.log.read_text(errors="replace")


class Soak:
    """The faulted run: its trainer segments, its MLflow server and the faults.

    Args:
        args: the parsed command line.
        run_dir: the run's output_dir (on the size-limited tmpfs when `disk` is set).
        out: where the logs and the report go (never on the tmpfs).
        disk: the tmpfs mount point, or None without one (then `disk_full` is not injected).
    """

    def __init__(self, args: argparse.Namespace, run_dir: Path, out: Path, disk: Path | None):
        from async_grpo.inference.server import free_port

        self.args = args
        self.run_dir = run_dir
        self.out = out
        self.disk = disk
        self.mlflow = MlflowServer(out / "mlflow", free_port())
        self.segments: list[dict[str, Any]] = []
        self.child: Child | None = None
        self.left_running: list[str] = []  # processes the last trainer left running when it exited
        rng = random.Random(args.seed)
        kinds = list(FAULTS)
        rng.shuffle(kinds)
        duration = 60.0 * args.minutes
        times = sorted(rng.uniform(0.1 * duration, 0.7 * duration) for _ in kinds)
        self.faults = [Fault(kind, round(t, 1)) for kind, t in zip(kinds, times, strict=True)]
        self.final_steps: int | None = None  # the step count of the last trainer start (and the fault-free run)
        self.restart_is_last = False  # the restart after the fault being injected is the last trainer start

    # ------------------------------------------------------------------ trainer segments
    def start_trainer(self, max_steps: int = UNBOUNDED_STEPS) -> None:
        index = len(self.segments)
        env = {k: v for k, v in child_env().items() if not k.startswith("MLFLOW_")}
        log = self.out / f"trainer-{index}.log"
        self.child = Child(train_command(self.args, self.run_dir, self.mlflow.uri, max_steps), log, env)
        self.segments.append({"log": str(log), "started_at_step": self.progress()})

    def end_trainer(self, code: int | None) -> None:
        """Record the segment's exit and end whatever processes it left (by PID)."""
        assert self.child is not None
        self.child.remember_descendants()
        final = self.child.stop(grace_s=15.0)
        self.segments[-1]["exit_code"] = code if code is not None else final
        self.child = None

    def progress(self) -> int:
        """The run's newest known step: its newest logged `loss`, or its newest complete checkpoint when MLflow lags
        behind (its writer retries with a growing backoff after an outage)."""
        return max(newest_logged_step(self.mlflow.db), self.newest_checkpoint())

    def newest_checkpoint(self) -> int:
        from async_grpo.checkpoint_layout import complete_checkpoints

        found = complete_checkpoints(self.run_dir)
        return found[-1][0] if found else 0

    # ------------------------------------------------------------------ the faults
    def inject(self, fault: Fault) -> None:
        """Inject `fault` into the running trainer and settle whether it was survived (restarting the trainer
        after a trainer fault)."""
        child = self.child
        assert child is not None
        fault.injected_at_step = self.progress()
        child.remember_descendants()
        print(f"step {fault.injected_at_step}: injecting {fault.kind} (due at {fault.at_s:.0f} s)", flush=True)
        getattr(self, f"_{fault.kind}")(fault, child)
        print(f"  {fault.kind}: {'survived' if fault.survived else 'NOT survived'} ({fault.detail})", flush=True)

    def _trains_on(self, child: Child, steps: int = 2) -> None:
        """Wait until `child` trains `steps` more steps: as many new `loss` rows in MLflow (a resumed trainer logs
        its steps again), or a newer checkpoint (MLflow may lag), or its normal end (the run is complete).

        Raises:
            RuntimeError: it did not within PROGRESS_TIMEOUT_S, or it failed.
        """
        rows, checkpoint = len(metric_rows(self.mlflow.db, "loss")), self.newest_checkpoint()

        def trained() -> bool:
            grew = len(metric_rows(self.mlflow.db, "loss")) >= rows + steps or self.newest_checkpoint() > checkpoint
            return grew or child.process.poll() == 0

        wait_for(trained, PROGRESS_TIMEOUT_S, f"{steps} more steps", child)

    def _vllm_kill9(self, fault: Fault, child: Child) -> None:
        servers = children_matching(child, "vllm.entrypoints.openai.api_server")
        if not servers:
            fault.detail = "no vLLM server among the trainer's processes"
            fault.survived = False
            return
        before = log_text(child).count("vLLM recovered in")
        restarts = len(metric_rows(self.mlflow.db, "inference/restarts"))  # logged once per recovery
        servers[0].kill()
        wait_for(lambda: log_text(child).count("vLLM recovered in") > before, PROGRESS_TIMEOUT_S,
                 "vLLM's recovery", child)  # fmt: skip
        self._trains_on(child)
        wait_for(lambda: len(metric_rows(self.mlflow.db, "inference/restarts")) > restarts,
                 PROGRESS_TIMEOUT_S, "the restart counted in MLflow (inference/restarts)", child)  # fmt: skip
        seconds = [v for _, v in metric_rows(self.mlflow.db, "inference/recovery_seconds")]
        fault.survived = True
        fault.detail = (
            f"pid {servers[0].pid} killed; back in {seconds[-1] if seconds else float('nan'):.1f} s, trained on"
        )

    def _reward_worker_kill9(self, fault: Fault, child: Child) -> None:
        workers = reward_workers(child)
        if not workers:
            fault.detail, fault.survived = "no reward worker among the trainer's processes", False
            return
        victim = random.Random(self.args.seed).choice(workers)
        victim.kill()
        victim.wait(timeout=30)
        wait_for(lambda: len(reward_workers(child)) >= len(workers), PROGRESS_TIMEOUT_S, "a new reward worker", child)
        self._trains_on(child)
        fault.survived = True
        fault.detail = f"pid {victim.pid} of {len(workers)} killed; the pool runs {len(reward_workers(child))} again"

    def _trainer_kill9(self, fault: Fault, child: Child) -> None:
        child.process.kill()
        child.process.wait(timeout=30)
        checkpoint = self.newest_checkpoint()  # a write the kill interrupted left only a temporary folder
        self.end_trainer(-9)
        self._resumes_from(fault, checkpoint, "killed")

    def _trainer_sigterm(self, fault: Fault, child: Child) -> None:
        before = len(metric_rows(self.mlflow.db, "summary/prompts_lost"))
        child.signal(signal.SIGTERM)
        code = child.wait(SIGTERM_EXIT_TIMEOUT_S)
        last = newest_logged_step(self.mlflow.db)  # flushed by the trainer before it exited
        self.end_trainer(code)
        checkpoint = self.newest_checkpoint()
        ledger = metric_rows(self.mlflow.db, "summary/prompts_lost")
        if code not in (0, 130) or checkpoint != last or len(ledger) <= before:
            fault.survived = False
            fault.detail = (f"exit code {code} (0 or 130 expected), checkpoint of step {checkpoint} (last logged: "
                            f"{last}), ledger logged: {len(ledger) > before}")  # fmt: skip
            return
        self._resumes_from(fault, checkpoint, f"stopped (exit {code}, checkpoint of step {checkpoint})")

    def _resumes_from(self, fault: Fault, checkpoint: int, what: str) -> None:
        if self.restart_is_last:  # the faulted part is over: this start is the last one (see `finish`)
            self.final_steps = checkpoint + FINAL_STEPS
            print(f"faults done; the restart is the last start and trains to step {self.final_steps}", flush=True)
            self.start_trainer(self.final_steps)
        else:
            self.start_trainer()
        child = self.child
        assert child is not None
        wanted = f"checkpoint-{checkpoint} at step {checkpoint} " if checkpoint else "starting a fresh run"
        wait_for(lambda: wanted in log_text(child), START_TIMEOUT_S, f"the resume from step {checkpoint}", child)
        self._trains_on(child)
        fault.survived, fault.detail = True, f"{what}; resumed from step {checkpoint}, trained on"

    def _mlflow_outage(self, fault: Fault, child: Child) -> None:
        down = time.monotonic()
        self.mlflow.stop()
        deadline = time.monotonic() + self.args.mlflow_outage_s
        while time.monotonic() < deadline and child.process.poll() is None:
            time.sleep(POLL_S)
        self.mlflow.start()  # its start-up adds to the outage: the trainer sees it from stop to /health
        back = time.monotonic()
        if child.process.poll() is not None:
            fault.survived, fault.detail = False, f"the trainer exited (code {child.process.returncode}) meanwhile"
            return
        trained = self.newest_checkpoint()
        # caught up: MLflow holds every step to the trainer's newest checkpoint, a moving target (the trainer trains
        # on meanwhile), so what the trainer still holds in memory is less than one save_steps interval
        wait_for(lambda: newest_logged_step(self.mlflow.db) >= self.newest_checkpoint(), PROGRESS_TIMEOUT_S,
                 "MLflow to catch up with the trainer", child)  # fmt: skip
        fault.survived = True
        fault.detail = (f"server down {back - down:.0f} s (start-up included; {trained} steps trained by then); "
                        f"MLflow caught up with the trainer {time.monotonic() - back:.0f} s after it was back")  # fmt: skip

    def _disk_full(self, fault: Fault, child: Child) -> None:
        if self.disk is None:
            fault.detail = "not injected: no size-limited tmpfs (bubblewrap could not mount one here)"
            fault.injected_at_step = None
            return
        filler = self.disk / "filler"
        with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
            chunk = b"\0" * (1 << 20)
            try:
                while f.write(chunk):
                    pass
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
        try:
            start = self.progress()
            hold = start + DISK_FULL_HOLD_STEPS * self.args.save_steps
            wait_for(lambda: metric_rows(self.mlflow.db, "checkpoint/failed_writes") or self.progress() >= hold,
                     PROGRESS_TIMEOUT_S, "a checkpoint write on the full disk", child)  # fmt: skip
        finally:
            filler.unlink()
        failed = metric_rows(self.mlflow.db, "checkpoint/failed_writes")
        if not failed:
            fault.survived, fault.detail = False, "no checkpoint write failed while the disk was full"
            return
        before = self.newest_checkpoint()
        wait_for(lambda: self.newest_checkpoint() > before, PROGRESS_TIMEOUT_S, "a checkpoint after the disk was freed",
                 child)  # fmt: skip
        fault.survived = True
        fault.detail = (f"{int(failed[-1][1])} checkpoint write(s) failed with the disk full; trained on, checkpoint "
                        f"of step {self.newest_checkpoint()} written once freed")  # fmt: skip

    # ------------------------------------------------------------------ the whole soak
    def run(self) -> dict[str, Any]:
        """The faulted run: every fault, then the last trainer start to `final_steps`; returns the report."""
        started = time.monotonic()
        self.mlflow.start()
        self.start_trainer()
        pending = list(self.faults)
        seen: dict[int, Any] = {}  # the last trainer's descendants, as seen while it ran
        try:
            wait_for(lambda: self.progress() >= 1, START_TIMEOUT_S, "the first step", self.child)
            t0 = time.monotonic()  # fault times count from the first trained step
            while True:
                child = self.child
                if child is None:  # a fault that was not survived left no trainer running: the soak ends here
                    lost = [
                        f"{f.kind}: {f.detail}"
                        for f in self.faults
                        if f.injected_at_step is not None and not f.survived
                    ]
                    raise RuntimeError(f"no trainer is running after {'; '.join(lost) or 'a fault'}")
                code = child.process.poll()
                if code is not None:
                    self.left_running = survivors(seen)  # the trainer ends what it started, by itself
                    self.end_trainer(code)
                    if code != 0 or self.final_steps is None:
                        raise RuntimeError(f"the trainer exited with code {code} unprompted:\n{log_text_tail(self)}")
                    break
                child.remember_descendants()
                seen.update({p.pid: p for p in children_matching(child)})
                elapsed = time.monotonic() - t0
                if pending and elapsed >= pending[0].at_s:
                    seen.clear()  # a trainer fault starts another trainer; vLLM's recovery, another server
                    fault = pending.pop(0)
                    # the last fault, once --minutes have passed: a trainer fault's restart is then the last start,
                    # which saves `finish`'s stop and start (a trainer start is ~35 s of imports and a vLLM start)
                    self.restart_is_last = not pending and elapsed >= 60.0 * self.args.minutes
                    try:
                        self.inject(fault)
                    except RuntimeError as err:
                        fault.survived, fault.detail = False, str(err)
                        raise
                elif not pending and self.final_steps is None and elapsed >= 60.0 * self.args.minutes:
                    seen.clear()
                    self.finish()
                if elapsed > self.args.timeout_s:
                    raise RuntimeError(f"the soak did not finish within {self.args.timeout_s:.0f} s")
                time.sleep(POLL_S)
            return self.report(time.monotonic() - started)
        finally:
            if self.child is not None:
                self.end_trainer(None)
            self.mlflow.stop()

    def finish(self) -> None:
        """End the faulted part: SIGTERM the trainer (a checkpoint of its last step), then start it once more with
        `max_steps` FINAL_STEPS further, to end as any run ends (final evaluation, ledger).

        Raises:
            RuntimeError: the trainer did not stop cleanly with a checkpoint.
        """
        child = self.child
        assert child is not None
        child.signal(signal.SIGTERM)
        code = child.wait(SIGTERM_EXIT_TIMEOUT_S)
        self.end_trainer(code)
        if code not in (0, 130):
            raise RuntimeError(f"the trainer stopped with exit code {code}:\n{log_text_tail(self)}")
        self.final_steps = self.newest_checkpoint() + FINAL_STEPS
        print(f"faults done; the last start trains to step {self.final_steps}", flush=True)
        self.start_trainer(self.final_steps)

    def report(self, wall_s: float) -> dict[str, Any]:
        """Faults, the ledger, the steps' metrics and the final held-out reward, read from the MLflow store."""
        loss_steps = {s for s, _ in metric_rows(self.mlflow.db, "loss")}
        steps = self.final_steps or 0
        missing = sorted(set(range(1, steps + 1)) - loss_steps)
        ledger = metric_rows(self.mlflow.db, "summary/prompts_lost")
        return {
            "wall_s": round(wall_s, 1),
            "steps": steps,
            "faults": [asdict(f) for f in self.faults],
            "segments": self.segments,
            "prompts_lost": sum(v for _, v in ledger),
            "ledgers_logged": len(ledger),
            "steps_without_loss": missing,
            "traces_by_step": traces_by_step(self.mlflow.db),
            "left_running": self.left_running,
            "final": final_reward(self.mlflow.db, steps),
        }


def survivors(seen: dict[int, Any], grace_s: float = 10.0) -> list[str]:
    """Which of the processes `seen` (psutil) still run `grace_s` seconds after their trainer exited, as
    "pid command" lines."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for proc in seen.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:  # gone meanwhile
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(POLL_S)


def log_text_tail(soak: Soak, lines: int = 40) -> str:
    log = Path(soak.segments[-1]["log"])
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def final_reward(db: Path, step: int) -> dict[str, float]:
    """`eval/reward` and `eval/reward_se` logged at `step` (the final evaluation); NaN where missing."""
    found = {}
    for key in ("eval/reward", "eval/reward_se"):
        values = [v for s, v in metric_rows(db, key) if s == step]
        found[key.removeprefix("eval/")] = values[-1] if values else math.nan
    return found


def baseline(args: argparse.Namespace, out: Path, steps: int) -> dict[str, float]:
    """The same run without faults (its own sqlite store), `steps` steps; its final held-out reward.

    Raises:
        RuntimeError: it failed (the log tail is included).
    """
    out.mkdir(parents=True, exist_ok=True)
    db = out / "mlflow.db"
    env = {k: v for k, v in child_env().items() if not k.startswith("MLFLOW_")}
    child = Child(train_command(args, out / "run", f"sqlite:///{db}", steps), out / "trainer.log", env)
    try:
        code = child.wait(args.timeout_s)
    finally:
        final = child.stop(grace_s=15.0)
    if code != 0:
        raise RuntimeError(f"the fault-free run ended with code {code if code is not None else final}:\n{child.tail()}")
    return final_reward(db, steps)


# ---------------------------------------------------------------------------------------------------------- main
def bwrap_tmpfs_works(bwrap: str, size: int) -> str | None:
    """None when `bwrap` can mount a tmpfs of `size` bytes for a child here, else the reason it cannot."""
    with tempfile.TemporaryDirectory() as probe:
        try:
            out = subprocess.run([bwrap, "--dev-bind", "/", "/", "--size", str(size), "--tmpfs", probe, "--", "true"],
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as err:
            return repr(err)
    return None if out.returncode == 0 else out.stderr.strip() or f"exit code {out.returncode}"


def run_inside(command: list[str], timeout_s: float) -> int:
    """Run this harness again under bwrap (`command`) and return its exit code. A SIGTERM or Ctrl-C here, or
    `timeout_s` seconds, is passed on to the inner harness as SIGTERM, so it ends what it started before it exits
    (bwrap's `--die-with-parent` would SIGKILL it, leaving its runs behind)."""
    import psutil

    process = subprocess.Popen(command)
    try:
        return process.wait(timeout=timeout_s)
    except (KeyboardInterrupt, SystemExit, subprocess.TimeoutExpired):
        try:
            inner = psutil.Process(process.pid).children()
        except psutil.NoSuchProcess:
            inner = []
        for proc in inner:
            proc.terminate()
        psutil.wait_procs(inner, timeout=120)
        process.kill()
        process.wait(timeout=30)
        return 1


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # `finally` blocks run: every process this harness started is ended by PID


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="the faulted run's length, at least (minutes)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed and the fault schedule's")
    parser.add_argument("--save-steps", type=int, default=25, help="steps between checkpoints (save_steps)")
    parser.add_argument("--mlflow-outage-s", type=float, default=60.0, help="seconds the MLflow server is down")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts of the final evaluation")
    parser.add_argument("--warmup-sft-steps", type=int, default=None, help="the warm start's steps (config's)")
    parser.add_argument("--model", default=None, help="a model folder to start from instead (no warm start)")
    parser.add_argument("--disk-mb", type=int, default=256, help="size of the run folder's tmpfs (MiB)")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="each run's wall-clock bound (seconds)")
    parser.add_argument("--reward-check", action=argparse.BooleanOptionalAction, default=None,
                        help="fail when the final rewards differ beyond 2 SE (default: on, off with --reduced)")  # fmt: skip
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    parser.add_argument("--reduced", action="store_true", help="CI's form: 1 minute, checkpoints every 5, 5-s outage")
    parser.add_argument("--out", default=None, help="folder for logs and the report (default: a temporary one)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="further tiny_cpu.yaml overrides for both runs, after the soak's own (e.g. "
                        "weight_sync_overlap=true)")  # fmt: skip
    parser.add_argument(INNER_FLAG, dest="inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reduced:
        args.minutes, args.save_steps, args.mlflow_outage_s = 1.0, 5, 5.0
        args.eval_prompts = min(args.eval_prompts, 32)
        args.timeout_s = min(args.timeout_s, 900.0)
    if args.reward_check is None:
        args.reward_check = not args.reduced
    if not args.minutes > 0:
        parser.error(f"--minutes {args.minutes}: give a positive length")
    if args.set:  # a bad override fails here, before any server starts
        from async_grpo.config import load_config

        try:
            load_config(DEMO_CONFIG, args.set)
        except Exception as err:
            parser.error(f"--set {' '.join(args.set)}: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.inside is None and (out / "mlflow").exists():  # an earlier soak's store would be read as this one's
        print(f"--out {out} holds an earlier soak (mlflow/): give an empty or new folder", file=sys.stderr)
        return 2
    if args.inside is None:  # re-run this harness with its run folder on a size-limited tmpfs, if bwrap can
        from async_grpo.tools.sandbox import locate_bwrap

        disk = out / "disk"
        disk.mkdir(exist_ok=True)
        bwrap = locate_bwrap()
        why = "bubblewrap not found" if bwrap is None else bwrap_tmpfs_works(bwrap, args.disk_mb << 20)
        if why is None:
            command = [bwrap, "--dev-bind", "/", "/", "--size", str(args.disk_mb << 20), "--tmpfs", str(disk),
                       "--die-with-parent", "--", sys.executable, __file__, *(argv or sys.argv[1:]),
                       "--out", str(out), INNER_FLAG, str(disk)]  # fmt: skip
            return run_inside(command, 4 * args.timeout_s)
        print(f"disk_full will not be injected: {why}", flush=True)
        args.inside = ""
    disk = Path(args.inside) if args.inside else None
    run_dir = (disk or out) / "run"
    soak = Soak(args, run_dir, out, disk)
    print(f"faults (seed {args.seed}): " + ", ".join(f"{f.kind} at {f.at_s:.0f} s" for f in soak.faults), flush=True)
    try:
        report = soak.run()
    except RuntimeError as err:
        print(f"the soak failed: {err}", file=sys.stderr)
        print(json.dumps({"faults": [asdict(f) for f in soak.faults], "segments": soak.segments}), file=sys.stderr)
        return 1
    code = print_report(report, args)  # the faulted run's findings first: the fault-free run takes as long again
    if not args.no_baseline:
        report["fault_free"] = baseline(args, out / "fault-free", report["steps"])
        code = max(code, print_comparison(report, args))
    print(json.dumps(report))
    return code


def print_report(report: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the report; 1 when something was lost or a fault was not survived (see the module docstring)."""
    faults = report["faults"]
    injected = [f for f in faults if f["injected_at_step"] is not None]
    survived = [f for f in injected if f["survived"]]
    print(f"\nchaos soak: {report['steps']} steps, seed {args.seed}, {report['wall_s']:.0f} s, "
          f"{len(report['segments'])} trainer start(s)")  # fmt: skip
    for f in faults:
        state = "not injected" if f["injected_at_step"] is None else ("survived" if f["survived"] else "NOT SURVIVED")
        print(f"  {f['kind']:20s} step {f['injected_at_step']!s:>5s}: {state}; {f['detail']}")
    print(f"faults injected {len(injected)}, survived {len(survived)}")
    print(f"prompts lost {report['prompts_lost']:g} (ledgers of {report['ledgers_logged']} trainer stop(s))")
    missing = report["steps_without_loss"]
    print(f"steps without their metrics in MLflow: {len(missing)}" + (f" {missing[:10]}" if missing else ""))
    traced = report["traces_by_step"]
    print(f"episode traces kept: {sum(traced.values())} over {len(traced)} traced step(s) "
          "(a trainer killed mid-write loses its pending ones)")  # fmt: skip
    final = report["final"]
    print(f"final held-out reward {final['reward']:.3f} +- {final['reward_se']:.3f} (standard error)", flush=True)
    if report["left_running"]:
        print(f"left running by the last trainer: {report['left_running']}")
    bad = len(survived) < len(injected) or report["prompts_lost"] or missing or report["left_running"]
    return 1 if bad else 0


def print_comparison(report: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the final held-out rewards of the faulted and the fault-free run; 1 when `--reward-check` is on and
    they differ by more than twice the standard error of their difference."""
    final, free = report["final"], report["fault_free"]
    bar = 2 * math.hypot(final["reward_se"], free["reward_se"])
    within = abs(final["reward"] - free["reward"]) <= bar
    print(f"fault-free run {free['reward']:.3f} +- {free['reward_se']:.3f}: difference "
          f"{final['reward'] - free['reward']:+.3f}, {'within' if within else 'OUTSIDE'} 2 SE ({bar:.3f})")  # fmt: skip
    return 1 if args.reward_check and not within else 0


if __name__ == "__main__":
    sys.exit(main())
