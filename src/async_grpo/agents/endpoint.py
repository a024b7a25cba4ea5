"""The OpenAI-compatible endpoint an agent calls: every call is served by the run's vLLM and recorded exactly.

An agent written against the `openai` client (or any framework on top of it) is pointed at `AgentEndpoint.url`
with its episode's own key (`EpisodeSession.key`, the bearer token). The endpoint serves, on the rollout's event
loop (uvicorn, FastAPI):

    GET  /v1/models             the served model name
    POST /v1/chat/completions   messages, tools and tool_choice ("auto" or "none"), streaming or not
    POST /v1/completions        one prompt (text or token ids), streaming or not

A chat request is rendered by the policy's own chat template (`tools.render.render_ids`, the tools' JSON schemas
rendered into it), and the token ids are sent to vLLM through the run's generation client (`/v1/completions`, token
ids in, sampled ids and logprobs out; replicas, coalescing and LoRA naming as for every rollout). The answer is
parsed into an assistant message, tool calls included, by the tokenizer's own response parsing (`tools.parsing`), and
returned in OpenAI's format with `policy_version`. Each call is recorded on its session as an
`agents.trajectory.ModelCall` (prompt ids, completion ids, logprobs, the version read when it was sent), from which
the rollout builds the trained rows: what is trained is exactly what vLLM sampled.

What it cannot record exactly, or cannot honor, it refuses with an OpenAI-style error the agent sees (HTTP 400,
`{"error": {"message", "type", "param", "code"}}`): `n` > 1 (one episode is one sequence of calls), `echo`,
`best_of`, `suffix`, a `response_format` other than text, `tool_choice` "required" or a named function (the
sampler is not constrained), several prompts in one completions request, a call past `max_turns`, and a call that
would overrun the episode's token budget (`max_completion_length`; code "context_length_exceeded"). The run's
sampling settings always apply (temperature, top_p, top_k, min_p, ...: the trainer's correction assumes them); an
agent's own sampling fields are ignored, except `max_tokens` / `max_completion_tokens`, which can only lower the
budget, `stop` (passed to vLLM: the sampled ids are recorded whatever ends them) and `seed` (used when the rollout
is not seeded). A wrong or revoked key gets 401; vLLM unreachable or aborting gets 503, and the session keeps the
error for the rollout (`EpisodeSession.error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from async_grpo.agents.trajectory import ModelCall, Segment, add_call, extends
from async_grpo.inference.client import GenerationClient, GenerationError, RejectedRequestError
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.tools.parsing import ToolFormatError, parse_turn, response_template
from async_grpo.tools.render import render_ids

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"  # what /v1/models lists; any model name in a request is accepted (there is one policy)
START_TIMEOUT_S = 30.0  # most seconds `start` waits for the server to listen
STOP_TIMEOUT_S = 10.0  # most seconds `aclose` waits for the server to stop
LISTEN_BACKLOG = 2048  # uvicorn's default backlog
DRAIN_TIMEOUT_S = 10.0  # most seconds `EpisodeSession.drain` waits for cancelled requests to end
UNSUPPORTED_FIELDS = ("echo", "best_of", "suffix", "logit_bias", "functions", "function_call")
_PREFIX_TOKENS = 32  # prompt tokens decoded as the tool-call parser's prefix (enough for the assistant header)

# Refusals the session counts (the metrics `agent/refused/<kind>`, `agents.execution.agent_metrics`)
REFUSAL_KINDS = ("unsupported", "max_turns", "budget", "rejected_by_vllm")


class EndpointRefusal(Exception):
    """A call the endpoint answers with an OpenAI-style error instead of a completion.

    Args:
        status: the HTTP status (400, 401, 503).
        message: what is wrong and the fix, as the agent reads it.
        code: OpenAI's error code (e.g. "context_length_exceeded"), or None.
        param: the request field at fault, or None.
        kind: the refusal's counter key (`REFUSAL_KINDS`), or None for one not counted (401, 503).
    """

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status_code, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def response(self) -> JSONResponse:
        """The error as OpenAI returns one."""
        kind = {400: "invalid_request_error", 401: "authentication_error"}.get(self.status_code, "server_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status_code)


@dataclass
class EpisodeSession:
    """One episode's identity on the endpoint and everything its calls left (lives on the rollout's loop).

    Attributes:
        key: the episode's API key (the bearer token its agent sends; unguessable, revoked by `close`).
        client: the run's generation client, bound to the rollout's loop.
        sampling: the run's sampling settings (max_completion_length is the episode's token budget per segment).
        version: returns the policy version vLLM serves now; read when each call is sent.
        max_turns: most model calls (verifiers' name); the next one is refused, counted `max_turns`.
        seed: the rollout's sampling seed (evaluation), or None; call k is sampled with seed + k.
        calls: the recorded calls, in the order they were served.
        segments: `calls` joined into segments as they arrive (`agents.trajectory.add_call`): the trained rows.
        refused: refusal kind -> count (`REFUSAL_KINDS`).
        error: the first generation failure (vLLM unreachable, erroring or aborting), re-raised by the rollout.
        budget_exhausted: a call was refused because the segment's budget was spent (the episode is truncated).
        closed: revoked; every later call gets 401.
        first_request: the first served call's request in TRL's form: its chat messages (`chat_messages`), or its
            completion prompt as text; None before any.
        final_conversation: after the last served call: its messages plus the reply as an assistant message (TRL's
            form, `tool_calls` with dict arguments), or, for a completions call, the completion's text.
    """

    key: str
    client: GenerationClient
    sampling: SamplingSettings
    version: Callable[[], int]
    max_turns: int
    seed: int | None = None
    calls: list[ModelCall] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    error: BaseException | None = None
    budget_exhausted: bool = False
    closed: bool = False
    first_request: list[dict] | str | None = None
    final_conversation: list[dict] | str | None = None
    _sent: int = 0
    _inflight: set[asyncio.Future] = field(default_factory=set)

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Cancel the session's generation requests still in flight and wait for them, at most `timeout_s` seconds:
        once its rollout is over no request of it may outlive it (the run closes the generation client next, and a
        request cut by that would count its vLLM replica as lost)."""
        pending = list(self._inflight)
        for request in pending:
            request.cancel()
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    def budget_left(self, prompt_ids: list[int]) -> int:
        """Tokens `prompt_ids` may still generate: max_completion_length minus the tokens already after its
        segment's first prompt (a call that starts a new segment has the whole budget)."""
        segment = self.segments[-1] if self.segments else None
        if segment is not None and extends(segment.held, prompt_ids):
            return self.sampling.max_completion_length - (len(prompt_ids) - len(segment.prompt_ids))
        return self.sampling.max_completion_length

    async def generate(self, prompt_ids: list[int], max_tokens: int | None, extra: Mapping[str, Any]) -> ModelCall:
        """Sample one completion of `prompt_ids` (P,) with the run's sampling settings and record it.

        Args:
            max_tokens: the agent's own cap, or None.
            extra: further vLLM request fields the agent set that the endpoint passes on (`stop`, `seed`).

        Raises:
            EndpointRefusal: 401 when closed; 400 past max_turns, past the budget, or refused by vLLM; 503 when vLLM
                failed or aborted (kept in `error`).
        """
        if self.closed:
            raise EndpointRefusal(401, "this episode is over: its key is revoked")
        if self._sent >= self.max_turns:
            self.refused["max_turns"] += 1
            raise EndpointRefusal(
                400, f"this episode made its max_turns={self.max_turns} model calls; no more are served",
                code="max_turns_exceeded", kind="max_turns",
            )  # fmt: skip
        budget = self.budget_left(prompt_ids)
        if budget <= 0:
            self.refused["budget"] += 1
            self.budget_exhausted = True
            raise EndpointRefusal(
                400, f"the episode's conversation is past max_completion_length={self.sampling.max_completion_length} "
                "tokens after its first prompt", code="context_length_exceeded", param="messages", kind="budget",
            )  # fmt: skip
        self._sent += 1
        index = self._sent
        s = self.sampling
        body = {**s.extra_body(), **{k: v for k, v in extra.items() if k == "stop"}}
        seed = self.seed + index if self.seed is not None else extra.get("seed")
        version = self.version()
        request = asyncio.ensure_future(self.client.generate(
            prompt_ids, n=1, max_tokens=min(budget, max_tokens or budget), temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k, seed=seed if isinstance(seed, int) else None,
            **({"extra_body": body} if body else {}),
        ))  # fmt: skip
        self._inflight.add(request)
        try:
            (completion,) = await request
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request.cancelled() and self.closed and not (current and current.cancelling()):
                raise EndpointRefusal(401, "this episode is over: its key is revoked") from None
            raise
        except RejectedRequestError as err:
            self.refused["rejected_by_vllm"] += 1
            raise EndpointRefusal(400, f"vLLM refused the request: {err}", kind="rejected_by_vllm") from err
        except (GenerationError, httpx.HTTPError) as err:
            self.error = self.error or err
            raise EndpointRefusal(503, f"the policy's server failed: {err}") from err
        finally:
            self._inflight.discard(request)
        if completion.finish_reason == "abort":
            self.error = self.error or GenerationError("vLLM aborted a request of an agent episode")
            raise EndpointRefusal(503, "the policy's server aborted the request")
        call = ModelCall(
            list(prompt_ids), list(completion.token_ids), list(completion.logprobs), version, completion.finish_reason
        )
        self.calls.append(call)
        add_call(self.segments, call)
        return call


def _error_fields(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse (400, kind "unsupported") a request the endpoint cannot serve or record exactly (module docstring)."""

    def refuse(param: str, message: str) -> EndpointRefusal:
        return EndpointRefusal(400, message, param=param, kind="unsupported")

    n = body.get("n", 1)
    if n not in (None, 1):
        raise refuse("n", f"n={n!r}: an episode is one sequence of calls, so only n=1 is served. Fix: make n calls.")
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) and not (name == "best_of" and body[name] == 1):
            raise refuse(name, f"`{name}` is not supported by the training endpoint. Fix: leave it out.")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise refuse("response_format", "only response_format {'type': 'text'} is served (decoding is not constrained)")
    if chat:
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise refuse("tool_choice", f"tool_choice={choice!r}: only 'auto' and 'none' are served (decoding is not "
                         "constrained). Fix: use 'auto' and check the reply's tool_calls.")  # fmt: skip
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise refuse("messages", "`messages` must be a non-empty list of chat messages")
    elif _several_prompts(body.get("prompt")):
        raise refuse("prompt", "one prompt per request: an episode is one sequence of calls. Fix: send each alone.")


def _several_prompts(prompt: Any) -> bool:
    """Whether a completions `prompt` is a list of several prompts (texts or token lists), not one."""
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _text(content: Any) -> str:
    """A message's content as text: a string as is, OpenAI's list of parts joined (their `text`), None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def chat_messages(messages: list[Any]) -> list[dict]:
    """OpenAI chat messages as the chat template reads them (TRL's conversational form): content as text, an
    assistant's `tool_calls` with `arguments` parsed from their JSON string into a dict, and a tool message given the
    `name` of the call it answers (looked up by `tool_call_id`) when it has none.

    Raises:
        EndpointRefusal: a message is not a dict with a string role (400, param "messages").
    """
    names: dict[str, str] = {}
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise EndpointRefusal(400, f"each message must be a dict with a role, got {m!r}"[:300], param="messages",
                                  kind="unsupported")  # fmt: skip
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    with contextlib.suppress(ValueError):
                        args = json.loads(args)
                calls.append({"type": "function", "function": {"name": fn.get("name"), "arguments": args}})
                if isinstance(call, Mapping) and call.get("id"):
                    names[str(call["id"])] = str(fn.get("name"))
            msg["tool_calls"] = calls
        if m["role"] == "tool":
            name = m.get("name") or names.get(str(m.get("tool_call_id")))
            if name:
                msg["name"] = name
        out.append(msg)
    return out


def openai_tool_calls(message: Mapping[str, Any], call_ids: list[str]) -> list[dict]:
    """A parsed assistant message's `tool_calls` (TRL's form, arguments a dict) in OpenAI's form: each with its id
    from `call_ids` and its arguments as a JSON string."""
    out = []
    for call_id, call in zip(call_ids, message.get("tool_calls") or [], strict=False):
        fn = call["function"]
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _listen(host: str, ports: list[int]) -> socket.socket:
    """A socket listening on `host` on the first port of `ports` that is free (0: any); it listens at once, so two
    endpoints starting together never share a port. Raises OSError when none is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
        except OSError:
            sock.close()
            continue
        return sock
    raise OSError(
        f"agent_endpoint_port: the agent endpoint found no free port of {ports[0]}-{ports[-1]} on {host}. Fix: end "
        "what listens there, or (on your own machine) set agent_endpoint_port to a free range."
    )


@dataclass(frozen=True)
class EndpointBinding:
    """Where the agent endpoint listens and the host its URL names (`agents.endpoint.AgentEndpoint`'s arguments).

    Attributes:
        host: the address to listen on.
        port: the first port to try (0: any free port).
        port_count: how many ports from `port` to try.
        advertise_host: the host written in the endpoint's URL (None: `host`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    port_count: int = 1
    advertise_host: str | None = None


class _Server(uvicorn.Server):
    """uvicorn's server, leaving the process's signal handlers to the run (it serves inside the rollout's loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class AgentEndpoint:
    """The endpoint (see the module docstring), served on the event loop that calls `start`.

    Args:
        tokenizer: the policy's tokenizer (chat template, response parsing, decoding).
        host: the address to listen on (127.0.0.1: agents run on this machine; "0.0.0.0" or "::": they run
            elsewhere, on the reward service, `agents.remote.endpoint_binding`).
        port: the first port to try; 0 (default): any free port.
        port_count: how many ports from `port` to try, in order (>= 1; ignored with port 0): the first free one is
            used (one endpoint per event loop may listen at once, all within the range a NetworkPolicy opens).
        advertise_host: the host written in `url` (the pod's IP when listening on all interfaces); None: `host`.

    Attributes:
        url: the OpenAI base URL, `http://<advertise_host or host>:<port>/v1` (set by `start`).
        port: the port listened on (set by `start`; 0 before).

    Raises:
        ValueError: port out of 0-65535, or port_count < 1.
    """

    def __init__(self, tokenizer: Any, host: str = "127.0.0.1", *, port: int = 0, port_count: int = 1,
                 advertise_host: str | None = None):  # fmt: skip
        if not 0 <= port <= 65535 or port_count < 1:
            raise ValueError(f"agent_endpoint_port={port} (x{port_count}) must be a TCP port (0: any free one).")
        self.tokenizer, self.host, self.advertise_host = tokenizer, host, advertise_host
        self._ports = [0] if port == 0 else list(range(port, min(port + port_count, 65536)))
        self.url, self.port = "", 0
        self._sessions: dict[bytes, EpisodeSession] = {}
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        try:
            self._template: dict | None = response_template(tokenizer)
        except ToolFormatError:
            self._template = None  # tools are refused: the tokenizer has no tool-call format to parse
        self.app = self._build_app()

    async def start(self) -> None:
        """Listen on a free port (the first free one of the given range) and serve on the running loop.

        Raises:
            OSError: no port of the range is free (the message names agent_endpoint_port and the fix).
            TimeoutError: the server did not start within START_TIMEOUT_S.
        """
        sock = _listen(self.host, self._ports)
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="agent-endpoint")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent endpoint did not start within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)
        shown = self.advertise_host or self.host
        self.url, self.port = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/v1", port

    async def aclose(self) -> None:
        """Stop serving (every session is revoked first); waits at most STOP_TIMEOUT_S."""
        for session in self._sessions.values():
            session.closed = True
        self._sessions.clear()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, STOP_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the agent endpoint did not stop within %g s", STOP_TIMEOUT_S)
        self._server = self._task = None

    def open_session(
        self,
        client: GenerationClient,
        sampling: SamplingSettings,
        version: Callable[[], int],
        *,
        max_turns: int,
        seed: int | None = None,
    ) -> EpisodeSession:
        """A new episode's session with its own key (see `EpisodeSession`)."""
        key = "ep-" + secrets.token_urlsafe(24)
        session = EpisodeSession(key, client, sampling, version, max_turns, seed)
        self._sessions[hashlib.sha256(key.encode()).digest()] = session
        return session

    def close_session(self, session: EpisodeSession) -> None:
        """Revoke the session's key: later calls with it get 401 (an agent that outlived its episode)."""
        session.closed = True
        self._sessions.pop(hashlib.sha256(session.key.encode()).digest(), None)

    def _session(self, request: Request) -> EpisodeSession:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        session = self._sessions.get(hashlib.sha256(key.encode()).digest()) if scheme.lower() == "bearer" else None
        if session is None:
            raise EndpointRefusal(401, "unknown or revoked API key: use the key the episode was given")
        return session

    def _build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            try:
                self._session(request)
            except EndpointRefusal as err:
                return err.response()
            return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "run"}]})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._serve(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._serve(request, chat=False)

        return app

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except ValueError as err:
                raise EndpointRefusal(400, f"the body is not JSON: {err}", kind="unsupported") from err
            if not isinstance(body, dict):
                raise EndpointRefusal(400, "the body must be a JSON object", kind="unsupported")
            try:
                _error_fields(body, chat)
                reply = await (self._chat(session, body) if chat else self._complete(session, body))
            except EndpointRefusal as err:
                if err.kind == "unsupported":
                    session.refused["unsupported"] += 1
                raise
        except EndpointRefusal as err:
            return err.response()
        if body.get("stream"):
            return StreamingResponse(_sse(_chunks(reply, chat)), media_type="text/event-stream")
        return JSONResponse(reply)

    async def _chat(self, session: EpisodeSession, body: dict) -> dict:
        messages = chat_messages(body["messages"])
        tools = [t for t in body.get("tools") or [] if isinstance(t, Mapping)] or None
        if body.get("tool_choice") == "none":
            tools = None
        if tools and self._template is None:
            raise EndpointRefusal(400, "the policy's tokenizer has no tool-call format, so tools cannot be parsed",
                                  param="tools", kind="unsupported")  # fmt: skip
        try:
            prompt_ids = render_ids(self.tokenizer, messages, tools, add_generation_prompt=True)
        except Exception as err:  # the template refused the conversation (jinja's errors are many)
            raise EndpointRefusal(400, f"the chat template cannot render these messages: {err}"[:500],
                                  param="messages", kind="unsupported") from err  # fmt: skip
        call = await session.generate(prompt_ids, _max_tokens(body), body)
        text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=False)
        if tools:
            prefix = self.tokenizer.decode(prompt_ids[-_PREFIX_TOKENS:], skip_special_tokens=False)
            message = parse_turn(self.tokenizer, self._template, text, prefix, tools).message
        else:
            message = {"role": "assistant", "content": self.tokenizer.decode(call.completion_ids,
                                                                             skip_special_tokens=True)}  # fmt: skip
        if session.first_request is None:
            session.first_request = messages
        session.final_conversation = [*messages, message]
        call_ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in message.get("tool_calls") or []]
        out_message = {"role": "assistant", "content": message.get("content") or None}
        finish = call.finish_reason
        if call_ids:
            out_message["tool_calls"] = openai_tool_calls(message, call_ids)
            finish = "tool_calls" if finish == "stop" else finish
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": str(body.get("model") or MODEL_NAME),
            "choices": [{"index": 0, "message": out_message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(call), "policy_version": call.version,
        }  # fmt: skip

    async def _complete(self, session: EpisodeSession, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer.encode(prompt))  # as vLLM tokenizes a text prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            prompt_ids = [int(i) for i in prompt]
        else:
            raise EndpointRefusal(400, "`prompt` must be a string or a list of token ids", param="prompt",
                                  kind="unsupported")  # fmt: skip
        call = await session.generate(prompt_ids, _max_tokens(body), body)
        text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        if session.first_request is None:
            session.first_request = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
        session.final_conversation = text
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": str(body.get("model") or MODEL_NAME),
            "choices": [{"index": 0, "text": text, "finish_reason": call.finish_reason, "logprobs": None}],
            "usage": _usage(call), "policy_version": call.version,
        }  # fmt: skip


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """The agent's cap on generated tokens (`max_completion_tokens`, else `max_tokens`), or None."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _usage(call: ModelCall) -> dict[str, int]:
    p, c = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chunks(reply: dict, chat: bool) -> list[dict]:
    """A whole reply as OpenAI's stream chunks: (chat) the role, the content, the tool calls, the finish reason;
    (completions) the text, then the finish reason. Each chunk carries the reply's id, model and policy_version."""
    head = {k: reply[k] for k in ("id", "created", "model", "policy_version")}
    choice = reply["choices"][0]
    if not chat:
        kind = {"object": "text_completion"}
        return [
            {**head, **kind, "choices": [{"index": 0, "text": choice["text"], "finish_reason": None}]},
            {**head, **kind, "choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]},
        ]
    kind = {"object": "chat.completion.chunk"}
    message = choice["message"]
    deltas: list[dict] = [{"role": "assistant", "content": ""}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    if message.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]})
    chunks = [{**head, **kind, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**head, **kind, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
    return chunks


async def _sse(chunks: list[dict]) -> AsyncIterator[str]:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
