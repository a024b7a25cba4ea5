"""Warming the spawned worker pools (`worker_warmup`): every worker imports the user code before the first request,
a closed pool ends a warm-up at once, and the reward service reports ready only once warm."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from async_grpo.inference.server import free_port
from async_grpo.rewards import remote
from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool
from async_grpo.rewards.server import build_app, warm_up
from async_grpo.tools.executor import ToolExecutor
from async_grpo.tools.loading import load_tools
from async_grpo.transports.scorer import RewardError

USER_CODE = '''
import multiprocessing
import os
import pathlib
import time

# every import of this file, in any process, appends that process's id
with pathlib.Path(__file__).with_name("imports.log").open("a") as out:
    out.write(f"{os.getpid()}\\n")
if multiprocessing.parent_process() is not None and pathlib.Path(__file__).with_name("slow").exists():
    time.sleep(60)  # a worker whose import hangs (the parent process imports at once)


def score(completions, **kwargs):
    return [float(len(c)) for c in completions]


def shout(text: str) -> str:
    """Shout the text.

    Args:
        text: what to shout.
    """
    return text.upper()
'''


def user_code(tmp_path: Path, slow: bool = False) -> Path:
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    if slow:
        (tmp_path / "slow").touch()
    return path


def worker_imports(tmp_path: Path) -> set[int]:
    """The processes other than this one that imported the user code."""
    return {int(line) for line in (tmp_path / "imports.log").read_text().split()} - {os.getpid()}


def test_every_reward_worker_imports_the_functions_before_the_first_group(tmp_path):
    with RewardPool([f"{user_code(tmp_path)}:score"], num_workers=2, timeout_s=5) as pool:
        assert worker_imports(tmp_path) == set()  # validated here; no worker started yet
        assert pool.warm(120) == 2
        warm = worker_imports(tmp_path)
        assert len(warm) == 2
        prompts = ["p"] * 2
        scored = pool.submit(prompts, ["a", "bbb"], [[1], [2, 2, 2]]).result(timeout=60)
        assert scored.rows == [[1.0], [3.0]]
        assert worker_imports(tmp_path) == warm  # scored by a warm worker: no import on the request's time


def test_every_tool_worker_imports_the_tools_before_the_first_call(tmp_path):
    tools = load_tools([f"{user_code(tmp_path)}:shout"])
    with ToolExecutor(tools, num_workers=2, timeout_s=5) as executor:
        assert executor.warm(120) == 2
        warm = worker_imports(tmp_path)
        assert len(warm) == 2
        assert executor.submit("shout", {"text": "hi"}).result(timeout=60).content == "HI"
        assert worker_imports(tmp_path) == warm


def test_closing_the_pool_ends_a_warm_up_that_waits_on_a_hanging_import(tmp_path):
    pool = RewardPool([f"{user_code(tmp_path, slow=True)}:score"], num_workers=1, timeout_s=5)
    result: list[int] = []
    warming = threading.Thread(target=lambda: result.append(pool.warm(120)))
    t0 = time.monotonic()
    warming.start()
    time.sleep(1.0)
    pool.close()
    warming.join(30)
    assert not warming.is_alive() and result == [0]
    assert time.monotonic() - t0 < 30  # not the 60 s import, nor the 120 s deadline


def test_a_warm_up_past_its_deadline_reports_the_workers_it_reached(tmp_path):
    with RewardPool([f"{user_code(tmp_path, slow=True)}:score"], num_workers=1, timeout_s=5) as pool:
        t0 = time.monotonic()
        assert pool.warm(2.0) == 0
        assert time.monotonic() - t0 < 20


def test_the_service_reports_ready_only_once_its_workers_are_warm(tmp_path):
    pool = RewardPool([f"{user_code(tmp_path)}:score"], num_workers=2, timeout_s=5)
    ready = threading.Event()
    with TestClient(build_app(pool, ready=ready)) as http:
        starting = http.get("/health")
        assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
        warm_up(pool, None, ready, timeout_s=120)
        assert len(worker_imports(tmp_path)) == 2
        assert http.get("/health").json() == {"status": "ok"}


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` on a real uvicorn server in a thread of this process; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_trainer_waits_for_a_starting_service_beyond_its_connect_timeout(tmp_path, monkeypatch):
    pool = RewardPool([f"{user_code(tmp_path)}:score"], num_workers=1, timeout_s=5)
    ready = threading.Event()
    with serving(build_app(pool, ready=ready)) as url:
        monkeypatch.setattr(remote, "STARTING_TIMEOUT_S", 2.0)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"not ready within 2 s \(last: HTTP 503 .*starting"):
            RemoteRewardPool(url, 5.0, connect_timeout_s=0.5)
        assert time.monotonic() - t0 >= 2.0  # it waited past its connect timeout: the service said "starting"
        monkeypatch.setattr(remote, "STARTING_TIMEOUT_S", 60.0)
        threading.Timer(2.0, ready.set).start()
        t0 = time.monotonic()
        with RemoteRewardPool(url, 5.0, connect_timeout_s=0.5) as client:
            assert time.monotonic() - t0 >= 1.5
            assert client.submit(["p"], ["abcd"], [[1, 2, 3, 4]]).result(timeout=60).rows == [[4.0]]
