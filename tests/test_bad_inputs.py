"""Bad input is refused before anything starts: every case of tests/bad_inputs/ exits 2 through `async-grpo train`
and `async-grpo validate`, within 10 s, with a message that names the field and the fix, and no vLLM server is
launched; a few cases run as real subprocesses (no traceback, no vllm child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from async_grpo import cli
from async_grpo.inference.server import VLLMServer

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "tests" / "bad_inputs"
CASES = sorted((CORPUS / "configs").glob("*.yaml"))
MAX_CASE_S = 10.0
SUBPROCESS_LIMIT_S = 60.0  # interpreter start-up (torch, transformers) included; the check itself is timed below
EXPECT_EMPTY_FILE = "is empty"


def headers(path: Path) -> dict[str, list[str]]:
    """The case's `# key: value` header lines, {key: [values]}."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("# ") or ":" not in line:
            break
        key, value = line[2:].split(":", 1)
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def expected(path: Path) -> str:
    return headers(path).get("expect", [EXPECT_EMPTY_FILE])[0]


@pytest.fixture
def launches(monkeypatch):
    """Every VLLMServer.launch call (none may happen)."""
    calls = []
    monkeypatch.setattr(VLLMServer, "launch", lambda self: calls.append(self.command))
    return calls


@pytest.fixture
def case_env(monkeypatch, tmp_path):
    """Run from the repository root (the corpus' paths are relative to it), without MLFLOW_* or reward-service
    variables from the caller; returns a function that applies one case's `# env:` headers and output_dir."""
    monkeypatch.chdir(REPO_ROOT)
    for key in [k for k in os.environ if k.startswith("MLFLOW_") or k.startswith("ASYNC_GRPO_REWARD")]:
        monkeypatch.delenv(key)

    def apply(path: Path) -> list[str]:
        for item in headers(path).get("env", []):
            key, value = item.split("=", 1)
            monkeypatch.setenv(key, value)
        if "needs" in headers(path) and "no-cuda" in headers(path)["needs"]:
            import torch

            if torch.cuda.is_available():
                pytest.skip("the case needs a machine without CUDA")
        text = path.read_text()
        return [] if "output_dir:" in text else [f"output_dir={tmp_path / 'run'}"]

    return apply


def test_the_corpus_is_large_and_listed_in_its_readme():
    readme = (CORPUS / "README.md").read_text()
    assert len(CASES) >= 45
    unlisted = [p.name for p in CASES if f"`{p.name}`" not in readme]
    assert not unlisted, f"add a README row for {unlisted}"
    assert all(expected(p) for p in CASES)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
@pytest.mark.parametrize("command", ["train", "validate"])
def test_bad_input_exits_2_naming_the_field_before_anything_starts(path, command, case_env, launches, capsys):
    overrides = case_env(path)
    start = time.perf_counter()
    code = cli.main([command, str(path.relative_to(REPO_ROOT)), *overrides])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err
    assert errors and any(expected(path) in line for line in errors), err
    assert "Fix" in err, err
    assert "Traceback" not in err
    assert elapsed < MAX_CASE_S, f"{path.name} took {elapsed:.1f} s"
    assert launches == []


def test_a_missing_config_file_exits_2(case_env, capsys):
    assert cli.main(["validate", "tests/bad_inputs/configs/missing.yaml"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Fix" in err


def test_every_problem_is_reported_at_once(case_env, launches, capsys):
    code = cli.main(
        [
            "validate",
            "examples/tiny_cpu.yaml",
            "dataset=tests/bad_inputs/data/good.jsonl",
            "vllm_extra_args=[--seed=3]",
            "reward_url=http://127.0.0.1:9",
        ]
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2
    assert [line.split(":")[1].strip() for line in lines] == [
        "data.warmup_sft_steps",
        "inference.vllm_extra_args",
        "rewards.reward_url",
    ]


def test_a_missing_resume_checkpoint_override_exits_2_from_preflight(case_env, launches, capsys, tmp_path):
    """Issue 28: the command a new user typed (the demo config, the checkpoint as an override) exited 1 with a
    traceback from the recipe's setup after 11 s; preflight refuses it first (case 85 is the YAML form)."""
    start = time.perf_counter()
    code = cli.main(
        [
            "train",
            "examples/tiny_cpu.yaml",
            "resume_from_checkpoint=/nonexistent/checkpoint-7",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: checkpoint.resume_from_checkpoint: " in err and "Fix: point at a `checkpoint-<step>`" in err
    assert "Traceback" not in err and launches == []
    assert time.perf_counter() - start < MAX_CASE_S


def _vllm_children(proc: psutil.Process) -> set[int]:
    found = set()
    try:
        for child in proc.children(recursive=True):
            try:
                if any("vllm" in part for part in child.cmdline()):
                    found.add(child.pid)
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return found


@pytest.mark.parametrize(
    "case, args",
    [
        ("missing config file", ["tests/bad_inputs/configs/missing.yaml"]),
        ("yaml syntax error", ["tests/bad_inputs/configs/03_yaml_syntax_error.yaml"]),
        ("warm start on a user dataset", ["tests/bad_inputs/configs/20_warmup_sft_user_dataset.yaml"]),
        ("reward service unreachable", ["tests/bad_inputs/configs/52_reward_url_unreachable.yaml"]),
        ("output_dir not writable", ["tests/bad_inputs/configs/53_output_dir_inside_file.yaml"]),
    ],
)
def test_train_subprocess_exits_2_without_traceback_or_vllm(case, args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_grpo.cli", "train", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ps, seen, deadline = psutil.Process(proc.pid), set(), time.monotonic() + SUBPROCESS_LIMIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _vllm_children(ps)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    assert proc.returncode == 2, (out, err)
    assert any(line.startswith("error: ") for line in err.splitlines()) and "Fix" in err, err
    assert "Traceback" not in err
    assert not seen, f"vllm processes started: {seen}"
