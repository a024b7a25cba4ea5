"""The local launcher serves `teacher_model_name_or_path` on a vLLM server of its own and points the run's
`teacher_url` at it (issue 52), as it serves the LLM judge. The server class is replaced by a recorder here: what is
checked is the wiring (its command, log, the config the run gets, and that `run_local` watches and closes it). The
teacher against a real vLLM server, scoring a sequence as long as the policy's context, is
tests/integration/test_teacher_server.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from async_grpo.config import load_config
from async_grpo.launch import local

from .test_judge_server import RecordedServer


@pytest.fixture
def recorded(monkeypatch):
    RecordedServer.started = []
    monkeypatch.setattr(local, "VLLMServer", RecordedServer)
    return RecordedServer.started


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_teacher_model_is_served_plain_one_token_longer_and_the_run_points_at_it(recorded, tmp_path):
    config = load_config(
        "examples/tiny_cpu.yaml",
        [f"output_dir={tmp_path / 'run'}", "teacher_model_name_or_path=/models/teacher", "vllm_max_model_len=384"],
    )
    served, server = local.start_teacher_server(config)
    assert recorded == [server]
    assert _flag(server.cmd, "--model") == "/models/teacher"
    assert _flag(server.cmd, "--max-model-len") == "384"  # the policy's (its client cuts a sequence that fills it)
    assert "--weight-transfer-config" not in server.cmd and "--worker-extension-cls" not in server.cmd
    assert server.log == tmp_path / "run" / "vllm-teacher.log" and server.log.parent.is_dir()
    assert server.url.startswith("http://127.0.0.1:")
    d = served.distillation
    assert d.teacher_url == f"{server.url}/v1" and d.teacher_model == "/models/teacher"
    assert d.teacher_model_name_or_path is None and d.enabled
    assert config.distillation.teacher_model_name_or_path == "/models/teacher"  # the caller's config is unchanged
    assert served.inference.vllm_max_model_len == 384  # the policy's own length is untouched


def test_a_top_k_teacher_above_vllms_default_is_served_with_max_logprobs(recorded, tmp_path):
    base = ["teacher_model_name_or_path=/models/teacher", "distillation_loss=forward_kl", f"output_dir={tmp_path}"]
    _, server = local.start_teacher_server(load_config("examples/tiny_cpu.yaml", [*base, "distillation_topk=64"]))
    assert _flag(server.cmd, "--max-logprobs") == "64"  # vLLM refuses prompt_logprobs above it (default 20)
    _, server = local.start_teacher_server(load_config("examples/tiny_cpu.yaml", [*base, "distillation_topk=20"]))
    assert "--max-logprobs" not in server.cmd  # vLLM's default serves it
    reverse = ["teacher_model_name_or_path=/models/teacher", "distillation_topk=64", f"output_dir={tmp_path}"]
    _, server = local.start_teacher_server(load_config("examples/tiny_cpu.yaml", reverse))
    assert "--max-logprobs" not in server.cmd  # reverse_kl asks no top-k


def test_no_teacher_model_starts_nothing(recorded, tmp_path):
    plain = load_config("examples/tiny_cpu.yaml", [f"output_dir={tmp_path}"])
    assert local.start_teacher_server(plain) == (plain, None)
    attached = load_config("examples/tiny_cpu.yaml", [f"output_dir={tmp_path}", "teacher_url=http://t:8000/v1"])
    assert local.start_teacher_server(attached) == (attached, None)
    assert recorded == []


def test_the_judge_keeps_its_own_command_beside_the_teacher(recorded, tmp_path):
    judged = ["reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", "judge_model_name_or_path=/models/j"]
    config = load_config("examples/tiny_cpu.yaml", [*judged, f"output_dir={tmp_path}"])
    _, judge = local.start_judge_server(config)
    assert _flag(judge.cmd, "--max-model-len") == str(config.inference.vllm_max_model_len)
    assert judge.cmd == local.local_server_command(config, "/models/j", int(judge.url.rsplit(":", 1)[1]))


class RecordedWatchdog:
    watched: list[RecordedWatchdog] = []

    def __init__(self, server, name):
        self.server, self.name, self.closed = server, name, False

    def start(self):
        RecordedWatchdog.watched.append(self)
        return self

    def close(self):
        assert not self.server.closed, "the watchdog is closed before its server"
        self.closed = True


def test_run_local_watches_the_judge_and_the_teacher_and_closes_both(recorded, monkeypatch, tmp_path):
    RecordedWatchdog.watched = []
    monkeypatch.setattr(local, "ServerWatchdog", RecordedWatchdog)
    monkeypatch.setattr(local, "check_config", lambda config, **kw: None)
    monkeypatch.setattr(local, "check_env", lambda: 1)
    monkeypatch.setattr(local, "init_distributed", lambda timeout_s: SimpleNamespace(is_main=True))
    monkeypatch.setattr(local, "close_distributed", lambda: None)
    monkeypatch.setattr(local, "GRPORecipe", lambda config, info, progress: None)
    seen = []

    def run_main(config, recipe):
        seen.append(config)
        assert all(not s.closed for s in recorded)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(local, "_run_main", run_main)
    judged = ["reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", "judge_model_name_or_path=/models/j"]
    config = load_config(
        "examples/tiny_cpu.yaml", [*judged, "teacher_model_name_or_path=/models/t", f"output_dir={tmp_path}"]
    )
    with pytest.raises(RuntimeError, match="the run failed"):
        local.run_local(config, progress=False)
    judge, teacher = recorded
    assert [w.name for w in RecordedWatchdog.watched] == ["the LLM judge", "the teacher"]
    assert all(w.closed for w in RecordedWatchdog.watched) and judge.closed and teacher.closed
    (run,) = seen
    assert run.rewards.judge_url == f"{judge.url}/v1" and run.distillation.teacher_url == f"{teacher.url}/v1"
    assert run.distillation.teacher_model_name_or_path is None
