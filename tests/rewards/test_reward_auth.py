"""The reward service's bearer token: a second layer under the NetworkPolicy. Without the token nothing but
/health answers; the client sends it; the reward workers (submitter code) never see it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from async_grpo.inference.server import free_port
from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool
from async_grpo.rewards.server import build_app
from async_grpo.rewards.wire import AUTH_TOKEN_ENV
from async_grpo.transports.scorer import RewardError

TOKEN = "s3cret-token-for-tests"
BODY = {"prompts": ["p"], "completions": ["a"], "completion_ids": [[1]]}
READY_TIMEOUT_S = 180  # the service reports ready once its workers are warm: minutes on a loaded CI runner


def test_every_route_but_health_needs_the_token():
    pool = RewardPool(["builtin:reverse_format"], None, num_workers=1, timeout_s=5)
    with TestClient(build_app(pool, token=TOKEN)) as http:
        assert http.get("/health").status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": TOKEN},
        ):
            for method, path in (("get", "/v1/reward_functions"), ("post", "/v1/score"), ("get", "/docs")):
                resp = getattr(http, method)(path, headers=headers, **({"json": BODY} if method == "post" else {}))
                assert resp.status_code == 401, (path, headers)
                assert resp.json()["reason"] == "unauthorized" and AUTH_TOKEN_ENV in resp.json()["message"]
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert http.get("/v1/reward_functions", headers=good).json()["names"] == ["reverse_format"]
    with TestClient(build_app(RewardPool(["builtin:reverse_format"], None, 1, 5))) as http:  # no token: open
        assert http.get("/v1/reward_functions").status_code == 200


SEES_TOKEN = f"""
import os
def sees_token(prompts, completions, completion_ids, **kwargs):
    return [float({AUTH_TOKEN_ENV!r} in os.environ) for _ in completions]
"""


@pytest.mark.integration
def test_client_sends_the_token_and_reward_code_never_sees_it(tmp_path, child_pids):
    (tmp_path / "fns.py").write_text(SEES_TOKEN)
    (tmp_path / "config.yaml").write_text(
        f"reward_funcs: ['{tmp_path / 'fns.py'}:sees_token']\nreward_num_workers: 1\n"
    )
    port, before = free_port(), child_pids()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "async_grpo.rewards.server",
            "--config",
            str(tmp_path / "config.yaml"),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env={**os.environ, AUTH_TOKEN_ENV: TOKEN},
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with pytest.raises(RewardError, match="HTTP 401"):
            RemoteRewardPool(url, 5.0, 1, token="", connect_timeout_s=10)  # no token: not served
        with RemoteRewardPool(url, 5.0, 1, token=TOKEN, connect_timeout_s=10) as pool:
            assert pool.submit(**BODY).result(timeout=30).rows == [[0.0]]  # the worker's env has no token
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert child_pids() - before == set()
