"""The vLLM server command and environment: on the CPU build the model runs inside the engine-core process (the
in-process `uni` executor, kept by VLLM_ENABLE_V1_MULTIPROCESSING=0), unless the user asks for several workers."""

from __future__ import annotations

import os

import pytest

from async_grpo.inference.server import CPU_SERVER_ENV, build_server_command, server_env


def _executor(cmd: list[str]) -> str | None:
    flag = "--distributed-executor-backend"
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_cpu_build_runs_the_model_in_the_engine_core_process():
    assert _executor(build_server_command("m", port=1, cpu=True)) == "uni"
    assert _executor(build_server_command("m", port=1, cpu=False)) is None  # GPU: vLLM's own choice
    env = server_env(1, cpu=True)
    assert all(env[k] == v for k, v in CPU_SERVER_ENV.items())
    gpu_env = server_env(1, cpu=False)
    assert gpu_env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-parallel-size", "2"],
        ["-tp", "2"],
        ["--pipeline-parallel-size", "2"],
        ["--distributed-executor-backend", "mp"],
    ],
)
def test_several_workers_or_an_explicit_executor_keep_vllms_choice(extra):
    cmd = build_server_command("m", port=1, cpu=True, extra_args=extra)
    assert cmd.count("--distributed-executor-backend") == extra.count("--distributed-executor-backend")
    assert cmd[-len(extra) :] == extra
