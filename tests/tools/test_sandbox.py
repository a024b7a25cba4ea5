"""`builtin:python`: model-written code in a real bubblewrap sandbox (no mocks). Each attack (the network, writes
outside the sandbox's home, the host's environment and files, a fork bomb, memory, gigabytes of output, CPU) is
contained, comes back as a tool error the model reads, leaves no process behind, and the next call still works.
Skipped, with the reason, only where bwrap cannot run on this machine."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from async_grpo.config import GRPOConfig
from async_grpo.preflight.inputs import check_python_sandbox, check_tools
from async_grpo.rewards.tool_routes import tool_executor
from async_grpo.tools.builtin import NO_OUTPUT, python_outcome
from async_grpo.tools.executor import FAILURE_KINDS, ToolExecutor, ToolFailure, ToolOutcome
from async_grpo.tools.loading import load_tools
from async_grpo.tools.sandbox import (
    CODE_FILE,
    SandboxSettings,
    SandboxUnavailable,
    check_sandbox,
    locate_bwrap,
    run_python,
)

REPO = Path(__file__).resolve().parents[2]
# The attacks that must fail for their own reason (an exception, the memory or output limit) get a wall clock far
# above their run time, so a loaded machine (CI's two cores under `-n 2`) cannot turn them into timeouts; the fork
# bomb, which must end by the wall clock, gets its own short one (BOMB_LIMITS).
LIMITS = SandboxSettings(timeout_s=20.0, cpu_seconds=1, memory_mb=256, max_processes=16, output_bytes=4096)
BOMB_LIMITS = dataclasses.replace(LIMITS, timeout_s=3.0)


def _sandbox_problem() -> str | None:
    try:
        check_sandbox(LIMITS)
    except SandboxUnavailable as err:
        return str(err)
    return None


PROBLEM = _sandbox_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"bwrap cannot run here: {PROBLEM}")


def sandbox_pids() -> set[int]:
    """Live processes of any sandboxed run on this machine (bwrap, the bootstrap and the code all carry CODE_FILE in
    their command line), wherever they were reparented."""
    pids = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(CODE_FILE in a for a in p.info["cmdline"] or ()):
                pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def assert_no_stray_processes(before: set[int]) -> None:
    deadline = time.monotonic() + 10.0  # polled: a quiet machine is done within milliseconds
    while (left := sandbox_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes left running: {left}"


def _executor(limits: SandboxSettings) -> ToolExecutor:
    """One spawned tool worker running builtin:python with `limits` (the path a run uses)."""
    if PROBLEM is not None:
        pytest.skip(f"bwrap cannot run here: {PROBLEM}")
    return ToolExecutor(
        load_tools(["builtin:python"]), num_workers=1, timeout_s=limits.timeout_s + 10.0, python_sandbox=limits
    )


@pytest.fixture(scope="module")
def executor():
    with _executor(LIMITS) as ex:
        yield ex


@pytest.fixture(scope="module")
def bomb_executor():
    with _executor(BOMB_LIMITS) as ex:
        yield ex


def call(ex: ToolExecutor, code: str) -> ToolOutcome:
    return ex.submit("python", {"code": code}).result(timeout=60)


def attack(ex: ToolExecutor, code: str) -> ToolOutcome:
    """Run `code`; check nothing of it outlives the call and that the next call works (the run continues)."""
    before = sandbox_pids()
    outcome = call(ex, code)
    assert_no_stray_processes(before)
    assert outcome.content.startswith("error: ") and outcome.failure in FAILURE_KINDS, outcome
    after = call(ex, "print(2+3)")
    assert (after.content, after.failure) == ("5", None), after
    return outcome


@needs_bwrap
def test_a_normal_call_returns_what_it_prints(executor):
    assert call(executor, "print(2+3)") == ToolOutcome("5", None, pytest.approx(0.0, abs=30))
    multi = call(executor, "import math\nfor i in range(3):\n    print(i, math.factorial(i + 3))")
    assert multi.content == "0 6\n1 24\n2 120" and multi.ok
    assert call(executor, "x = 1").content == NO_OUTPUT
    home = call(
        executor,
        "import os\nopen('f.txt', 'w').write('hi')\nprint(os.getcwd(), os.environ['HOME'], open('f.txt').read())",
    )
    assert home.content == "/tmp /tmp hi"  # the private tmpfs is writable, HOME and the working directory
    raised = call(executor, "def f():\n    return 1 / 0\nf()")
    assert raised.failure == "exception" and raised.content.endswith("ZeroDivisionError: division by zero")


@needs_bwrap
def test_the_network_is_unreachable(executor):
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    with server:
        local = attack(executor, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert local.failure == "exception" and "ConnectionRefusedError" in local.content  # its own empty loopback
        outside = attack(executor, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
        assert outside.failure == "exception" and "Network is unreachable" in outside.content
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener


@needs_bwrap
def test_writes_outside_the_home_fail_and_host_files_are_unchanged(executor, tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    targets = ["/usr/evil.txt", "/etc/evil.txt", "/evil.txt", "/dev/evil", "/proc/sys/kernel/hostname"]
    targets += [str(REPO / "evil.txt"), str(REPO / "pyproject.toml"), str(host_file)]
    for target in targets:
        outcome = attack(executor, f"open({target!r}, 'w').write('pwned')")
        assert outcome.failure == "exception" and "Error" in outcome.content, (target, outcome)
    assert host_file.read_text() == "original"
    assert (
        not (REPO / "evil.txt").exists() and not Path("/usr/evil.txt").exists() and not Path("/etc/evil.txt").exists()
    )
    # the repository, /root, /home, /work and the host's /tmp are not there at all
    listing = call(executor, "import json, os\nprint(json.dumps([os.listdir('/'), os.listdir('/tmp')]))")
    root, home = json.loads(listing.content)
    assert set(root) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "proc", "sbin", "tmp", "usr"} and home == [
        CODE_FILE
    ]


@needs_bwrap
def test_the_hosts_environment_and_files_are_invisible(tmp_path, monkeypatch):
    secret = "s3cr3t-token-for-the-sandbox-test"
    monkeypatch.setenv("ASYNC_GRPO_SANDBOX_TEST_SECRET", secret)
    host_file = tmp_path / "credentials.txt"
    host_file.write_text(secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try: print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError as e: print(pid, e)\n"
        f"print(open({str(host_file)!r}).read())\n"
    )
    result = run_python(code, LIMITS)  # from this very process, which holds the secret
    assert secret not in result.output and "ASYNC_GRPO_SANDBOX_TEST_SECRET" not in result.output
    assert "'PATH': '/usr/local/bin:/usr/bin:/bin'" in result.output and "FileNotFoundError" in result.output
    for path in ("/root", "/work", "/home", str(REPO)):
        probe = run_python(f"import os\nprint(os.listdir({path!r}))", LIMITS)
        assert probe.returncode == 1 and "FileNotFoundError" in probe.output, (path, probe)


@needs_bwrap
def test_a_fork_bomb_is_contained_and_cleaned_up(executor, bomb_executor):
    # the limit holds: forks past max_processes fail inside (16 with the sandbox's init and the interpreter)
    counted = call(
        executor,
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint('forked', n)",
    )
    assert counted.ok and counted.content == f"forked {LIMITS.max_processes - 2}", counted
    # a real bomb: every process forks forever; it runs into the wall clock and the whole sandbox is killed
    peak, stop = [0], threading.Event()
    base = len(sandbox_pids())

    def watch() -> None:  # the sandbox's processes only (a fork keeps its parent's command line), wherever they run
        while not stop.is_set():
            peak[0] = max(peak[0], len(sandbox_pids()) - base)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        bomb = attack(
            bomb_executor, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        )
    finally:
        stop.set()
        watcher.join()
    assert bomb.failure == "timeout" and bomb.content.startswith("error: timeout after 3 s")
    assert time.monotonic() - t0 < 15
    # the watcher saw the bomb fill its sandbox (17 here: the limit and bwrap), and never more than the limit allows
    assert LIMITS.max_processes // 2 <= peak[0] <= LIMITS.max_processes + 2, f"{peak[0]} sandbox processes at most"


@needs_bwrap
def test_memory_past_the_limit_fails_inside(executor):
    outcome = attack(executor, "x = bytearray(1 << 30)")
    assert outcome.failure == "crashed" and outcome.content.startswith("error: memory limit of 256 MiB exceeded")
    grown = attack(executor, "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert grown.failure == "crashed" and "MemoryError" in grown.content


@needs_bwrap
def test_gigabytes_of_output_are_cut_and_the_program_killed_fast(executor):
    t0 = time.monotonic()
    outcome = attack(executor, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert outcome.failure == "output_limit" and "output limit of 4096 bytes exceeded" in outcome.content
    assert outcome.seconds < 10.0 and time.monotonic() - t0 < 30  # the output limit ended it, not the 20 s clock
    result = run_python("print('y' * 10**8)", LIMITS)  # one print of 100 MB, stderr too
    assert result.truncated and result.returncode is None and len(result.output.encode()) == LIMITS.output_bytes


@needs_bwrap
def test_cpu_time_past_the_limit_kills_the_program():
    settings = SandboxSettings(timeout_s=30.0, cpu_seconds=1)
    result = run_python("while True:\n    pass", settings)
    assert result.returncode in (128 + 24, 128 + 9) and result.seconds < 30  # SIGXCPU, or SIGKILL at the hard limit
    with pytest.raises(ToolFailure) as err:
        python_outcome(result, 1, 512, 30.0, 16384)
    assert err.value.kind == "crashed" and err.value.message.startswith("CPU time limit of 1 s exceeded")


# ------------------------------------------------------------------ refusal, opt-out, config
def test_a_missing_bwrap_is_refused_naming_the_field_and_the_fix(tmp_path):
    missing = str(tmp_path / "no-such-bwrap")
    assert locate_bwrap(missing) is None
    with pytest.raises(SandboxUnavailable, match=r"python_tool_sandbox='bwrap'.*bwrap was not found.*Fix:.*none"):
        check_sandbox(SandboxSettings(bwrap=missing))
    config = GRPOConfig(tools=["builtin:python"], python_tool_bwrap=missing)
    with pytest.raises(SandboxUnavailable, match="python_tool_sandbox"):
        tool_executor(config)  # the run's set-up (and the reward service's start): before vLLM or any worker
    [problem] = check_python_sandbox(config)  # async-grpo validate, local target
    assert problem.field == "tools.python_tool_sandbox" and "Fix:" in problem.message
    assert check_tools(config, local=True) == ([problem], [])
    problems, notes = check_tools(config, local=False)  # a cluster run: checked where the calls run
    assert problems == [] and any("reward service's start" in note for note in notes)
    with pytest.raises(ToolFailure) as err:  # should bwrap vanish after set-up, a call is an error, not a raise
        python_outcome(run_python("print(1)", SandboxSettings(bwrap=missing)), 5, 512, 8.0, 16384)
    assert err.value.kind == "sandbox" and "bwrap not found" in err.value.message


def test_a_bwrap_that_cannot_create_the_sandbox_is_refused_with_its_error():
    with tempfile.TemporaryDirectory() as folder:  # readable by uid 65534, which runs bwrap when tests run as root
        os.chmod(folder, 0o755)
        fake = Path(folder) / "bwrap"  # what bwrap says where user namespaces are not allowed
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        _refused_with_bwraps_error(SandboxSettings(bwrap=str(fake)))


def _refused_with_bwraps_error(settings: SandboxSettings) -> None:
    with pytest.raises(SandboxUnavailable, match="does not run here: bwrap: No permissions to create new namespace"):
        check_sandbox(settings)
    with pytest.raises(ToolFailure) as err:
        python_outcome(run_python("print(1)", settings), 5, 512, 8.0, 16384)
    assert err.value.kind == "sandbox" and err.value.message.startswith("the sandbox did not start: bwrap: No perm")


def test_the_opt_out_runs_unsandboxed_with_a_loud_warning(tmp_path, caplog):
    settings = SandboxSettings(mode="none", timeout_s=3.0, bwrap=str(tmp_path / "no-such-bwrap"))
    with caplog.at_level(logging.WARNING, logger="async_grpo.tools.sandbox"):
        check_sandbox(settings)  # no bwrap needed
    assert "UNSANDBOXED" in caplog.text
    assert run_python("print(2+3)", settings).output == "5\n"
    before = sandbox_pids()
    slow = run_python("import time\ntime.sleep(60)", settings)
    assert slow.timed_out and slow.seconds < 10
    assert_no_stray_processes(before)
    config = GRPOConfig(tools=["builtin:python"], python_tool_sandbox="none", python_tool_bwrap=str(tmp_path / "x"))
    executor = tool_executor(config)
    executor.close()


def test_the_config_fields_and_their_checks():
    config = GRPOConfig(tools=["builtin:python"])
    t = config.tools
    assert (t.python_tool_sandbox, t.python_tool_timeout_s, t.python_tool_memory_mb) == ("bwrap", 8.0, 512)
    assert SandboxSettings.from_section(t) == SandboxSettings()
    with pytest.raises(ValidationError, match="python_tool_timeout_s=10 must be below tool_timeout_s=10"):
        GRPOConfig(tools=["builtin:python"], python_tool_timeout_s=10)
    GRPOConfig(tools=["builtin:calculator"], python_tool_timeout_s=10)  # only with builtin:python
    for bad in ({"python_tool_sandbox": "docker"}, {"python_tool_max_processes": 1}, {"python_tool_output_bytes": 0}):
        with pytest.raises(ValidationError):
            GRPOConfig(tools=["builtin:python"], **bad)
    with pytest.raises(ValueError, match="python_tool_sandbox='docker'"):
        SandboxSettings(mode="docker")


def test_the_schema_the_chat_template_renders():
    [tool] = load_tools(["builtin:python"])
    assert tool.name == "python" and tool.parameters["required"] == ["code"]
    assert tool.parameters["properties"]["code"]["type"] == "string"
    assert "sandbox" in tool.schema["function"]["description"]


@needs_bwrap
def test_the_configs_limits_reach_the_tool_workers():
    """`tools: [builtin:python]` through the run's set-up path (`tool_executor`: the check, then the workers)."""
    config = GRPOConfig(tools=["builtin:python"], python_tool_output_bytes=10, tool_num_workers=1)
    with tool_executor(config) as executor:
        assert call(executor, "print(6 * 7)").content == "42"
        capped = call(executor, "print('z' * 100)")
    assert capped.failure == "output_limit" and capped.content.startswith("error: output limit of 10 bytes exceeded")
