"""The agent's spec and program, checked before anything starts (`agents.loading`): the spec parses without importing,
a function that cannot be called as `fn(row, base_url=, api_key=)` is refused naming `agent` and the fix, a command's
program must be an executable here, and the program's environment carries nothing of ours but the essentials."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from async_grpo.agents import AgentSpecError, agent_environment, check_agent_command, load_agent, parse_agent_spec
from async_grpo.agents.loading import INHERITED_ENV

AGENTS = """
import functools


def sync_agent(row, base_url, api_key):
    return 1.0


async def async_agent(row, *, base_url, api_key):
    return None


def keyword_catchall(row, **kwargs):
    return 0.5


def one_arg(row):
    return 0.0


def no_row(base_url, api_key):
    return 0.0


def positional_only(row, base_url, api_key, /):
    return 0.0


def needs_more(row, base_url, api_key, tools):
    return 0.0


def yields(row, base_url, api_key):
    yield 1.0


class AgentClass:
    def __init__(self, row, base_url, api_key):
        pass


bound = functools.partial(needs_more, tools=[])
NOT_CALLABLE = 3
"""


@pytest.fixture
def agents_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_agents.py"
    path.write_text(textwrap.dedent(AGENTS))
    return path


def test_a_spec_parses_without_importing_and_refuses_builtins_and_adapters(tmp_path):
    parsed = parse_agent_spec("no_such_pkg.agents:run")  # nothing is imported: the module need not exist
    assert (parsed.kind, parsed.target, parsed.name) == ("module", "no_such_pkg.agents", "run")
    parsed = parse_agent_spec(f"{tmp_path}/missing.py:run")
    assert (parsed.kind, parsed.name) == ("file", "run") and parsed.is_file
    for bad, match in [
        ("builtin:react", r"no builtin agents\. Fix:"),
        ("openenv:pkg.mod:run", r"adapter prefixes .* not agents\. Fix:"),
        ("verifiers:my_agents.py:run", r"adapter prefixes"),
        ("just_a_name", r"names no function\. Fix:"),
        ("pkg.mod:not-an-id", r"is not a function name"),
        (None, r"names no function"),
    ]:
        with pytest.raises(AgentSpecError, match=match):
            parse_agent_spec(bad)


@pytest.mark.parametrize(
    "name, returns", [("sync_agent", 1.0), ("async_agent", None), ("keyword_catchall", 0.5), ("bound", 0.0)]
)
def test_sync_and_async_functions_that_take_the_episode_call_are_accepted(agents_file, name, returns):
    fn = load_agent(f"{agents_file}:{name}")
    out = fn({"prompt": "p", "answer": "a"}, base_url="http://127.0.0.1:1/v1", api_key="k")
    assert (asyncio.run(out) if inspect.iscoroutine(out) else out) == returns


def test_a_module_spec_is_imported_and_judged_like_a_file():
    with pytest.raises(AgentSpecError, match=r"cannot be called as join\(row, base_url=\.\.\., api_key=\.\.\.\)"):
        load_agent("posixpath:join")  # join(a, *p): no base_url keyword
    with pytest.raises(AgentSpecError, match=r"cannot import 'no_such_pkg_xyz\.agents'.*Fix:"):
        load_agent("no_such_pkg_xyz.agents:run")


@pytest.mark.parametrize(
    "name, found",
    [
        ("one_arg", r"one_arg\(row\)"),
        ("no_row", r"no_row\(base_url, api_key\)"),
        ("positional_only", r"positional_only\(row, base_url, api_key, /\)"),
        ("needs_more", r"needs_more\(row, base_url, api_key, tools\)"),
    ],
)
def test_a_signature_that_cannot_take_the_episode_call_is_refused_naming_it_and_the_fix(agents_file, name, found):
    with pytest.raises(AgentSpecError) as err:
        load_agent(f"{agents_file}:{name}")
    message = str(err.value)
    assert message.startswith(f"agent '{agents_file}:{name}'")
    assert re.search(found, message), message
    assert "Fix: define it as def agent(row, base_url, api_key)" in message


@pytest.mark.parametrize(
    "name, match",
    [
        ("AgentClass", r"AgentClass is a class.*Fix: point at a function"),
        ("yields", r"yields is a generator function.*Fix:"),
        ("NOT_CALLABLE", r"a int, not a callable"),
        ("missing", r"has no attribute 'missing'.*callables there"),
    ],
)
def test_a_class_a_generator_or_a_non_callable_is_refused(agents_file, name, match):
    with pytest.raises(AgentSpecError, match=match):
        load_agent(f"{agents_file}:{name}")


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(AgentSpecError, match=r"does not exist\. Fix:"):
        load_agent(f"{tmp_path}/nope.py:run")


def test_a_command_needs_an_executable_program(tmp_path, monkeypatch):
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho 1.0\n")
    script.chmod(0o755)
    check_agent_command([str(script), "--flag"])  # an absolute path to an executable file
    monkeypatch.chdir(tmp_path)
    check_agent_command(["./agent.sh"])  # relative to the working directory, as subprocess resolves it
    monkeypatch.setenv("PATH", str(tmp_path))
    check_agent_command(["agent.sh", "--flag"])  # a bare name found on PATH
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    with pytest.raises(AgentSpecError, match=r"no program 'agent.sh' on PATH\. Fix:"):
        check_agent_command(["agent.sh"])  # not looked up in the working directory, as exec does not
    check_agent_command([sys.executable, "-c", "print(1)"])

    plain = tmp_path / "agent.py"
    plain.write_text("print(1.0)\n")
    plain.chmod(0o644)
    with pytest.raises(AgentSpecError) as err:
        check_agent_command([str(plain)])
    assert "agent_command" in str(err.value) and "is not executable by this user" in str(err.value)
    assert f"[python, {plain}]" in str(err.value)  # the fix: run it through its interpreter

    with pytest.raises(AgentSpecError, match=r"agent_command .*does not exist\. Fix:"):
        check_agent_command([str(tmp_path / "missing")])
    with pytest.raises(AgentSpecError, match=r"agent_command .*is not a regular file\. Fix:"):
        check_agent_command([str(tmp_path)])
    with pytest.raises(AgentSpecError, match=r"agent_command .*no program 'no-such-agent-xyz' on PATH\. Fix:"):
        check_agent_command(["no-such-agent-xyz"])


@pytest.mark.parametrize("argv", [[], [""], ["python", ""], ["py\x00thon"]])
def test_a_malformed_argv_is_refused(argv):
    with pytest.raises(AgentSpecError, match=r"agent_command .* not an argv list.*Fix:"):
        check_agent_command(argv)


def test_the_programs_environment_holds_the_endpoint_and_nothing_secret(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "mlflow-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "the-trainers-own-key")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.delenv("LC_ALL", raising=False)
    env = agent_environment("http://127.0.0.1:9000/v1", "episode-key")
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9000/v1"
    assert env["OPENAI_API_KEY"] == "episode-key"  # the episode's key, never ours
    assert env["PATH"] == "/usr/bin:/bin" and env["LANG"] == "C.UTF-8" and "LC_ALL" not in env
    assert set(env) <= {"OPENAI_BASE_URL", "OPENAI_API_KEY", *INHERITED_ENV}
    assert not {"MLFLOW_TRACKING_TOKEN", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & set(env)
    assert not any("secret" in value for value in env.values())
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "mlflow-secret"  # ours is untouched
