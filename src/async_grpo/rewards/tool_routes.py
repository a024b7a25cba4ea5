"""The reward service's tool routes: the run's tools, served beside its reward functions.

`server.build_app` adds these routes when the run declares tools, so on Kubernetes tool calls run in the reward
pods (same image, same NetworkPolicy: only the run's trainer may call them; the pods reach nothing and hold no
credentials), in a `tools.ToolExecutor` with the run's timeouts and resource limits. A failing tool is a normal
answer (200 with the outcome, as a local executor returns it); the client is `tools.remote.RemoteToolExecutor`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.tools import PYTHON_TOOL
from async_grpo.tools.executor import ToolExecutor
from async_grpo.tools.loading import load_tools
from async_grpo.tools.remote import REQUEST_MARGIN_S, TOOL_CALL_PATH, TOOLS_PATH, ToolCallRequest
from async_grpo.tools.sandbox import SandboxSettings, check_sandbox


def add_tool_routes(app: FastAPI, executor: ToolExecutor, request_margin_s: float = REQUEST_MARGIN_S) -> None:
    """Add the tool routes to `app` (the caller closes `executor` when the app stops).

    Routes:
        GET /v1/tools: {"names": [tool names], "specs": [the config's specs], "schemas": [their JSON schemas, built
            here by transformers.utils.get_json_schema], "timeout_s": tool_timeout_s}. The trainer renders prompts
            from these schemas, so it never imports the submitter's tool files.
        POST /v1/tools/call: a `tools.remote.ToolCallRequest` -> 200 `ToolOutcome.to_json()` (success or a failed
            tool alike), 422 for a malformed request, 503 once the executor is closed or when no worker answered
            within timeout_s + request_margin_s.
    """
    max_wait_s = executor.timeout_s + request_margin_s

    @app.get(TOOLS_PATH)
    async def tools() -> dict[str, Any]:
        return {
            "names": [t.name for t in executor.tools],
            "specs": [t.spec for t in executor.tools],
            "schemas": [t.schema for t in executor.tools],
            "timeout_s": executor.timeout_s,
        }

    @app.post(TOOL_CALL_PATH)
    async def call(req: ToolCallRequest) -> JSONResponse:
        try:
            outcome = await asyncio.wait_for(executor.call(req.name, req.arguments, allowed=req.allowed), max_wait_s)
        except TimeoutError:
            return JSONResponse(
                {
                    "reason": "tool_timeout",
                    "function": req.name,
                    "message": f"no tool worker answered within {max_wait_s:g} s. Fix: add workers (tool_num_workers).",
                },
                status_code=503,
            )
        if outcome.failure == "crashed" and executor.closed:
            return JSONResponse(
                {"reason": "shutting_down", "function": req.name, "message": "the reward service is shutting down"},
                status_code=503,
            )
        return JSONResponse(outcome.to_json())


def tool_executor(config: GRPOConfig) -> ToolExecutor | None:
    """The tool executor for the run's `tools` section (`tool_num_workers` spawned workers with its timeout and
    limits), or None when it declares no tools: the reward service's, and the trainer's when no service is used.
    With `builtin:python`, its sandbox is tried once here (`tools.sandbox.check_sandbox`), before any worker starts.

    Raises:
        ToolSpecError: a tool does not resolve or cannot be described (a ValueError: the server exits with 2).
        SandboxUnavailable: builtin:python is declared and its sandbox cannot run here (a ValueError naming
            python_tool_sandbox and the fix).
    """
    t = config.tools
    if not t.tools:
        return None
    python_sandbox = SandboxSettings.from_section(t) if PYTHON_TOOL in t.tools else None
    if python_sandbox is not None:
        check_sandbox(python_sandbox)
    # the full schemas are built here, where submitter code may run; the trainer takes them from GET /v1/tools
    return ToolExecutor(
        load_tools(t.tools),
        num_workers=t.tool_num_workers,
        timeout_s=t.tool_timeout_s,
        cpu_seconds=t.tool_cpu_seconds,
        memory_mb=t.tool_memory_mb,
        python_sandbox=python_sandbox,
    )
