"""A stub vLLM teacher for unit tests: a real HTTP server on 127.0.0.1 answering `/v1/models` and `/v1/completions`
with `prompt_logprobs` the way vLLM 0.32 does (a None first, then one ``{"<token id>": {"logprob", "rank",
"decoded_token"}}`` per prompt token), its logprobs a known function of the token and its position (`fake_logprob`).
With ``prompt_logprobs`` = K > 0 each position's dict holds, as vLLM's does, the actual token's entry first (its rank
above K) and then the K most likely tokens, ranks 1..K (`fake_topk`, ids from TOPK_BASE: never a sampled id here).
Tests script failures (`StubTeacher.script`) and read back what it received (`requests`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-teacher"
TOPK_BASE = 1000  # the stub's top-k ids are TOPK_BASE + ..., apart from the test completions' ids (< TOPK_BASE)


def fake_logprob(token: int, position: int) -> float:
    """The stub teacher's logprob of `token` at `position` of a prompt (nats)."""
    return -0.01 * token - 0.001 * position


def expected(prompt: list[int], completion: list[int]) -> list[float]:
    """What `TeacherClient.score` should return for one completion against the stub."""
    return [fake_logprob(t, len(prompt) + i) for i, t in enumerate(completion)]


def fake_topk(position: int, k: int) -> list[tuple[int, float]]:
    """The stub teacher's `k` most likely (token id, logprob) at `position` of a prompt, most likely first."""
    return [(TOPK_BASE + position + j, -0.001 * (j + 1) - 0.0001 * position) for j in range(k)]


def expected_topk(prompt: list[int], completion: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """What `TeacherClient.score_group` should return as one completion's `topk_ids` and `topk_logprobs`."""
    rows = [fake_topk(len(prompt) + i, k) for i in range(len(completion))]
    return [[t for t, _ in row] for row in rows], [[lp for _, lp in row] for row in rows]


class StubTeacher(ThreadingHTTPServer):
    """The stub server. `script` holds actions for the next `/completions` requests, one each, in order (then every
    request is answered): ("status", code, text), ("sleep", seconds) before answering, ("close",) drops the
    connection, ("json", body) answers `body`, or a callable (request body -> None or an action). `requests` records
    (method, path, headers, body) of every request; `in_flight_max` the most `/completions` requests at once.

    Use as a context manager: it serves on a thread and stops at exit."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *, answer_delay_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list = []
        self.rule: Callable[[dict], tuple | None] | None = None
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.answer_delay_s = answer_delay_s
        self.lock = threading.Lock()
        self.in_flight = 0
        self.in_flight_max = 0
        self.reverse_choices = True  # vLLM does not promise the order: the client sorts by index
        self.max_model_len: int | None = None  # reported by GET /models when set (vLLM's model card field)
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        """The base URL a `TeacherClient` takes (ends in /v1)."""
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (a time-out) or a dropped connection: nothing to report."""

    def completions(self) -> list[dict]:
        """The bodies of the `/completions` requests received."""
        return [body for _, path, _, body in self.requests if path == "/v1/completions"]

    def __enter__(self) -> StubTeacher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


def answer(body: dict) -> dict:
    """vLLM's answer to a `/completions` request with prompt_logprobs=K (the choices in index order): K = 0, the
    actual token's entry alone; K > 0, the actual token's entry (rank K + 1 + its id) then the top K (ranks 1..K)."""
    prompts = body["prompt"]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    k = body.get("prompt_logprobs") or 0
    choices = []
    for i, seq in enumerate(prompts):
        entries: list[dict | None] = [None]
        for p, t in enumerate(seq):
            if p == 0:
                continue
            rank = 1 if k == 0 else k + 1 + t
            entry = {str(t): {"logprob": fake_logprob(t, p), "rank": rank, "decoded_token": chr(t % 128)}}
            for rank, (top, logprob) in enumerate(fake_topk(p, k), start=1):
                entry[str(top)] = {"logprob": logprob, "rank": rank, "decoded_token": chr(top % 128)}
            entries.append(entry)
        choices.append({"index": i, "text": "x", "prompt_logprobs": entries, "finish_reason": "length"})
    return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StubTeacher

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path, dict(self.headers), None))
        if self.path == "/v1/models":
            card = {"id": MODEL, "object": "model"}
            if self.server.max_model_len is not None:
                card["max_model_len"] = self.server.max_model_len
            self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        server = self.server
        with server.lock:
            server.requests.append(("POST", self.path, dict(self.headers), body))
            action = server.script.pop(0) if server.script else None
            server.in_flight += 1
            server.in_flight_max = max(server.in_flight_max, server.in_flight)
        try:
            if action is None and server.rule is not None:
                action = server.rule(body)
            if server.answer_delay_s:
                time.sleep(server.answer_delay_s)
            if action is not None and action[0] == "sleep":
                time.sleep(action[1])
                action = None
            if action is None:
                out = answer(body)
                if server.reverse_choices:
                    out["choices"].reverse()
                self._send(200, json.dumps(out).encode())
            elif action[0] == "status":
                self._send(action[1], action[2].encode(), "text/plain")
            elif action[0] == "json":
                self._send(200, json.dumps(action[1]).encode())
            elif action[0] == "close":
                self.close_connection = True
                self.connection.close()
        finally:
            with server.lock:
                server.in_flight -= 1
