"""A fault a run does not survive, with the real CLI, the real vLLM CPU server and the real MLflow store: the reward
service killed for good fails the run within `reward_failure_timeout_s`, naming the service.

The faults a run survives (`kill -9` of vLLM, of a reward worker and of the trainer, SIGTERM, an MLflow outage, a
full checkpoint disk) are injected together by `benchmarks/chaos.py`, whose reduced form runs in
`tests/test_benchmarks.py::test_chaos_reduced`.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STARTED_TIMEOUT_S = 400.0


def _loss_steps(db: Path) -> int:
    """Optimizer steps logged so far (rows of the `loss` metric), read from the run's sqlite store."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("select count(*) from metrics where key = 'loss'").fetchone()[0]
    except sqlite3.Error:
        return 0


REWARD_FAILURE_TIMEOUT_S = 15.0


def _start_reward_service(config_path: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from async_grpo.inference.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "async_grpo.rewards.server",
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-workers",
            "1",
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "reward service did not come up"
        time.sleep(0.2)


def test_a_reward_service_killed_mid_run_fails_the_run_within_the_timeout_naming_the_service(
    vllm_server, tiny_model_dir, tmp_path
):
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "warmup_sft_steps=0",
                 "max_steps=100000", "eval_num_prompts=4", "per_device_train_batch_size=16",
                 "gradient_accumulation_steps=1", "max_inflight_groups=4",
                 f"reward_failure_timeout_s={REWARD_FAILURE_TIMEOUT_S}"]  # fmt: skip
    service, url = _start_reward_service(REPO / "examples" / "tiny_cpu.yaml", tmp_path / "reward.log")
    workers: list[psutil.Process] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [
        sys.executable,
        "-m",
        "async_grpo.cli",
        "train",
        str(REPO / "examples" / "tiny_cpu.yaml"),
        *overrides,
        f"reward_url={url}",
        f"vllm_url={vllm_server.url}",
    ]  # the session's server: no second vLLM start
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr.log", "wb"),
    )
    try:
        deadline = time.monotonic() + STARTED_TIMEOUT_S
        while _loss_steps(out / "mlflow.db") < 3:
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "run did not start in time"
            time.sleep(0.2)
        workers = psutil.Process(service.pid).children(recursive=True)
        killed_at = time.monotonic()
        service.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=REWARD_FAILURE_TIMEOUT_S + 120)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if service.poll() is None:
            service.kill()
        for worker in workers:  # the killed service could not stop its scoring workers
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
    log = (tmp_path / "stderr.log").read_text()
    assert code == 1, log[-3000:]
    message = [line for line in log.splitlines() if line.startswith("error: ")]
    assert message and url in message[-1] and "reward_failure_timeout_s" in message[-1] and "Fix" in message[-1]
    assert "Traceback" not in log.split(message[-1])[-1]  # the last word is the message, not a traceback
    assert took < REWARD_FAILURE_TIMEOUT_S + 30, took
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert checkpoints and str(checkpoints[-1]) in message[-1]  # the steps done are kept, and the message says where
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])[0]
    assert run.info.status == "FAILED"
    print(
        f"\nreward service killed: the run failed {took:.1f} s later (reward_failure_timeout_s="
        f"{REWARD_FAILURE_TIMEOUT_S:g})"
    )
