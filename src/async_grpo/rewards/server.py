"""The reward service: a `RewardPool` behind HTTP, run as the reward Deployment on Kubernetes.

FastAPI serves and validates the requests; all scoring, timeouts and worker replacement stay in the
`RewardPool` the trainer would otherwise run in-process, so a group scored here fails exactly as it
would there (the same RewardError reasons travel back in the error body, see `wire`). A run's tools run here too
(`tool_routes`), and so do its agent's episodes (`agent_routes`: a function in this process, a command in a bwrap
sandbox), so on Kubernetes they run where the reward functions run: in these credential-free pods.

    python -m async_grpo.rewards.server --config CONFIG.yaml [--host 0.0.0.0] [--port 8080] [--num-workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from async_grpo import __version__
from async_grpo.agents.remote import AGENT_RUN_PATH
from async_grpo.config import ConfigError, load_config
from async_grpo.rewards.agent_routes import ServedAgent, add_agent_routes, served_agent
from async_grpo.rewards.pool import CLOSE_TIMEOUT_S, RewardPool
from async_grpo.rewards.tool_routes import add_tool_routes, tool_executor
from async_grpo.rewards.wire import (
    AUTH_TOKEN_ENV,
    FUNCTIONS_PATH,
    HEALTH_PATH,
    REQUEST_MARGIN_S,
    SCORE_PATH,
    ScoreRequest,
    encode_scored,
    error_body,
)
from async_grpo.tools.executor import ToolExecutor
from async_grpo.transports.scorer import RewardError, RewardTimeout

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8080
# Idle connections stay open this long (seconds; uvicorn's default is 5, httpx clients keep theirs 5): a server that
# closes first races the client reusing the connection, which then reads ReadError('') on a live server.
KEEPALIVE_S = 75.0
SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long after SIGTERM before uvicorn cancels them
# The workers get this long to start and import the user code before the service reports ready anyway (seconds;
# `warm_up`). Generous: an import that loads a model may take minutes, and the readiness probe just waits.
WARM_TIMEOUT_S = 600.0


def _status(err: RewardError) -> int:
    return 504 if isinstance(err, RewardTimeout) else 500


def _validation_message(err: RequestValidationError, path: str = SCORE_PATH) -> str:
    """One line per bad field, e.g. `completion_ids.0.1: Input should be a valid integer`, and the body `path`
    takes."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "(body)"
        parts.append(f"{loc}: {str(e.get('msg', '')).removeprefix('Value error, ')}")
    if path == AGENT_RUN_PATH:
        return (
            f'invalid agent episode request: {"; ".join(parts)}. Fix: POST {{"row": {{...}}, "base_url": str, '
            '"api_key": str, "timeout_s": seconds > 0}.'
        )
    return (
        f'invalid score request: {"; ".join(parts)}. Fix: POST {{"prompts": [G], "completions": [G], '
        f'"completion_ids": [G lists of ints], "columns": {{name: [G]}}}}.'
    )


def build_app(
    pool: RewardPool,
    request_margin_s: float = REQUEST_MARGIN_S,
    token: str | None = None,
    tools: ToolExecutor | None = None,
    agent: ServedAgent | None = None,
    ready: threading.Event | None = None,
) -> FastAPI:
    """The reward service's FastAPI app, scoring with `pool` (and running `tools` when the run declares tools, see
    `tool_routes`, and the run's `agent` when it declares one, see `agent_routes`); the app owns them and closes
    them on shutdown.

    Routes:
        GET /health: 200 {"status": "ok"} while the pool is open and `ready` is set, 503 {"status": "starting"}
            before, 503 {"status": "closed"} after (the readiness probe).
        GET /v1/reward_functions: {"names": [F], "weights": [F], "timeout_s": s, "version": package version}.
        POST /v1/score: a `wire.ScoreRequest` -> 200 {"rewards": G x F numbers, null where a function
            returned None, "extra", "metrics" (what the functions logged), "seconds": {function name: wall-clock
            seconds of its call on this service}} (`wire.encode_scored`). Errors carry {"reason", "function",
            "message"}: 422 for a malformed request (the message names the field), 504 for "reward_timeout", 500
            for "reward_error" and "reward_bad_output", 503 once the pool is closed.

    Args:
        pool: the reward pool to score with (closed when the app shuts down).
        request_margin_s: seconds beyond `pool.timeout_s` a request may wait (for a free worker, say)
            before it fails with reason "reward_timeout".
        token: when set, every route but /health answers 401 {"reason": "unauthorized"} unless the request
            carries `Authorization: Bearer <token>` (a second layer under the NetworkPolicy).
        tools: the run's tool executor: adds GET /v1/tools and POST /v1/tools/call (`tool_routes`).
        agent: the run's agent (`agent_routes.served_agent`): adds GET /v1/agents and POST /v1/agents/run.
        ready: set once the workers are warm (`warm_up`, started by `main`); None: ready at once.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(pool.close)
        if tools is not None:
            await asyncio.to_thread(tools.close)
        if agent is not None:
            agent.runner.close()

    app = FastAPI(title="async-grpo reward service", version=__version__, lifespan=lifespan)
    max_wait_s = pool.timeout_s + request_margin_s

    if token:
        digest = hashlib.sha256(token.encode()).digest()

        @app.middleware("http")
        async def _require_token(request: Request, call_next: Any) -> Any:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.encode()).digest(), digest)
            if ok or request.url.path == HEALTH_PATH:
                return await call_next(request)
            return JSONResponse(
                {
                    "reason": "unauthorized",
                    "function": None,
                    "message": "missing or wrong bearer "
                    f"token. Fix: send the service's token (env {AUTH_TOKEN_ENV}) as "
                    "`Authorization: Bearer <token>`.",
                },
                status_code=401,
            )

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"reason": "bad_request", "function": None, "message": _validation_message(err, request.url.path)},
            status_code=422,
        )

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        if pool.closed:
            return JSONResponse({"status": "closed"}, status_code=503)
        if ready is not None and not ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(FUNCTIONS_PATH)
    async def reward_functions() -> dict[str, Any]:
        return {"names": pool.names, "weights": pool.weights, "timeout_s": pool.timeout_s, "version": __version__}

    @app.post(SCORE_PATH)
    async def score(req: ScoreRequest) -> JSONResponse:
        try:
            future = pool.submit(
                req.prompts, req.completions, req.completion_ids, req.columns, trainer_state=req.trainer_state
            )
        except ValueError as err:  # lengths; ScoreRequest checks them first
            return JSONResponse({"reason": "bad_request", "function": None, "message": str(err)}, status_code=422)
        except RuntimeError as err:  # the pool is closed: the server is shutting down
            return JSONResponse(error_body(RewardError(f"the reward service is shutting down: {err}")), status_code=503)
        try:
            scored = await asyncio.wait_for(asyncio.wrap_future(future), timeout=max_wait_s)
        except TimeoutError:  # queued behind other groups for too long; the pool bounds the run itself
            err = RewardTimeout(
                f"reward functions {pool.names} were not scored within {max_wait_s:g} s "
                f"(reward_timeout_s={pool.timeout_s:g} s + {request_margin_s:g} s waiting for a "
                "worker). Fix: send fewer groups at once, or add workers (--num-workers)."
            )
            return JSONResponse(error_body(err), status_code=_status(err))
        except RewardError as err:
            logger.warning("group of %d failed (%s): %s", len(req.completions), err.reason, str(err).splitlines()[0])
            return JSONResponse(error_body(err), status_code=_status(err))
        return JSONResponse(encode_scored(scored))

    if tools is not None:
        add_tool_routes(app, tools, request_margin_s)
    if agent is not None:
        add_agent_routes(app, agent)
    return app


def is_loopback(host: str) -> bool:
    """True when `host` (a --host value) is a loopback address or `localhost`: only this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any interface
        return False


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m async_grpo.rewards.server`."""
    p = argparse.ArgumentParser(
        prog="python -m async_grpo.rewards.server",
        description="Serve a run's reward functions over HTTP (the reward Deployment).",
    )
    p.add_argument(
        "--config",
        required=True,
        help="run config YAML; its reward_funcs, reward_weights and "
        "reward_timeout_s are served, its tools (with their limits) when it declares any, and its agent (agent, or "
        "agent_command in a bwrap sandbox) when it declares one",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="reward worker processes (default: the config's reward_num_workers)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def warm_up(pool: RewardPool, tools: ToolExecutor | None, ready: threading.Event, timeout_s: float) -> None:
    """Start the reward (and tool) workers and have each import the user code, then set `ready` (the service's
    /health turns 200). A request's time limit includes its wait for a free worker, so a cold pool would fail the
    first requests (`worker_warmup`). Runs in a thread of its own beside the server; `ready` is set even when the
    warm-up falls short (the cause is logged), since requests are still served, only slower to start."""
    t0 = time.monotonic()
    warm = pool.warm(timeout_s)
    if tools is not None:
        warm_tools = tools.warm(max(timeout_s - (time.monotonic() - t0), 1.0))
        logger.info("%d tool workers warm", warm_tools)
    logger.info("%d reward workers warm after %.1f s", warm, time.monotonic() - t0)
    ready.set()


def main(argv: Sequence[str] | None = None) -> int:
    """Load the config, validate the reward functions, serve until SIGTERM/SIGINT, then close the pool.

    With env ASYNC_GRPO_REWARD_TOKEN set, scoring requires that bearer token (see `build_app`). A config with
    `agent_command` needs its bwrap sandbox to run here (`agent_routes.served_agent`): without it the server exits 2,
    naming agent_command.

    A server without a token listens only on a loopback address: it refuses any other `--host` (exit 2), since
    anyone who reaches the port could then run the rewards and tools, and read their answers.

    Returns:
        0 after a SIGTERM (graceful stop), 2 for a bad config, reward spec or argument (the message on
        stderr names the field and the fix), 130 after Ctrl-C.
    """
    args = parse_args(argv)
    token = os.environ.pop(AUTH_TOKEN_ENV, "") or None  # popped: the reward workers (user code) never inherit it
    pool = tools = agent = warming = None
    try:
        try:
            if token is None and not is_loopback(args.host):
                raise ValueError(
                    f"--host {args.host} without a token would serve every client that reaches the port. "
                    f"Fix: set {AUTH_TOKEN_ENV} (the Kubernetes objects set it), or listen on 127.0.0.1."
                )
            config = load_config(args.config)
            num_workers = config.rewards.reward_num_workers if args.num_workers is None else args.num_workers
            if not 1 <= args.port <= 65535:
                raise ValueError(f"--port {args.port} is not a TCP port. Fix: give 1-65535.")
            pool = RewardPool.from_config(config, num_workers)
            tools = tool_executor(config)
            agent = served_agent(config)
        except (ConfigError, ValueError) as err:  # RewardSpecError, AgentSpecError, SandboxUnavailable: ValueErrors
            print(f"error: {err}", file=sys.stderr)
            return 2
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # uvicorn handles SIGTERM (graceful shutdown, lifespan closes the pool), then re-raises it with this
        # handler in place, so the process exits 0 through the `finally` below rather than dying of the signal.
        signal.signal(signal.SIGTERM, _raise_exit)
        logger.info(
            "serving reward functions %s (weights %s, timeout %g s, %d workers) on http://%s:%d",
            pool.names,
            pool.weights,
            pool.timeout_s,
            num_workers,
            args.host,
            args.port,
        )
        if agent is not None:
            logger.info("running the agent's episodes: %s", agent.agent or agent.agent_command)
        ready = threading.Event()
        warming = threading.Thread(
            target=warm_up, args=(pool, tools, ready, WARM_TIMEOUT_S), name="reward-warm-up", daemon=True
        )
        warming.start()
        uvicorn.run(
            build_app(pool, token=token, tools=tools, agent=agent, ready=ready),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            timeout_keep_alive=KEEPALIVE_S,
        )
    except KeyboardInterrupt:
        return 130
    finally:
        if pool is not None:
            pool.close()
        if tools is not None:
            tools.close()
        if agent is not None:
            agent.runner.close()
        if warming is not None:
            warming.join(CLOSE_TIMEOUT_S)  # closing the pools ends the warm-up
    return 0


if __name__ == "__main__":
    sys.exit(main())
