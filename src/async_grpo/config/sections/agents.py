"""The `agents` section: train an unmodified agent (issue 51). A user names an agent, a Python function (`agent`) or a
program (`agent_command`), and the run's rollout becomes an agent rollout: once per episode the agent is handed the
dataset row and an OpenAI-compatible base URL and API key (a proxy in front of vLLM that records every model call
of the episode), and whatever it does with them is the episode.

Only the syntax is checked here (this package imports no user code and starts no program): the spec's form, the
argv's shape. Whether the spec imports to a function that takes `(row, base_url=, api_key=)`, or the command's
program exists, is checked by preflight (`preflight.inputs.check_agent`, with `agents.loading`) before vLLM starts.
The cross-field checks (one agent, and no environment, tools or user data producer beside it) are the rule
`config.rules.one_agent_drives_the_episodes`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, platform_only, tenant
from async_grpo.user_code import parse_spec, split_adapter

AGENT_FORMS = "`pkg.module:function` or `path/to/file.py:function`"
# Ports the agent endpoint may listen on when the agents run elsewhere (the reward pods): agent_endpoint_port and the
# next ones, one per event loop serving episodes at once (the orchestrator's, an in-run evaluation's); the run's
# NetworkPolicies open exactly this range from the reward pods to the trainer pods.
AGENT_ENDPOINT_PORT_COUNT = 4


class AgentsConfig(Section):
    """An agent trained as it is: a Python function or a program, run once per episode against the model endpoint."""

    agent: str | None = Field(
        None,
        description="The agent to train, a Python function: `pkg.module:function` or `path/to/file.py:function` (no "
        "`builtin:` forms), an `async def` or a plain `def`, called once per episode as `fn(row, base_url=..., "
        "api_key=...)`: `row` is the dataset row (a dict: `prompt` and every other column), `base_url` an "
        "OpenAI-compatible base URL ending in `/v1` and `api_key` the episode's own key (every model call made with "
        "it belongs to this episode). It returns the episode's reward (a number) or None; the return value reaches "
        "reward functions as the keyword column `agent_reward` (`builtin:agent_reward` returns it). Preflight "
        "imports it on the local target and refuses a signature that cannot take that call (exit 2, naming "
        "agents.agent). Exclusive with agent_command, environment, tools and data_producer. None: no agent.",
        json_schema_extra=code(),
    )
    agent_command: list[str] | None = Field(
        None,
        description="The agent to train, a program: an argv list (no shell; e.g. [python, my_agent.py]) run once "
        "per episode as a subprocess, with OPENAI_BASE_URL (the endpoint's base URL, ending in `/v1`) and "
        "OPENAI_API_KEY (the episode's own key) in an otherwise minimal environment (PATH, HOME, LANG, LC_ALL, "
        "TMPDIR, PYTHONPATH, VIRTUAL_ENV when set; never a credential), and the dataset row as one JSON line on "
        "stdin. Its last stdout line, when it parses as a JSON number (or null), is the return value "
        "(`agent_reward`, as for agent). A non-empty list of non-empty strings without NUL bytes; preflight "
        "refuses, on the local target, a program that is no executable file or is not found on PATH. Exclusive "
        "with agent, environment, tools and data_producer. None: no agent program.",
        json_schema_extra=code(),
    )
    agent_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="Wall-clock limit of one agent episode (seconds): past it the episode ends (the function's task "
        "is cancelled, the program killed) and is counted as agent/faults/timeout.",
        json_schema_extra=tenant(),
    )
    agent_endpoint_port: int = Field(
        8700,
        ge=1024,
        le=65535 - (AGENT_ENDPOINT_PORT_COUNT - 1),
        description="First TCP port of the agent endpoint when the agents run on the reward service (on Kubernetes, "
        "the reward pods): the endpoint listens on all interfaces on the first free port of agent_endpoint_port .. "
        f"agent_endpoint_port + {AGENT_ENDPOINT_PORT_COUNT - 1} (one per event loop serving episodes at once) and "
        "advertises the trainer pod's IP (env POD_IP); the run's NetworkPolicies open exactly that range from its "
        "reward pods to its trainer pods. Local runs (agents in the trainer process, or a reward service on "
        "loopback) keep 127.0.0.1 and a free port. Platform-only on a cluster: the port is opened into the pods "
        "that hold the credentials, so a tenant may not move it onto another listener there (torchrun's rendezvous, "
        "the weight-transfer sockets); leave it at its default.",
        json_schema_extra=platform_only(),
    )

    @field_validator("agent")
    @classmethod
    def _spec_syntax(cls, spec: str | None) -> str | None:
        """The spec looks like `pkg.module:function` or `path/file.py:function`: no builtin, no adapter prefix."""
        if spec is None:
            return spec
        if split_adapter(spec)[0] is not None:
            raise ValueError(
                f"agent spec {spec!r}: adapter prefixes (openenv:, verifiers:) wrap environments, not agents. Fix: "
                f"name the agent function as {AGENT_FORMS}."
            )
        if ":" not in spec:  # parse_spec would suggest `builtin:`, which agents do not have
            raise ValueError(
                f"agent spec {spec!r} names no function. Fix: write it as {AGENT_FORMS}, e.g. my_agent.py:run."
            )
        parsed = parse_spec(spec, what="agent spec", error=ValueError)
        if parsed.kind == "builtin":
            raise ValueError(
                f"agent spec {spec!r}: there are no builtin agents. Fix: name your agent function as {AGENT_FORMS}."
            )
        return spec

    @field_validator("agent_command", mode="before")
    @classmethod
    def _argv_not_a_shell_line(cls, value: Any) -> Any:
        """A string is a shell line, which is not run through a shell: refuse it with the list form as the fix."""
        if isinstance(value, str):
            raise ValueError(
                f"agent_command {value!r} is a string; it is run without a shell, as an argv list. Fix: write it as "
                f"a list, e.g. {value.split()!r}."
            )
        return value

    @field_validator("agent_command")
    @classmethod
    def _argv_shape(cls, argv: list[str] | None) -> list[str] | None:
        """A non-empty list of non-empty strings without NUL bytes (an exec argv)."""
        if argv is None:
            return argv
        if not argv:
            raise ValueError(
                "agent_command is an empty list. Fix: give the program and its arguments, e.g. [python, agent.py], "
                "or leave agent_command unset."
            )
        for i, arg in enumerate(argv):
            if not arg:
                raise ValueError(f"agent_command[{i}] is an empty string. Fix: drop it or give the argument.")
            if "\x00" in arg:
                raise ValueError(f"agent_command[{i}] holds a NUL byte, which no argv can carry. Fix: remove it.")
        return argv
