"""Every benchmark runs to completion in a reduced size and prints the ratio it exists for (CI has no GPU and two
cores: the numbers are not checked, only that each script still measures what its docstring says)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, timeout_s: float = 600) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_chunked_logprobs_reduced():
    stdout = run("chunked_logprobs.py", "--n", "2", "--t", "64", "--h", "32", "--v", "4096", "--chunk", "16")
    assert "memory ratio full/chunked" in stdout


def test_reward_scaling_reduced():
    stdout = run("reward_scaling.py", "--groups", "4", "--generations", "2", "--busy-ms", "5", "--workers", "1", "2")
    assert "2 worker(s)" in stdout and "efficiency" in stdout


@pytest.mark.integration
def test_weight_sync_reduced():
    stdout = run(
        "weight_sync.py", "--shape", "demo", "--vllm-dtype", "bfloat16", "--pushes", "2", "--bucket-mb", "0.25"
    )
    assert "full push: " in stdout and "delta push: " in stdout and "x the raw gloo broadcast" in stdout
    assert '"buckets": ' in stdout and "of the dense bytes" in stdout


@pytest.mark.integration
def test_vs_trl_reduced():
    stdout = run("vs_trl.py", "--reduced", "--steps", "1")
    assert "x TRL's steps/s" in stdout and "async / on-policy" in stdout and "its trained tokens/s" in stdout
    assert "on-policy step / (its generation + its training)" in stdout and '"vllm_tokens_per_s"' in stdout


@pytest.mark.integration
def test_gpu_sh_reduced_cpu_mode(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--reduced", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mode reduced-cpu" in out.stdout and "x the float32 steps/s" in out.stdout
    overlap = (tmp_path / "overlap.txt").read_text()  # gpu.sh's reduced mode is the CI run of overlap.py and
    assert "overlap efficiency (t_gen + t_train) / t_step" in overlap and "of ideal" in overlap  # trainer_precision.py
    assert '"t_gen_s"' in overlap and '"t_train_s"' in overlap and '"t_step_s"' in overlap
    assert '"variant": "bf16"' in (tmp_path / "trainer_precision.txt").read_text()


@pytest.mark.integration
def test_time_to_reward_reduced(tmp_path):
    stdout = run("time_to_reward.py", "--reduced", "--out", str(tmp_path), timeout_s=500)
    assert "warm start: " in stdout and "held-out reward of the warm start: " in stdout and "target " in stdout
    assert "ours_async: time to target median " in stdout and "trl_grpo: time to target median " in stdout
    assert "ratio our default / trl_grpo (median time to target): " in stdout and "checkpoint saving excluded" in stdout
    assert f"csv: {tmp_path / 'time_to_reward.csv'}" in stdout and f"png: {tmp_path / 'time_to_reward.png'}" in stdout
    rows = (tmp_path / "time_to_reward.csv").read_text().splitlines()
    assert rows[0] == "system,seed,wall_s,step,heldout_reward" and len(rows) > 3
    assert (tmp_path / "time_to_reward.png").stat().st_size > 0
