"""The sandbox an `agent_command` runs in on the reward service (agents.sandbox): the bwrap argv (environment cleared,
network shared, system folders and the agent's own files read-only) and, where bwrap runs on this machine, a real
sandboxed command that reads its row, calls a real `AgentEndpoint` and prints its reward, directly and through a real
reward service (`python -m async_grpo.rewards.server`); a service that cannot sandbox refuses to start."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from async_grpo.agents.endpoint import AgentEndpoint
from async_grpo.agents.remote import RemoteAgentRunner
from async_grpo.agents.sandbox import (
    NEVER_BOUND,
    SandboxedCommandAgent,
    bound_paths,
    check_agent_sandbox,
    sandbox_argv,
)
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.rewards.server import main
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.sandbox import SYSTEM_DIRS, SandboxSettings, SandboxUnavailable, locate_interpreter
from tests.agents.test_endpoint import TextClient
from tests.rewards.test_reward_server import start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-sandbox-token"
PROMPT = [{"role": "user", "content": "6*7?"}]
ALLOWED_ENV = {
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "PWD",
}  # fmt: skip  (bwrap's --chdir sets PWD)
# A stdlib-only agent program: reads its row, asks the endpoint once, reports what it sees on stderr, prints its reward.
AGENT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    row = json.loads(sys.stdin.readline())
    body = json.dumps({"model": "policy", "messages": row["prompt"]}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=30))
    text = reply["choices"][0]["message"]["content"]
    try:
        open(__file__, "a").close()
        writable = True
    except OSError:
        writable = False
    view = {"env": sorted(os.environ), "uid": os.getuid(), "cwd": os.getcwd(), "writable": writable,
            "visible": {p: os.path.exists(p) for p in row.get("probe", [])},
            "procs": len([p for p in os.listdir("/proc") if p.isdigit()])}
    print("VIEW " + json.dumps(view), file=sys.stderr)
    print(1.0 if text.strip() == row["answer"] else 0.0)
    """
)


def _sandbox_problem() -> str | None:
    try:
        check_agent_sandbox()
    except SandboxUnavailable as err:
        return str(err)
    return None


PROBLEM = _sandbox_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"bwrap cannot run here: {PROBLEM}")


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def program(tmp_path) -> list[str]:
    """The agent's argv: a Python under /usr (visible in the sandbox) on AGENT, in a folder of its own."""
    python = locate_interpreter(SandboxSettings())
    if python is None:
        pytest.skip("no Python under /usr to run inside the sandbox")
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT)
    return [python, str(folder / "agent.py")]


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def test_the_argv_clears_the_environment_shares_the_network_and_shows_the_system_read_only(tmp_path):
    script = tmp_path / "run.py"
    script.write_text("print(1)")
    env = {"PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": "http://10.0.0.7:8700/v1", "OPENAI_API_KEY": "ep-k"}
    argv = sandbox_argv(["python3", str(script), "--flag"], env, bwrap="/usr/bin/bwrap")
    assert argv[0] == "/usr/bin/bwrap" and argv[-4:] == ["--", "python3", str(script), "--flag"]
    options = argv[: argv.index("--")]
    assert {"--unshare-all", "--share-net", "--clearenv", "--die-with-parent", "--new-session"} <= set(options)
    assert "--unshare-net" not in options and "--bind" not in options  # the network shared; nothing writable
    assert options.index("--clearenv") < options.index("--setenv")
    assert dict(_pairs(options, "--setenv")) == {**env, "HOME": "/tmp", "TMPDIR": "/tmp"}
    shown = dict(_pairs(options, "--ro-bind"))
    for d in SYSTEM_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            assert shown[d] == d, d
    assert shown[os.path.realpath(script)] == str(script)  # its own file, read-only, at its own path
    assert options[options.index("--proc") + 1] == "/proc" and options[options.index("--tmpfs", 0) + 1] == "/dev/shm"
    assert options[-4:] == ["--remount-ro", "/", "--chdir", "/tmp"]  # binds before the read-only root
    own = next(i for i, a in enumerate(options) if a == "--ro-bind" and options[i + 2] == str(script))
    tmp = next(i for i, a in enumerate(options) if a == "--tmpfs" and options[i + 1] == "/tmp")
    assert own > tmp  # bound over the sandbox's tmpfs /tmp, where pytest's tmp_path lies


def test_the_platform_policy_knows_the_same_system_directories():
    from async_grpo.launch import k8s_policy

    assert k8s_policy.SYSTEM_DIRS == SYSTEM_DIRS  # the paths an agent_command may name off the workspace volume


def test_only_the_commands_own_existing_paths_are_bound(tmp_path):
    own, folder = tmp_path / "a.py", tmp_path / "data"
    own.write_text("")
    folder.mkdir()
    link = tmp_path / "environ"
    link.symlink_to("/proc/self/environ")  # a link to the server's own secrets: never bound
    root = tmp_path / "root"
    root.symlink_to("/")  # nor the whole host
    argv = ["python3", str(own), str(folder), str(link), "/proc/1/environ", "/usr/bin/python3", "rel/x.py",
            "--out=/etc/shadow", str(tmp_path / "missing"), str(own), "/", "/tmp/..", str(root)]  # fmt: skip
    assert bound_paths(argv) == [(str(own), str(own)), (str(folder), str(folder))]
    assert all(not any(s.startswith(d) for d in NEVER_BOUND) for s, _ in bound_paths(argv))


def test_a_missing_bwrap_is_refused_naming_agent_command(tmp_path, capsys):
    with pytest.raises(SandboxUnavailable, match="agent_command: .*bwrap was not found .*'/nowhere/bwrap'.*Fix:"):
        check_agent_sandbox("/nowhere/bwrap")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"reward_funcs": ["builtin:agent_reward"], "agent_command": ["python3", "a.py"],
                                      "python_tool_bwrap": "/nowhere/bwrap"}))  # fmt: skip
    assert main(["--config", str(config)]) == 2  # the reward service does not start without its sandbox
    err = capsys.readouterr().err
    assert err.startswith("error: agent_command: ") and "bwrap was not found" in err and "Fix:" in err


def serve(tok, body):
    """Serve an endpoint here (answering "42"), open a session and run `body(endpoint, session)`; (result, session)."""

    async def main_():
        endpoint = AgentEndpoint(tok)
        await endpoint.start()
        session = endpoint.open_session(TextClient(tok, ["42<|im_end|>"]), SamplingSettings(1, 100, 1.0), lambda: 3,
                                        max_turns=2)  # fmt: skip
        try:
            return await body(endpoint, session), session
        finally:
            await endpoint.aclose()

    return asyncio.run(main_())


def _view(log: str) -> dict:
    (line,) = [ln for ln in log.splitlines() if ln.startswith("VIEW ")]
    return json.loads(line.removeprefix("VIEW "))


@needs_bwrap
def test_a_sandboxed_command_reads_its_row_calls_the_endpoint_and_prints_its_reward(tok, program, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "never-inside")  # what a credential in the server's env would be
    bwrap = check_agent_sandbox()
    agent = SandboxedCommandAgent(program, bwrap=bwrap)
    folder = str(Path(program[1]).parent)
    row = {"prompt": PROMPT, "answer": "42", "probe": [str(REPO), "/root", "/work", folder, program[1]]}

    async def body(endpoint, session):
        return await agent.run(row, endpoint.url, session.key, 30.0)

    outcome, session = serve(tok, body)
    assert outcome.fault is None and outcome.value == 1.0, outcome.log
    assert len(session.calls) == 1  # the network is shared: the endpoint on this machine's loopback answered
    view = _view(outcome.log)
    assert set(view["env"]) <= ALLOWED_ENV and {"OPENAI_BASE_URL", "OPENAI_API_KEY"} <= set(view["env"])
    assert view["uid"] == 65534 and view["cwd"] == "/tmp" and view["writable"] is False
    # its own file only: not the repository, the host's HOME or the rest of its folder
    assert view["visible"] == {str(REPO): False, "/root": False, "/work": False, folder: True, program[1]: True}
    assert view["procs"] <= 3  # its own PID namespace: bwrap's init, the program (and its shell, if any)


@needs_bwrap
def test_a_sandboxed_command_past_its_timeout_is_killed_with_its_sandbox(tok, tmp_path):
    python = locate_interpreter(SandboxSettings())
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(120)\n")
    tag = f"hang-{uuid.uuid4().hex}"
    agent = SandboxedCommandAgent([python, str(script), tag], bwrap=check_agent_sandbox())

    async def body(endpoint, session):
        return await agent.run({"prompt": PROMPT}, endpoint.url, session.key, 1.0)

    outcome, _ = serve(tok, body)
    assert outcome.fault == "timeout" and outcome.value is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in psutil.process_iter(["cmdline"]) if tag in " ".join(p.info["cmdline"] or [])]
        if not left:
            break
        time.sleep(0.2)
    assert not left, [p.info["cmdline"] for p in left]


@needs_bwrap
def test_the_reward_service_runs_the_command_sandboxed(tok, program, tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    argv = program
    config.write_text(yaml.safe_dump({"reward_funcs": ["builtin:agent_reward"], "agent_command": argv}))
    monkeypatch.setenv("ASYNC_GRPO_REWARD_TOKEN", TOKEN)
    proc, url = start_server(config, tmp_path / "server.log")
    try:
        runner = RemoteAgentRunner(url, TOKEN, agent_command=argv)

        async def body(endpoint, session):
            row = {"prompt": PROMPT, "answer": "42", "probe": ["/root", str(tmp_path / "config.yaml")]}
            return await runner.run(row, endpoint.url, session.key, 30.0)

        outcome, session = serve(tok, body)
    finally:
        assert stop_server(proc) == 0, (tmp_path / "server.log").read_text()
    assert outcome.fault is None and outcome.value == 1.0, outcome.log
    assert len(session.calls) == 1
    view = _view(outcome.log)
    assert set(view["env"]) <= ALLOWED_ENV and view["uid"] == 65534
    assert view["visible"] == {"/root": False, str(tmp_path / "config.yaml"): False}
