"""The vLLM client drops an idle pooled connection before the server's keep-alive ends (`KEEPALIVE_EXPIRY_S`).

At httpx's default expiry (5 s, vLLM's and uvicorn's keep-alive too) the client could reuse a connection just as the
server closed it; the request then failed with ReadError('') on a live server, which marked the server lost and spent
one of `max_inference_restarts` (seen in the tool-calling example, once in about 300 steps)."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import vllm.envs

from async_grpo.inference.client import KEEPALIVE_EXPIRY_S, AsyncVLLMClient, GenerationError
from async_grpo.rewards import server as reward_server
from async_grpo.rewards.remote import KEEPALIVE_EXPIRY_S as REWARD_KEEPALIVE_EXPIRY_S


class CountingServer(ThreadingHTTPServer):
    """An HTTP/1.1 server that keeps connections open and counts the connections it accepted."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0

    def get_request(self):
        self.connections += 1
        return super().get_request()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive until the client closes

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        body = b"no model here"
        self.send_response(503)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_idle_connection_is_not_reused_past_the_expiry():
    server = CountingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def requests() -> list[int]:
        client = AsyncVLLMClient(f"http://127.0.0.1:{server.server_address[1]}", "m", timeout_s=10)
        seen = []
        try:
            for pause in (0.0, 0.2, KEEPALIVE_EXPIRY_S + 0.8):
                await asyncio.sleep(pause)
                with pytest.raises(GenerationError, match="503"):
                    await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0)
                seen.append(server.connections)
        finally:
            await client.aclose()
        return seen

    try:
        start = time.monotonic()
        assert asyncio.run(requests()) == [1, 1, 2]  # reused while fresh, a new one after the expiry
        assert time.monotonic() - start < 10
    finally:
        server.shutdown()
        server.server_close()


def test_clients_expire_idle_connections_before_the_servers_close_them():
    assert KEEPALIVE_EXPIRY_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE  # vLLM's server keep-alive (5 s)
    assert REWARD_KEEPALIVE_EXPIRY_S < reward_server.KEEPALIVE_S
