"""The local launcher serves `judge_model_name_or_path` on a vLLM server of its own and points the run's
`judge_url` at it (issue 26). The server class is replaced by a recorder here: what is checked is the wiring (its
command, log, and the config the run gets). A real launched judge, killed mid-run and restarted, is measured in
docs/rewards.md; the judge against a real vLLM server is tests/integration/test_judge.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.config import load_config
from async_grpo.launch import local


class RecordedServer:
    started: list[RecordedServer] = []

    def __init__(self, cmd, env, log, url, startup_timeout_s):
        self.cmd, self.env, self.log, self.url, self.timeout = cmd, env, Path(log), url, startup_timeout_s
        self.closed = False

    def start(self):
        RecordedServer.started.append(self)
        return self

    def close(self):
        self.closed = True


@pytest.fixture
def recorded(monkeypatch):
    RecordedServer.started = []
    monkeypatch.setattr(local, "VLLMServer", RecordedServer)
    return RecordedServer.started


def test_the_judge_model_is_served_and_the_run_points_at_it(recorded, tmp_path):
    judged = ["reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", f"output_dir={tmp_path / 'run'}"]
    config = load_config("examples/tiny_cpu.yaml", [*judged, "judge_model_name_or_path=/models/judge-7b"])
    served, server = local.start_judge_server(config)
    assert recorded == [server]
    assert server.cmd[server.cmd.index("--model") + 1] == "/models/judge-7b"
    assert server.log == tmp_path / "run" / "vllm-judge.log"
    assert served.rewards.judge_url == f"{server.url}/v1" and served.rewards.judge_model == "/models/judge-7b"
    assert served.rewards.judge_model_name_or_path is None and config.rewards.judge_model_name_or_path is not None


def test_no_judge_model_starts_nothing(recorded, tmp_path):
    attached = load_config(
        "examples/tiny_cpu.yaml",
        [
            "reward_funcs=[builtin:llm_judge]",
            "reward_weights=[1.0]",
            "judge_url=http://judge:8000/v1",
            f"output_dir={tmp_path}",
        ],
    )
    assert local.start_judge_server(attached) == (attached, None)
    unused = load_config("examples/tiny_cpu.yaml", ["judge_model_name_or_path=/models/j", f"output_dir={tmp_path}"])
    assert local.start_judge_server(unused) == (unused, None)  # no builtin:llm_judge among the rewards
    assert recorded == []
