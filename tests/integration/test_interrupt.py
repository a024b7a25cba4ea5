"""Ctrl-C during a run ends every process the run started (vLLM server, engine core, reward workers), in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STARTED_TIMEOUT_S = 400.0
EXIT_TIMEOUT_S = 90.0


def test_ctrl_c_leaves_no_stray_process(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
           f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "warmup_sft_steps=0", "max_steps=100000",
           "eval_num_prompts=4"]  # fmt: skip
    # A new session, so that SIGINT to its process group is exactly what a terminal's Ctrl-C does.
    proc = subprocess.Popen(
        cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.log", "wb")
    )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + STARTED_TIMEOUT_S
        while not (out / "mlflow.db").exists():  # created once vLLM is healthy and training begins
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "run did not start in time"
            _record(proc.pid, seen)
            time.sleep(0.5)
        for _ in range(10):  # let generation, reward workers and training run for a moment
            _record(proc.pid, seen)
            time.sleep(0.5)
        assert any("vllm" in " ".join(_cmdline(p)) for p in seen.values()), "vLLM server was not started"
        os.killpg(proc.pid, signal.SIGINT)
        t_signal = time.monotonic()
        code = proc.wait(timeout=EXIT_TIMEOUT_S)
        exit_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130, (tmp_path / "stderr.log").read_text()[-3000:]
    # the step ends, its checkpoint is written and vLLM stopped: seconds. When vLLM got the SIGINT too, its engine
    # died mid-push and the run waited out the step's grace (checkpoint_signal_grace_s / 2 = 30 s), then 20 s more
    # for the API server: 50-90 s (vLLM now leads its own session)
    assert exit_s < 30.0, (exit_s, (tmp_path / "stderr.log").read_text()[-3000:])
    deadline = time.monotonic() + 10
    while (survivors := [p for p in seen.values() if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors, f"left running after Ctrl-C: {[(p.pid, _cmdline(p)) for p in survivors]}"


def _record(pid: int, seen: dict[int, psutil.Process]) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen.setdefault(child.pid, child)
    except psutil.NoSuchProcess:
        pass


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
