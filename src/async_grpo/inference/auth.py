"""A bearer-token guard for every vLLM route but /health, loaded through vLLM's `--middleware` flag.

vLLM's own `--api-key` / VLLM_API_KEY guards only the inference routes (/v1, /v2, /inference, /cohere);
the dev-mode control plane (/pause, /init_weight_transfer_engine, /update_weights, /collective_rpc, ...)
that can replace the served weights stays open. This middleware reads the same VLLM_API_KEY and asks
for it everywhere except /health (the kubelet's probes carry no token), as a second layer under the
run's NetworkPolicies. It imports only the standard library and starlette, which vLLM ships.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

API_KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def bearer_ok(header: str | None, token_digest: bytes) -> bool:
    """True when `header` is `Bearer <token>` and sha256(token) equals `token_digest` (constant-time)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(value.encode()).digest(), token_digest)


class BearerTokenMiddleware:
    """Pure ASGI middleware: 401 unless `Authorization: Bearer $VLLM_API_KEY`, except OPEN_PATHS and OPTIONS.

    Args:
        app: the wrapped ASGI app.
        token: the expected token; None reads env VLLM_API_KEY.

    Raises:
        RuntimeError: no token given and VLLM_API_KEY is unset or empty (serving the control plane
            unguarded is never what a deployment that loads this middleware wants).
    """

    def __init__(self, app: ASGIApp, token: str | None = None):
        token = token if token is not None else os.environ.get(API_KEY_ENV, "")
        if not token:
            raise RuntimeError(
                f"{API_KEY_ENV} is empty, so the bearer-token middleware cannot guard vLLM. Fix: set "
                f"it (on Kubernetes it comes from the run's tokens Secret), or drop --middleware."
            )
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        """Pass lifespan events, OPTIONS and OPEN_PATHS through; check the token on everything else."""
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path in OPEN_PATHS or bearer_ok(headers.get("authorization"), self._digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
