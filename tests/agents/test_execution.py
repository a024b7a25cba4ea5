"""Running one agent episode (agents.execution): a function (async or plain) or a command, its return value as the
reward, and every fault a counted kind with the output's tail kept; a command gets no credential from this process,
and a command past its time-out is killed with its children."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time

import pytest

from async_grpo.agents.execution import LOG_TAIL_CHARS, CommandAgent, FunctionAgent, return_value

ROW = {"prompt": [{"role": "user", "content": "hi"}], "answer": "7"}


def run(agent, timeout_s=5.0):
    try:
        return asyncio.run(agent.run(ROW, "http://127.0.0.1:9/v1", "ep-key", timeout_s))
    finally:
        agent.close()


async def async_agent(row, base_url, api_key):
    return float(row["answer"]) + (base_url == "http://127.0.0.1:9/v1") + (api_key == "ep-key")


def sync_agent(row, base_url, api_key):
    return int(row["answer"])


def test_return_values():
    assert run(FunctionAgent(async_agent)).value == 9.0
    out = run(FunctionAgent(sync_agent))
    assert (out.value, out.fault) == (7.0, None)
    assert return_value(None) == (None, None)
    for bad in (True, float("nan"), float("inf"), "1.0", {"reward": 1}):
        assert return_value(bad) == (None, "bad_return")


def test_function_faults_are_counted_kinds():
    async def raises(row, base_url, api_key):
        raise RuntimeError("the agent's own bug")

    async def hangs(row, base_url, api_key):
        await asyncio.sleep(60)

    def hangs_in_a_thread(row, base_url, api_key):
        time.sleep(2)

    def returns_text(row, base_url, api_key):
        return "great"

    out = run(FunctionAgent(raises))
    assert out.fault == "exception" and "the agent's own bug" in out.log and out.value is None
    started = time.monotonic()
    assert run(FunctionAgent(hangs), timeout_s=0.3).fault == "timeout"
    assert run(FunctionAgent(hangs_in_a_thread), timeout_s=0.3).fault == "timeout"  # the thread is abandoned
    assert time.monotonic() - started < 1.9
    out = run(FunctionAgent(returns_text))
    assert out.fault == "bad_return" and "'great'" in out.log


def script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_a_command_reads_the_row_and_prints_its_reward_without_our_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "secret-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-key")
    argv = script(
        tmp_path,
        """
        import json, os, sys
        row = json.loads(sys.stdin.readline())
        leaked = [k for k in os.environ if "SECRET" in k or "TOKEN" in k]
        print("thinking...", file=sys.stderr)
        print(json.dumps({"leaked": leaked, "url": os.environ["OPENAI_BASE_URL"], "key": os.environ["OPENAI_API_KEY"]}))
        print(float(row["answer"]) / 10)
    """,
    )
    out = run(CommandAgent(argv))
    assert (out.value, out.fault) == (0.7, None)
    first = json.loads(out.log.splitlines()[0])
    assert first == {"leaked": [], "url": "http://127.0.0.1:9/v1", "key": "ep-key"}
    assert "thinking..." in out.log


def test_command_faults(tmp_path):
    out = run(CommandAgent(script(tmp_path, "import sys; print('x' * 5000); sys.exit(3)")))
    assert out.fault == "exception" and "[exit code 3]" in out.log and len(out.log) <= LOG_TAIL_CHARS
    out = run(CommandAgent(script(tmp_path, "print('no number here')")))
    assert (out.value, out.fault) == (None, None)  # prose output: no return value, not a fault
    out = run(CommandAgent(script(tmp_path, "print('true')")))
    assert out.fault == "bad_return"
    out = run(CommandAgent([str(tmp_path / "missing")]))
    assert out.fault == "exception" and "could not start" in out.log


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    argv = script(
        tmp_path,
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
    """,
    )
    out = run(CommandAgent(argv), timeout_s=2.0)
    assert out.fault == "timeout" and "started" in out.log
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent, init here) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("exit_code", [0, 1])
def test_children_left_by_a_finished_command_are_ended(tmp_path, exit_code):
    pid_file = tmp_path / "child.pid"
    argv = script(
        tmp_path,
        f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print(1.0)
        sys.exit({exit_code})
    """,
    )
    run(CommandAgent(argv))
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)
