"""The bearer-token guard on vLLM's routes: our middleware (dev-mode routes) loaded through vLLM's own
`--middleware` seam, and the clients that send VLLM_API_KEY."""

from __future__ import annotations

import inspect
from argparse import Namespace

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from async_grpo.inference import client as vllm_client
from async_grpo.inference.auth import BearerTokenMiddleware
from async_grpo.launch.k8s_objects import VLLM_AUTH_MIDDLEWARE

TOKEN = "vllm-token-for-tests"
# vLLM's dev-mode and RL routes (vllm/entrypoints/rl/online/api_router.py, serve/dev/) and inference routes
GUARDED = [
    "/pause",
    "/resume",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/collective_rpc",
    "/get_world_size",
    "/weight_info",
    "/v1/models",
    "/v1/completions",
    "/sleep",
    "/reset_prefix_cache",
    "/metrics",
    "/server_info",
]


def _app() -> Starlette:
    async def ok(request):
        return JSONResponse({"ok": True})

    routes = [Route(p, ok, methods=["GET", "POST"]) for p in GUARDED + ["/health"]]
    return Starlette(routes=routes)


def test_every_route_but_health_needs_the_token(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    app = _app()
    app.add_middleware(BearerTokenMiddleware)  # as vLLM's --middleware does: no arguments, env token
    http = TestClient(app)
    assert http.get("/health").status_code == 200
    for path in GUARDED:
        assert http.post(path).status_code == 401, path
        assert http.post(path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
        assert http.post(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path


def test_an_empty_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty"):
        BearerTokenMiddleware(_app())


def test_vllm_loads_it_through_its_middleware_flag(monkeypatch):
    """The pinned vLLM's own wiring: `--middleware <path>` adds our class; `VLLM_API_KEY` adds vLLM's guard."""
    from fastapi import FastAPI
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    app = FastAPI()
    args = Namespace(
        allowed_origins=["*"],
        allow_credentials=False,
        allowed_methods=["*"],
        allowed_headers=["*"],
        api_key=None,
        enable_request_id_headers=False,
        middleware=[VLLM_AUTH_MIDDLEWARE],
    )
    init_entrypoints_middleware(args, app, ())
    classes = [m.cls for m in app.user_middleware]
    assert BearerTokenMiddleware in classes and AuthenticationMiddleware in classes


def test_clients_send_the_token(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    assert vllm_client.VLLMControlClient("http://x").headers == {"Authorization": f"Bearer {TOKEN}"}
    assert vllm_client.AsyncVLLMClient("http://x", "m")._http.headers["authorization"] == f"Bearer {TOKEN}"
    assert vllm_client.VLLMControlClient("http://x", api_key="other").headers == {"Authorization": "Bearer other"}
    sent = {}

    class Response:
        def raise_for_status(self):
            pass

    def post(url, **kwargs):
        sent.update(url=url, **kwargs)
        return Response()

    monkeypatch.setattr(vllm_client.requests, "post", post)
    vllm_client.VersionedWeightSyncClient("http://x", timeout=5).start_weight_update()
    assert sent["url"] == "http://x/start_weight_update" and sent["headers"] == {"Authorization": f"Bearer {TOKEN}"}
    monkeypatch.delenv("VLLM_API_KEY")
    assert vllm_client.VLLMControlClient("http://x").headers == {}  # local runs: no token


def test_the_weight_sync_override_matches_vllms_private_seam():
    """vLLM's HTTP client has no header hook; we override its `_post`. Fail loudly if vLLM renames it."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    assert list(inspect.signature(HTTPVLLMWeightSyncClient._post).parameters) == ["self", "path", "json"]
    source = inspect.getsource(HTTPVLLMWeightSyncClient)
    for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
        body = inspect.getsource(getattr(HTTPVLLMWeightSyncClient, method))
        assert "self._post(" in body, method
    assert source.count("requests.post(") == 1  # _post is its only HTTP call
