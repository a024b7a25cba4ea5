"""Tool calls on the reward service: its tool route (`rewards.tool_routes`) and this client.

On Kubernetes the reward service (same image, same NetworkPolicy: only the run's trainer may call it, and its pods
reach nothing and hold no credentials) also runs the run's tools, in its own `ToolExecutor` with the run's limits.
The client takes the tools' names and JSON schemas from the service (GET /v1/tools), so the trainer, which holds
credentials, never imports a submitter's tool file. It sends one call per request and gets the same `ToolOutcome` a
local executor would give; a tool that fails is an outcome, while a service that cannot be reached raises
`ToolServiceError` (the rollout drops the group and counts it, rather than telling the model its tool failed).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from async_grpo.tools.executor import ToolOutcome, precheck
from async_grpo.tools.loading import Tool

TOOLS_PATH = "/v1/tools"
TOOL_CALL_PATH = "/v1/tools/call"
TOKEN_ENV = "ASYNC_GRPO_REWARD_TOKEN"  # the reward service's bearer token (the same as for scoring)
REQUEST_MARGIN_S = 10.0  # seconds beyond tool_timeout_s for JSON, the network and a free worker
CONNECT_TIMEOUT_S = 10.0


class ToolServiceError(RuntimeError):
    """The reward service did not answer a tool call (unreachable, an HTTP error, or not a tool outcome)."""


class ToolCallRequest(BaseModel):
    """Body of POST /v1/tools/call: one call (Orchestrator -> Reward service).

    Attributes:
        name: the tool the model called.
        arguments: its arguments, as parsed.
        allowed: the tool names the prompt offered (a dataset row's `tools` column), or None for all.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Tool name.")
    arguments: Any = Field(default=None, description="Arguments (a JSON object).")
    allowed: list[str] | None = Field(default=None, description="Offered tool names, or null for all.")


class RemoteToolExecutor:
    """A `ToolBackend` that runs calls on the reward service.

    Args:
        url: the service's base URL (the reward service's).
        specs: the run's declared tool specs (`tools`); the service must serve exactly these, in this order.
        timeout_s: the run's `tool_timeout_s`; a request may take that plus REQUEST_MARGIN_S.
        max_concurrency: calls in flight at once (threads of a private pool; the event loop is never blocked).
        token: bearer token; None reads env ASYNC_GRPO_REWARD_TOKEN (unset: none).

    Attributes:
        tools: the served tools (name, spec and the JSON schema the service built), in spec order.

    Raises:
        ToolServiceError: the service does not list tools, lists other specs than `specs`, or a schema that is not
            a function schema (the fix is named).
    """

    def __init__(
        self, url: str, specs: Sequence[str], *, timeout_s: float, max_concurrency: int = 4, token: str | None = None
    ):
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s + REQUEST_MARGIN_S, connect=CONNECT_TIMEOUT_S),
        )
        try:
            self.tools = self._served_tools(list(specs))
        except ToolServiceError:
            self._http.close()
            raise
        self._by_name = {t.name: t for t in self.tools}
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="tool-http")

    def _served_tools(self, specs: list[str]) -> list[Tool]:
        """The tools GET /v1/tools lists, checked against the declared `specs`. Raises ToolServiceError."""
        try:
            resp = self._http.get(TOOLS_PATH)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code} {resp.text[:200]}")
            body = resp.json()
            names, served, schemas = body.get("names"), body.get("specs"), body.get("schemas")
        except (httpx.HTTPError, ValueError, AttributeError) as err:
            raise ToolServiceError(
                f"could not list the tools of the reward service at {self.url}: {err}. Fix: run "
                "the same async-grpo version there, started with this run's config (and send its "
                "token, env ASYNC_GRPO_REWARD_TOKEN)."
            ) from None
        if (
            served != specs
            or not isinstance(names, list)
            or not isinstance(schemas, list)
            or not len(names) == len(schemas) == len(specs)
        ):
            raise ToolServiceError(
                f"the reward service at {self.url} serves tools {served}, this run declares "
                f"{specs}. Fix: start the service with this run's config."
            )
        tools = []
        for name, spec, schema in zip(names, specs, schemas, strict=True):
            function = schema.get("function") if isinstance(schema, dict) else None
            if not isinstance(function, dict) or function.get("name") != name or not isinstance(name, str):
                raise ToolServiceError(
                    f"the reward service at {self.url} sent no function schema for tool {spec!r}. "
                    "Fix: run the same async-grpo version there."
                )
            tools.append(Tool(name, spec, spec, schema))
        return tools

    def _post(self, name: str, arguments: Any, allowed: Sequence[str] | None) -> ToolOutcome:
        body = ToolCallRequest(name=name, arguments=arguments, allowed=None if allowed is None else list(allowed))
        try:
            resp = self._http.post(TOOL_CALL_PATH, json=body.model_dump())
            if resp.status_code != 200:
                raise ToolServiceError(
                    f"the reward service answered a tool call with HTTP {resp.status_code}: {resp.text[:200]}"
                )
            return ToolOutcome.from_json(resp.json())
        except (httpx.HTTPError, ValueError) as err:
            raise ToolServiceError(f"tool call {name!r} on {self.url} failed: {type(err).__name__}: {err}") from err

    async def call(self, name: str, arguments: Any, *, allowed: Sequence[str] | None = None) -> ToolOutcome:
        """Run one call on the service (see `ToolBackend.call`).

        Raises:
            ToolServiceError: the service did not answer with a tool outcome.
        """
        refused = precheck(self._by_name, name, arguments, allowed)  # the full schemas are here, not on the service
        if refused is not None:
            return refused
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._post, name, arguments, allowed)

    def close(self) -> None:
        """Close the connections and the request threads (in-flight calls finish or time out)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._http.close()
