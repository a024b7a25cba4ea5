"""Agents: train an unmodified agent (issue 51), a Python function or a program run once per episode against an
OpenAI-compatible endpoint in front of vLLM.

    loading   the `agent` / `agent_command` fields -> a checked function or program, and the program's environment
"""

from async_grpo.agents.loading import (
    AgentSpecError,
    agent_environment,
    check_agent_command,
    load_agent,
    parse_agent_spec,
)

__all__ = [
    "AgentSpecError",
    "agent_environment",
    "check_agent_command",
    "load_agent",
    "parse_agent_spec",
]
