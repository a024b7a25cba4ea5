"""Two real vLLM CPU servers behind one run (`vllm_replicas: 2`, issue 11): every push reaches both (their logprobs
match the trainer's after each push), both serve generation requests, and `kill -9` of one mid-run leaves the run
finishing on the other with no prompt lost.

The first replica is the session's shared server; the second is started here (one extra vLLM start-up, to keep CI
short). The run attaches to both with a comma-separated `vllm_url`; the local launch of N servers is the same
`ReplicaSet` with a restart callable per server (tests/inference/test_replicas.py covers the rejoin with fakes).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
from transformers import AutoModelForCausalLM

from async_grpo.inference.client import AsyncVLLMClient, InferenceEndpoint, VLLMControlClient
from async_grpo.inference.replicas import ReplicaSet
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.runner.resource_sharing import TimeSlice
from async_grpo.transports.weights.replicas import ReplicaPusher
from async_grpo.transports.weights.sync import WeightPusher

from .conftest import VLLM_STARTUP_TIMEOUT_S
from .test_faults import _loss_steps

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROMPT = [114, 101, 118, 101, 114, 115, 101, 58, 32, 97, 98, 99, 10]  # "reverse: abc\n" in the tiny byte vocab
MAX_STEPS = 16


@pytest.fixture(scope="module")
def second_server(tiny_model_dir, tmp_path_factory):
    """A second real vLLM server on the tiny model (the session's `vllm_server` is the first replica)."""
    port = free_port()
    cmd = build_server_command(
        tiny_model_dir, port=port, dtype="float32", max_model_len=512, weight_transfer_backend="gloo"
    )
    server = VLLMServer(
        cmd,
        server_env(1),
        tmp_path_factory.mktemp("vllm-replica") / "vllm.log",
        f"http://127.0.0.1:{port}",
        VLLM_STARTUP_TIMEOUT_S,
    )
    server.start()
    yield server
    server.close()


def _max_gap(url: str, served: str, model) -> float:
    """Largest |vLLM sampling logprob - trainer logprob| over 4 sampled completions of PROMPT (nats)."""

    async def go():
        client = AsyncVLLMClient(url, served)
        try:
            return await client.generate(PROMPT, n=4, max_tokens=8, temperature=1.0, seed=3)
        finally:
            await client.aclose()

    gaps = []
    for c in asyncio.run(go()):
        ids = torch.tensor([PROMPT + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        trainer = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        gaps.append(float((trainer - torch.tensor(c.logprobs)).abs().max()))
    return max(gaps)


def test_every_push_reaches_both_replicas(vllm_server, second_server, tiny_model_dir):
    urls = [vllm_server.url, second_server.url]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    replicas = ReplicaSet([InferenceEndpoint(u) for u in urls])
    pusher = ReplicaPusher(replicas, lambda url: WeightPusher(model, url, backend="gloo", timeout_s=120))
    torch.manual_seed(0)
    try:
        pusher.setup()
        for version in (11, 12):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            pusher.push(version)
            assert set(pusher.last_seconds) == {0, 1}
            for url in urls:
                assert VLLMControlClient(url).weight_version() == str(version)
                assert _max_gap(url, str(tiny_model_dir), model) < 1e-3, url  # this replica serves the new weights
        with TimeSlice(replicas, enabled=True):  # resource_sharing=time_slice: both pause while the trainer computes
            assert all(VLLMControlClient(u)._call("GET", "/is_paused")["is_paused"] for u in urls)
        assert not any(VLLMControlClient(u)._call("GET", "/is_paused")["is_paused"] for u in urls)
    finally:
        pusher.close()
    assert pusher.last_report.wire_bytes == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )  # weight_sync/bytes


def test_kill_9_of_one_replica_mid_run_finishes_on_the_other(vllm_server, second_server, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(REPO / "examples" / "tiny_cpu.yaml"),
           f"output_dir={out}", f"model_name_or_path={tiny_model_dir}", "warmup_sft_steps=0",
           f"vllm_url={vllm_server.url},{second_server.url}", "vllm_replicas=2", f"max_steps={MAX_STEPS}",
           "eval_num_prompts=4", "per_device_train_batch_size=16", "gradient_accumulation_steps=1",
           "max_inflight_groups=4", "vllm_recovery_timeout_s=15"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr.log", "wb"),
    )
    try:
        deadline = time.monotonic() + 300
        while _loss_steps(out / "mlflow.db") < 3:  # both replicas serve: requests are spread over them
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "run did not start in time"
            time.sleep(0.2)
        second_server.process.send_signal(signal.SIGKILL)  # the server this module started: its API process
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # `async-grpo train` prints every thread's stack
            time.sleep(3)
            pytest.fail("the run hung after the kill; its stacks:\n" + (tmp_path / "stderr.log").read_text()[-20000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "stderr.log").read_text()
    assert code == 0, log[-3000:]
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, MAX_STEPS + 1))
    metrics = run.data.metrics
    assert metrics["summary/prompts_lost"] == 0
    assert metrics["summary/inference_restarts"] == 0  # never without a live replica: no run-wide recovery
    history = {
        key: [m.value for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("inference/replica_0/requests", "inference/replica_1/requests", "inference/live_replicas")
    }
    assert history["inference/replica_1/requests"][0] > 0 and history["inference/replica_0/requests"][0] > 0
    assert history["inference/live_replicas"][0] == 2 and history["inference/live_replicas"][-1] == 1
    assert metrics["inference/replica_0/requests"] > history["inference/replica_0/requests"][0]  # it took over
    pushed_to_1 = client.get_metric_history(run.info.run_id, "weight_sync/replica_1/seconds")
    assert pushed_to_1 and len(pushed_to_1) < MAX_STEPS  # replica 1 got the pushes until it died
    print(
        f"\none of 2 replicas killed: run finished; replica requests 0/1: {metrics['inference/replica_0/requests']:.0f}"
        f"/{metrics['inference/replica_1/requests']:.0f}; rerouted {metrics['inference/rerouted_requests']:.0f}"
    )
