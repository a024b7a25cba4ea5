"""The `agents` section: its fields load flat, dotted or nested, their syntax is checked without importing anything,
they declare their trust class, and an agent runs alone (no second agent, environment, tools or user producer)."""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError, GRPOConfig, lookup_field
from async_grpo.config.io import config_from_mapping
from async_grpo.config.sections import SECTIONS, AgentsConfig, EnvironmentsConfig
from async_grpo.config.trust import Trust, declared_trust


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_mapping(data)
    assert "Fix:" in str(err.value), str(err.value)
    return str(err.value)


def test_the_section_holds_the_four_fields_with_their_defaults_and_trust():
    assert SECTIONS["agents"] is AgentsConfig
    a = GRPOConfig().agents
    assert (a.agent, a.agent_command, a.agent_timeout_s, a.agent_endpoint_port) == (None, None, 300.0, 8700)
    assert {n: lookup_field(n).path for n in AgentsConfig.model_fields} == {
        "agent": "agents.agent",
        "agent_command": "agents.agent_command",
        "agent_timeout_s": "agents.agent_timeout_s",
        "agent_endpoint_port": "agents.agent_endpoint_port",
    }
    trust = {name: declared_trust(AgentsConfig, name).trust for name in AgentsConfig.model_fields}
    assert trust == {"agent": Trust.CODE, "agent_command": Trust.CODE, "agent_timeout_s": Trust.TENANT,
                     "agent_endpoint_port": Trust.PLATFORM}  # fmt: skip
    assert all(len(info.description or "") > 80 for info in AgentsConfig.model_fields.values())
    assert "agent/faults/max_turns" in EnvironmentsConfig.model_fields["max_turns"].description


def test_flat_dotted_and_nested_keys_load():
    flat = config_from_mapping({"agent": "my_agents.py:run", "agent_timeout_s": 60})
    dotted = config_from_mapping({"agents.agent": "my_agents.py:run", "agents.agent_timeout_s": 60})
    nested = config_from_mapping({"agents": {"agent": "my_agents.py:run", "agent_timeout_s": 60}})
    assert flat.agents == dotted.agents == nested.agents
    assert flat.agents.agent == "my_agents.py:run" and flat.agents.agent_timeout_s == 60.0
    command = config_from_mapping({"agent_command": ["python", "agent.py", "--fast"]})
    assert command.agents.agent_command == ["python", "agent.py", "--fast"]


@pytest.mark.parametrize(
    "data, says",
    [
        ({"agent": "builtin:react"}, "there are no builtin agents"),
        ({"agent": "openenv:pkg.mod:run"}, "wrap environments, not agents"),
        ({"agent": "verifiers:agents.py:run"}, "wrap environments, not agents"),
        ({"agent": "run_agent"}, "names no function. Fix: write it as `pkg.module:function`"),
        ({"agent_command": "python agent.py"}, "['python', 'agent.py']"),
        ({"agent_command": []}, "agent_command is an empty list"),
        ({"agent_command": ["python", ""]}, "agent_command[1] is an empty string"),
        ({"agent_command": ["py\x00thon"]}, "agent_command[0] holds a NUL byte"),
        ({"agent_timeout_s": 0}, "agents.agent_timeout_s"),
        ({"agent_timeout_s": float("inf")}, "agents.agent_timeout_s"),
    ],
)
def test_bad_syntax_is_refused_naming_the_field(data, says):
    message = refused(data)
    assert says in message, message


@pytest.mark.parametrize(
    "data, says",
    [
        ({"agent": "a.py:run", "agent_command": ["./agent"]}, "agent and agent_command are both set"),
        ({"agent": "a.py:run", "environment": "builtin:guess"}, "agent and environment are both set"),
        ({"agent_command": ["./agent"], "environment": "builtin:guess"}, "agent_command and environment are both"),
        ({"agent": "a.py:run", "tools": ["builtin:calculator"]}, "agent and tools are both set"),
        ({"agent_command": ["./agent"], "tools": ["builtin:calculator"]}, "agent_command and tools are both set"),
        ({"agent": "a.py:run", "data_producer": "p.py:make"}, "agent and data_producer are both set"),
        ({"agent_command": ["./agent"], "data_producer": "p.py:make"}, "agent_command and data_producer are both"),
    ],
)
def test_an_agent_runs_alone(data, says):
    message = refused(data)
    assert says in message, message
    fix = message.split("Fix:", 1)[1]
    assert all(name in fix for name in data), message  # the fix names the fields to keep or drop


def test_an_agent_with_its_limits_and_other_sections_passes():
    config = config_from_mapping(
        {"agent": "a.py:run", "agent_timeout_s": 30, "max_turns": 8, "reward_funcs": ["builtin:reverse_format"]}
    )
    assert config.agents.agent_timeout_s == 30.0 and config.environments.max_turns == 8


def test_the_endpoint_port_range_must_fit_the_tcp_ports():
    assert config_from_mapping({"agent_endpoint_port": 9000}).agents.agent_endpoint_port == 9000
    for port in (80, 65534):  # a privileged port; a range past 65535
        with pytest.raises(ConfigError, match="agent_endpoint_port"):
            config_from_mapping({"agent_endpoint_port": port})
