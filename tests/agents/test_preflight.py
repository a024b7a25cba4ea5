"""Preflight of an agent (`preflight.inputs.check_agent`): on the local target the function is imported and its
signature checked, and the command's program looked up; on a cluster a file is only read (never imported) and a
module or a command is left to the image. `async-grpo validate` exits 2 with `agents.agent: ... Fix: ...`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from async_grpo import cli
from async_grpo.config import GRPOConfig
from async_grpo.preflight import CHECKS, preflight
from async_grpo.preflight.inputs import check_agent, probe_rewards

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def agent_file(tmp_path: Path) -> Path:
    path = tmp_path / "agent.py"
    path.write_text(
        textwrap.dedent(
            """
            import pathlib

            pathlib.Path(__file__).with_name("imported").write_text("yes")  # shows whether it ran


            async def run(row, base_url, api_key):
                return 1.0


            def one_arg(row):
                return 0.0
            """
        )
    )
    return path


def test_no_agent_is_nothing_to_check():
    assert check_agent(GRPOConfig(), local=True) == ([], [])
    assert "agent" in CHECKS


def test_a_good_function_passes_locally_and_a_wrong_signature_is_refused(agent_file):
    assert check_agent(GRPOConfig(agent=f"{agent_file}:run"), local=True) == ([], [])
    problems, _ = check_agent(GRPOConfig(agent=f"{agent_file}:one_arg"), local=True)
    assert [p.field for p in problems] == ["agents.agent"]
    assert "one_arg(row) cannot be called" in str(problems[0]) and "Fix: define it as def agent(row" in str(problems[0])
    problems, _ = check_agent(GRPOConfig(agent=f"{agent_file}:missing"), local=True)
    assert [p.field for p in problems] == ["agents.agent"] and "has no attribute 'missing'" in problems[0].message


def test_on_a_cluster_a_file_is_read_never_imported(agent_file):
    problems, notes = check_agent(GRPOConfig(agent=f"{agent_file}:run"), local=False)
    assert (problems, notes) == ([], [])
    problems, _ = check_agent(GRPOConfig(agent=f"{agent_file}:missing"), local=False)
    assert [p.field for p in problems] == ["agents.agent"] and "defines no 'missing'" in problems[0].message
    assert not (agent_file.parent / "imported").exists()  # not a line of it ran
    _, notes = check_agent(GRPOConfig(agent=f"{agent_file.parent}/elsewhere.py:run"), local=False)
    assert notes == [f"agent: '{agent_file.parent}/elsewhere.py:run' is not on this machine; it is read where it runs"]
    _, notes = check_agent(GRPOConfig(agent="acme_agents.react:run"), local=False)
    assert notes == ["agent: 'acme_agents.react:run' is resolved in the image that runs the episodes"]
    check_agent(GRPOConfig(agent=f"{agent_file}:run"), local=True)
    assert (agent_file.parent / "imported").read_text() == "yes"  # locally it is imported


def test_a_command_program_is_looked_up_locally_and_left_to_the_image_on_a_cluster(tmp_path):
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho 1\n")
    script.chmod(0o755)
    assert check_agent(GRPOConfig(agent_command=[str(script)]), local=True) == ([], [])
    missing = GRPOConfig(agent_command=[str(tmp_path / "nope"), "--x"])
    problems, _ = check_agent(missing, local=True)
    assert [p.field for p in problems] == ["agents.agent_command"] and "does not exist" in str(problems[0])
    problems, notes = check_agent(missing, local=False)
    assert problems == [] and "looked up in the image that runs the episodes" in notes[0]


def test_validate_exits_2_naming_the_field_and_the_fix(agent_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    code = cli.main(["validate", "examples/tiny_cpu.yaml", f"agent={agent_file}:one_arg", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: agents.agent: ")]
    assert len(lines) == 1 and "Fix: define it as def agent(row, base_url, api_key)" in lines[0], err


def test_the_cluster_preflight_passes_a_file_agent_it_only_read(agent_file):
    report = preflight(GRPOConfig(agent=f"{agent_file}:run"), target="cluster")
    assert report.ok, report.problems
    assert "agent" in report.checked and not (agent_file.parent / "imported").exists()


def test_reward_functions_taking_agent_reward_pass_the_probe():
    def uses_agent_reward(prompts, completions, completion_ids, agent_reward, **kwargs):
        return [float(r) for r in agent_reward]

    row = {"prompt": "reverse abc", "answer": "cba"}
    with_agent = GRPOConfig(agent="acme.agents:run")
    assert probe_rewards(with_agent, {"x.py:uses_agent_reward": uses_agent_reward}, row) == []
    problems = probe_rewards(GRPOConfig(), {"x.py:uses_agent_reward": uses_agent_reward}, row)
    assert [p.field for p in problems] == ["rewards.reward_funcs"]  # no agent: no agent_reward column
