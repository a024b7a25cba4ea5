"""Agent episodes on the reward service: the trainer-side client of its agent route (`rewards.agent_routes`).

On Kubernetes the agent is tenant code, so it runs where tenant code runs: in the run's reward pods, which hold no
credentials and reach nothing but, for an agent run, the agent endpoint in the trainer pod (the run's
NetworkPolicies open exactly its ports, `config.sections.agents.AGENT_ENDPOINT_PORT_COUNT` from
`agent_endpoint_port`). A function agent runs in the reward server's process, a command in a bubblewrap sandbox there
(`agents.sandbox`). The trainer keeps the endpoint (`agents.endpoint.AgentEndpoint`, listening on all interfaces and
advertising the pod's own IP, `endpoint_binding`) and sends each episode to the service: `RemoteAgentRunner.run` POSTs
the row, the endpoint's base URL, the episode's key and its time-out, and gets back the same `AgentOutcome` a local
runner returns. The route asks the service's bearer token (the run's reward token), and each episode's key is good
for that episode only, on the endpoint.

A service that cannot be reached or answers an error is not allowed to crash the run: the episode ends with fault
"exception" and the service's message as its log (counted `agent/faults/exception`, as an agent that raised).
Cancelling `run` (the rollout dropped, the run stopping) cancels the request, and the service ends the episode when
it sees the connection close.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from async_grpo.agents.endpoint import EndpointBinding
from async_grpo.agents.execution import LOG_TAIL_CHARS, AgentOutcome

AGENTS_PATH = "/v1/agents"  # GET: what the service runs
AGENT_RUN_PATH = "/v1/agents/run"  # POST: one episode
TOKEN_ENV = "ASYNC_GRPO_REWARD_TOKEN"  # the reward service's bearer token (the same as for scoring)
POD_IP_ENV = "POD_IP"  # the pod's own IP, set by the kubernetes launcher (downward API; `launch.k8s_pods.POD_IP_ENV`)
REQUEST_MARGIN_S = 30.0  # seconds beyond an episode's timeout_s for its sandbox's start, JSON and the network
CONNECT_TIMEOUT_S = 10.0  # opening a connection to the service, seconds
DESCRIBE_TIMEOUT_S = 30.0  # GET /v1/agents at set-up, seconds


class AgentServiceError(RuntimeError):
    """The reward service does not run this run's agent (unreachable at set-up, an older version, another config)."""


class AgentRunRequest(BaseModel):
    """Body of POST /v1/agents/run: one episode (Orchestrator -> Reward service).

    Attributes:
        row: the dataset row (`prompt` and every other column), as the agent receives it.
        base_url: the agent endpoint's OpenAI base URL (ending in `/v1`), reachable from the service.
        api_key: the episode's own key on the endpoint.
        timeout_s: the episode's wall-clock limit, seconds (> 0); the service caps it at its agent_timeout_s.
    """

    model_config = ConfigDict(extra="forbid")

    row: dict[str, Any] = Field(description="The dataset row.")
    base_url: str = Field(min_length=1, description="The endpoint's OpenAI base URL.")
    api_key: str = Field(min_length=1, description="The episode's key.")
    timeout_s: float = Field(gt=0.0, description="The episode's time-out, seconds.")


def outcome_to_json(outcome: AgentOutcome) -> dict[str, Any]:
    """An `AgentOutcome` as the route answers it: {"value", "fault", "log", "seconds"}."""
    return {"value": outcome.value, "fault": outcome.fault, "log": outcome.log, "seconds": outcome.seconds}


def outcome_from_json(body: Any) -> AgentOutcome:
    """The `AgentOutcome` of a route's answer (`outcome_to_json`).

    Raises:
        ValueError: `body` is not such an answer (a field missing or of the wrong type).
    """
    if not isinstance(body, Mapping):
        raise ValueError(f"not an agent outcome: {str(body)[:200]}")
    value, fault, log, seconds = (body.get(k) for k in ("value", "fault", "log", "seconds"))
    if not (
        (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)))
        and (fault is None or isinstance(fault, str))
        and isinstance(log, str)
        and isinstance(seconds, (int, float))
    ):
        raise ValueError(f"not an agent outcome: {str(dict(body))[:200]}")
    return AgentOutcome(None if value is None else float(value), fault, log, float(seconds))


def _is_loopback(host: str | None) -> bool:
    """True for `localhost` and a loopback address (the service runs on this machine)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def advertised_host() -> str:
    """This machine's address as the reward pods reach it: env POD_IP (the pod's IP, which the kubernetes launcher
    sets from the downward API), else the address this host's name resolves to
    (`socket.gethostbyname(socket.gethostname())`; in a pod without POD_IP, e.g. the evaluate step's, its IP). Off
    Kubernetes, with a reward service on another machine, set POD_IP to the address that machine reaches this one at
    (a host name may resolve to 127.0.1.1 here).

    Raises:
        OSError: POD_IP is unset and the host name does not resolve.
    """
    return os.environ.get(POD_IP_ENV) or socket.gethostbyname(socket.gethostname())


def endpoint_binding(service_url: str, port: int, port_count: int) -> EndpointBinding:
    """Where the agent endpoint listens when the episodes run on the reward service at `service_url`.

    A service on a loopback address runs on this machine: the endpoint keeps 127.0.0.1 and a free port. Any other
    service reaches this machine over the network: the endpoint listens on all interfaces ("0.0.0.0", or "::" for an
    IPv6 address) on the first free port of `port` .. `port + port_count - 1` (the ports the NetworkPolicies open)
    and advertises `advertised_host()` in its URL.

    Args:
        service_url: the reward service's base URL.
        port: the first port (`agent_endpoint_port`).
        port_count: how many ports from `port` (`AGENT_ENDPOINT_PORT_COUNT`).

    Raises:
        OSError: the advertised host cannot be found (`advertised_host`).
    """
    if _is_loopback(urlsplit(service_url).hostname):
        return EndpointBinding()
    advertise = advertised_host()
    return EndpointBinding("::" if ":" in advertise else "0.0.0.0", port, port_count, advertise)


class RemoteAgentRunner:
    """An `agents.execution.AgentRunner` whose episodes run on the reward service (module docstring).

    Args:
        url: the service's base URL (the reward service's, e.g. http://my-run-reward:8080).
        token: bearer token; None reads env ASYNC_GRPO_REWARD_TOKEN (unset: none).
        agent: with `agent_command`, what this run declares (`agents.agent`, `agents.agent_command`): when either is
            given, the service must run exactly that agent (GET /v1/agents, checked here once); both None: no check.
        agent_command: see `agent`.
        request_margin_s: seconds beyond an episode's timeout_s its request may take (>= 0).
        connect_timeout_s: seconds to open a connection to the service (> 0).

    Raises:
        AgentServiceError: (with `agent` or `agent_command`) the service cannot be asked, serves no agent (an older
            version, or a config without one) or another one; the message names the fix.
        ValueError: a bad URL or margin.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        agent: str | None = None,
        agent_command: Sequence[str] | None = None,
        request_margin_s: float = REQUEST_MARGIN_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_url={url!r} is not an http(s) URL. Fix: e.g. http://my-run-reward:8080.")
        if not request_margin_s >= 0 or not connect_timeout_s > 0:
            raise ValueError(
                f"request_margin_s={request_margin_s} must be >= 0 and connect_timeout_s={connect_timeout_s} > 0 s."
            )
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.request_margin_s, self.connect_timeout_s = request_margin_s, connect_timeout_s
        if agent is not None or agent_command is not None:
            self._check_served(agent, None if agent_command is None else list(agent_command))

    def _check_served(self, agent: str | None, agent_command: list[str] | None) -> None:
        """GET /v1/agents must name this run's agent. Raises AgentServiceError."""
        fix = "Fix: run the same async-grpo version there, started with this run's config"
        try:
            resp = httpx.get(f"{self.url}{AGENTS_PATH}", headers=self._headers, timeout=DESCRIBE_TIMEOUT_S)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code} {resp.text[:200]}")
            served = resp.json()
            if not isinstance(served, dict):
                raise ValueError(f"not an object: {resp.text[:200]}")
        except (httpx.HTTPError, ValueError) as err:
            raise AgentServiceError(
                f"agent: could not ask the reward service at {self.url} which agent it runs ({err}). {fix} (and send "
                f"its token, env {TOKEN_ENV})."
            ) from None
        if (served.get("agent"), served.get("agent_command")) != (agent, agent_command):
            raise AgentServiceError(
                f"agent: the reward service at {self.url} runs agent={served.get('agent')!r}, "
                f"agent_command={served.get('agent_command')!r}; this run declares agent={agent!r}, "
                f"agent_command={agent_command!r}. {fix}."
            )

    async def run(self, row: Mapping[str, Any], base_url: str, api_key: str, timeout_s: float) -> AgentOutcome:
        """Run one episode on the service (see `AgentRunner.run`): its outcome, or fault "exception" with the
        service's failure as the log when it cannot be reached, answers an error or no outcome. Never raises but
        for cancellation (which closes the request)."""
        start = time.monotonic()
        body = {"row": dict(row), "base_url": base_url, "api_key": api_key, "timeout_s": timeout_s}
        headers = {**self._headers, "content-type": "application/json"}
        timeout = httpx.Timeout(timeout_s + self.request_margin_s, connect=self.connect_timeout_s)
        try:
            # one connection per episode: episodes run on several event loops (the orchestrator's, an evaluation's),
            # and one httpx client cannot serve two; an episode lasts far longer than opening a connection
            content = json.dumps(body, default=str)  # as a local command gets its row: odd values as text
            async with httpx.AsyncClient(headers=headers, timeout=timeout) as http:
                resp = await http.post(f"{self.url}{AGENT_RUN_PATH}", content=content)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {resp.text[:500]}")
            return outcome_from_json(resp.json())
        except (httpx.HTTPError, ValueError, TypeError) as err:
            log = (
                f"the reward service at {self.url} did not run the episode: {type(err).__name__}: {err}. Fix: check "
                "that the reward service is running and ready (on Kubernetes: kubectl get pods -l "
                "app.kubernetes.io/component=reward) and its logs."
            )
            return AgentOutcome(None, "exception", log[-LOG_TAIL_CHARS:], time.monotonic() - start)

    def close(self) -> None:
        """Nothing held between episodes (each episode's connection is closed by `run`)."""
