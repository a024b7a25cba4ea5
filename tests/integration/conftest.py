"""Real processes for integration tests: one tiny model and one real vLLM server per session.

The server is started with exactly the flags the product uses (`build_server_command`), so these
tests exercise the same control plane and gloo data plane as `make demo`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
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
