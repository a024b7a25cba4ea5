"""Real processes for integration tests: one tiny model and one real vLLM server per session.

The server is started with exactly the flags the product uses (`build_server_command`), so these
tests exercise the same control plane and gloo data plane as `make demo`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.launch.local import run_local
from async_grpo.tiny_model import build_tiny_model

VLLM_STARTUP_TIMEOUT_S = 400.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly built tiny model folder (no hub access)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """A real vLLM server on the tiny model (gloo weight transfer), shared by the session."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = build_server_command(
        tiny_model_dir, port=port, dtype="float32", max_model_len=512, weight_transfer_backend="gloo"
    )
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VLLMServer(cmd, server_env(1), log, url, VLLM_STARTUP_TIMEOUT_S)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def environment_run(child_pids, vllm_server, tiny_model_dir, tmp_path):
    """`run(environment, steps)`: a short run of `environment` on the guessing game's dataset (40 warm-start steps,
    `steps` GRPO steps) against the session's vLLM server; asserts it trained every step and left no process
    behind. Returns the summary, the run's final metrics, a `history(name)` of a metric's per-step values, and the
    run's seconds."""
    import mlflow

    def run(environment: str, steps: int):
        config = GRPOConfig(
            model_name_or_path=str(tiny_model_dir), dataset="builtin:guess", environment=environment, max_turns=4,
            reward_funcs=["builtin:env_reward"], output_dir=str(tmp_path / "run"), vllm_url=vllm_server.url,
            warmup_sft_steps=40, warmup_sft_learning_rate=3e-3, max_steps=steps, vllm_sync_interval=1,
            per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
            max_completion_length=160, eval_num_prompts=4, torch_num_threads=1, learning_rate=1e-4, save_model=False,
        )  # fmt: skip
        before = child_pids()
        started = time.monotonic()
        summary = run_local(config, progress=False)
        elapsed = time.monotonic() - started
        assert summary.steps == steps
        assert not child_pids() - before, "processes left behind by the run"
        mlflow.set_tracking_uri(summary.tracking_uri)
        client = mlflow.tracking.MlflowClient()
        metrics = client.get_run(summary.run_id).data.metrics

        def history(name: str) -> list[float]:
            return [m.value for m in client.get_metric_history(summary.run_id, name)]

        return summary, metrics, history, elapsed

    return run
