"""The reward service's agent routes: the run's agent, run where tenant code runs.

`server.build_app` adds these routes when the run declares `agent` or `agent_command`, so on Kubernetes the agent's
episodes run in the reward pods (no credentials; they reach nothing but the agent endpoint in their run's trainer
pods, on the ports the NetworkPolicies open), and the trainer only serves the endpoint and sends each episode here
(`agents.remote.RemoteAgentRunner`). A function agent (`agent`) runs in the server's process, as an
`agents.execution.FunctionAgent`: it is tenant code in a credential-free pod, as the reward functions are. A command
(`agent_command`) runs in a fresh bubblewrap sandbox per episode (`agents.sandbox.SandboxedCommandAgent`): the
environment cleared but for the episode's endpoint and key, the system directories and its own files read-only, a
tmpfs /tmp, its own PID namespace, the network shared (it must reach the endpoint). The sandbox is tried once when the
server starts (`served_agent`): a server that cannot run it refuses to start (exit 2), naming `agent_command`.

An episode that fails (the agent raised, timed out, returned something that is not a reward) is a normal answer:
200 with the `AgentOutcome`, as a local runner returns it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from async_grpo.agents.execution import AgentRunner, FunctionAgent
from async_grpo.agents.loading import load_agent
from async_grpo.agents.remote import AGENT_RUN_PATH, AGENTS_PATH, AgentRunRequest, outcome_to_json
from async_grpo.agents.sandbox import SandboxedCommandAgent, check_agent_sandbox
from async_grpo.config import GRPOConfig

DISCONNECT_POLL_S = 1.0  # how often a running episode checks that its client is still connected, seconds
CLIENT_CLOSED = 499  # the status of an episode whose client left (nginx's "client closed request"; never read)


@dataclass(frozen=True)
class ServedAgent:
    """The run's agent as the reward service runs it.

    Attributes:
        runner: runs one episode (`FunctionAgent`, or `SandboxedCommandAgent` for a command); the app closes it.
        agent: the config's `agent` spec, or None.
        agent_command: the config's `agent_command` argv, or None.
        timeout_s: the config's `agent_timeout_s`: an episode asked for a longer time-out gets this one.
    """

    runner: AgentRunner
    agent: str | None
    agent_command: list[str] | None
    timeout_s: float

    def describe(self) -> dict[str, Any]:
        """What GET /v1/agents answers: {"agent", "agent_command", "timeout_s"}."""
        return {"agent": self.agent, "agent_command": self.agent_command, "timeout_s": self.timeout_s}


def served_agent(config: GRPOConfig) -> ServedAgent | None:
    """The run's agent for the reward service, or None when the config declares none.

    `agent` is imported here (`agents.loading.load_agent`: this runs the module's code, in the reward server) and
    run in `FunctionAgent`'s worker threads; `agent_command` is wrapped in the sandbox, which is tried once first
    (`agents.sandbox.check_agent_sandbox`, with the platform's `python_tool_bwrap` when set).

    Raises:
        AgentSpecError: the function does not import or cannot take `(row, base_url=, api_key=)` (a ValueError
            naming `agent` and the fix: the server exits with 2).
        SandboxUnavailable: the command's sandbox cannot run here (a ValueError naming `agent_command` and the fix).
    """
    a = config.agents
    if a.agent is not None:
        runner: AgentRunner = FunctionAgent(load_agent(a.agent))
    elif a.agent_command is not None:
        runner = SandboxedCommandAgent(a.agent_command, bwrap=check_agent_sandbox(config.tools.python_tool_bwrap))
    else:
        return None
    command = None if a.agent_command is None else list(a.agent_command)
    return ServedAgent(runner, a.agent, command, a.agent_timeout_s)


def add_agent_routes(app: FastAPI, agent: ServedAgent) -> None:
    """Add the agent routes to `app` (the caller closes `agent.runner` when the app stops).

    Routes:
        GET /v1/agents: `ServedAgent.describe()`; the trainer checks that the service runs its run's agent.
        POST /v1/agents/run: an `agents.remote.AgentRunRequest` -> 200 {"value", "fault", "log", "seconds"} (the
            episode's `AgentOutcome`, a failed episode included), 422 for a malformed request. The episode runs at
            most min(timeout_s, agent_timeout_s) seconds; when the client closes the connection (the trainer cancelled
            the episode) the episode is cancelled too (a command's sandbox killed).
    """

    @app.get(AGENTS_PATH)
    async def agents() -> dict[str, Any]:
        return agent.describe()

    @app.post(AGENT_RUN_PATH)
    async def run(req: AgentRunRequest, request: Request) -> Response:
        timeout_s = min(req.timeout_s, agent.timeout_s)
        episode = asyncio.ensure_future(agent.runner.run(req.row, req.base_url, req.api_key, timeout_s))
        try:
            while not episode.done():
                await asyncio.wait({episode}, timeout=DISCONNECT_POLL_S)
                if not episode.done() and await request.is_disconnected():
                    episode.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await episode
                    return Response(status_code=CLIENT_CLOSED)
        finally:
            if not episode.done():  # this request was cancelled (the server stopping): so is its episode
                episode.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await episode
        return JSONResponse(outcome_to_json(episode.result()))
