"""The reward service over real HTTP: a `python -m async_grpo.rewards.server` subprocess, its client
`RemoteRewardPool`, and `make_reward_pool` choosing between it and the local pool."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import ValidationError

from async_grpo.config import GRPOConfig
from async_grpo.inference.server import free_port
from async_grpo.launch.k8s_objects import REWARD_URL_ENV
from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool, make_reward_pool
from async_grpo.rewards.server import build_app, main
from async_grpo.rewards.wire import decode_scored, encode_scored
from async_grpo.transports.scorer import RewardBadOutput, RewardError, RewardTimeout, ScoredGroup

FNS = Path(__file__).with_name("reward_fns.py")
SPECS = [f"{FNS}:length_reward", f"{FNS}:abstain_odd", f"{FNS}:flaky_reward"]
NAMES = ["length_reward", "abstain_odd", "flaky_reward"]
WEIGHTS = [1.0, 0.5, 2.0]
TIMEOUT_S = 2.0
RESULT_TIMEOUT_S = 30
READY_TIMEOUT_S = 180  # the service reports ready once its workers are warm: minutes on a loaded CI runner
STOP_TIMEOUT_S = 20


def group(*completions: str) -> dict:
    """submit() arguments for one group of len(completions)."""
    g = len(completions)
    return {
        "prompts": ["p"] * g,
        "completions": list(completions),
        "completion_ids": [[ord(ch) for ch in c] for c in completions],
        "columns": {"answer": ["a"] * g},
    }


GROUP = group("a", "bb", "ccc", "x")
EXPECTED = [[1.0, 1.0, 1.0], [2.0, math.nan, 1.0], [3.0, 1.0, 1.0], [1.0, math.nan, 1.0]]


def same(rows: list[list[float]], expected: list[list[float]]) -> bool:
    """Equal (G, F) rows, NaN equal to NaN."""
    return len(rows) == len(expected) and all(
        len(r) == len(e) and all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(r, e))
        for r, e in zip(rows, expected)
    )


def write_config(path: Path, **fields) -> Path:
    data = {"reward_funcs": SPECS, "reward_weights": WEIGHTS, "reward_timeout_s": TIMEOUT_S, "reward_num_workers": 2}
    path.write_text(yaml.safe_dump({**data, **fields}))
    return path


def run_config(**fields) -> GRPOConfig:
    return GRPOConfig(reward_funcs=SPECS, reward_weights=WEIGHTS, reward_timeout_s=TIMEOUT_S, **fields)


def start_server(config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start the service on a free port and wait for /health (fails with the log if the server exits)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "async_grpo.rewards.server",
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-workers",
                "2",
                "--log-level",
                "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"reward server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    pytest.fail(f"reward server not ready within {READY_TIMEOUT_S} s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM, as Kubernetes stops a pod; kill (and fail) if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
        pytest.fail(f"reward server ignored SIGTERM for {STOP_TIMEOUT_S} s")


def running(p: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whichever process adopted it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One service for the module: SPECS with WEIGHTS, a 2 s timeout, 2 workers. Yields (process, URL)."""
    tmp = tmp_path_factory.mktemp("reward-server")
    proc, url = start_server(write_config(tmp / "config.yaml"), tmp / "server.log")
    try:
        yield proc, url
    finally:
        assert stop_server(proc) == 0, (tmp / "server.log").read_text()


@pytest.fixture(scope="module")
def server(shared_server):
    """The shared service's URL."""
    return shared_server[1]


@pytest.fixture(scope="module")
def remote(server):
    with RemoteRewardPool(server, TIMEOUT_S, 2, expected_names=NAMES, expected_weights=WEIGHTS) as pool:
        yield pool


def assert_remote_works(pool: RemoteRewardPool) -> None:
    assert same(pool.submit(**GROUP).result(timeout=RESULT_TIMEOUT_S).rows, EXPECTED)


# ------------------------------------------------------------------------------------------ in-process app
def test_app_serves_health_functions_and_names_bad_fields():
    pool = RewardPool(SPECS, WEIGHTS, num_workers=1, timeout_s=TIMEOUT_S)  # no request reaches a worker
    with TestClient(build_app(pool)) as http:
        assert http.get("/health").json() == {"status": "ok"}
        info = http.get("/v1/reward_functions").json()
        assert (info["names"], info["weights"], info["timeout_s"]) == (NAMES, WEIGHTS, TIMEOUT_S)
        cases = [
            ({**group("a", "b"), "prompts": ["p"]}, "prompts has 1 entries but completions has 2"),
            ({**group("a", "b"), "columns": {"answer": ["x"]}}, "columns.answer has 1 entries but completions has 2"),
            ({**group("a"), "completion_ids": [["x"]]}, "completion_ids.0.0: Input should be a valid integer"),
            ({"prompts": [], "completions": [], "completion_ids": []}, "completions is empty"),
            ({"prompts": ["p"], "completion_ids": [[1]]}, "completions: Field required"),
            ({**group("a"), "colums": {}}, "colums: Extra inputs are not permitted"),
        ]
        for body, message in cases:
            resp = http.post("/v1/score", json=body)
            assert resp.status_code == 422, body
            assert message in resp.json()["message"] and "Fix:" in resp.json()["message"], resp.json()
    assert pool.closed  # the app's lifespan closed its pool


def test_main_exits_2_naming_the_problem(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--config", str(write_config(tmp_path / "a.yaml", reward_timeout_s=-1))]) == 2
    assert "reward_timeout_s" in capsys.readouterr().err
    assert (
        main(["--config", str(write_config(tmp_path / "b.yaml", reward_funcs=["builtin:typo"], reward_weights=None))])
        == 2
    )
    assert "no builtin reward 'typo'" in capsys.readouterr().err


def test_reward_url_must_be_http():
    with pytest.raises(ValidationError, match="reward_url"):
        GRPOConfig(reward_url="reward-service:8080")


# ------------------------------------------------------------------------------------------ over HTTP
@pytest.mark.integration
def test_remote_scores_exactly_like_the_local_pool(remote):
    assert (remote.names, remote.weights, remote.timeout_s) == (NAMES, WEIGHTS, TIMEOUT_S)
    with RewardPool(SPECS, WEIGHTS, num_workers=1, timeout_s=TIMEOUT_S) as local:
        expected = local.submit(**GROUP).result(timeout=RESULT_TIMEOUT_S)
    assert same(expected.rows, EXPECTED)
    futures = [remote.submit(**GROUP) for _ in range(3)]  # more than max_concurrency: they queue client-side
    for fut in futures:
        assert same(fut.result(timeout=RESULT_TIMEOUT_S).rows, expected.rows)


@pytest.mark.integration
def test_none_travels_as_json_null(server):
    resp = httpx.post(f"{server}/v1/score", json=group("a", "bb"), timeout=RESULT_TIMEOUT_S)
    assert resp.status_code == 200 and "NaN" not in resp.text
    body = resp.json()
    assert {k: body[k] for k in ("rewards", "extra", "metrics")} == {
        "rewards": [[1.0, 1.0, 1.0], [2.0, None, 1.0]],
        "extra": {},
        "metrics": {},
    }
    assert set(body["seconds"]) == set(NAMES) and all(s >= 0 for s in body["seconds"].values())


def test_the_wire_carries_each_functions_seconds_and_an_older_service_without_them_decodes_to_empty():
    scored = ScoredGroup([[1.0, math.nan]], {"col": ["x"]}, {"m": [1.0]}, {"length_reward": 0.25, "abstain_odd": 2.0})
    body = json.loads(json.dumps(encode_scored(scored)))  # through JSON, as the service answers
    assert body["seconds"] == {"length_reward": 0.25, "abstain_odd": 2.0}
    decoded = decode_scored(body, 1, 2)
    assert decoded.seconds == {"length_reward": 0.25, "abstain_odd": 2.0}
    assert decoded.extra == {"col": ["x"]} and decoded.metrics == {"m": [1.0]} and math.isnan(decoded.rows[0][1])
    older = {"rewards": [[1.0, None]], "extra": {}, "metrics": {}}  # a service from before `seconds`
    assert decode_scored(older, 1, 2).seconds == {}
    assert decode_scored({"rewards": [[1.0, None]]}, 1, 2).seconds == {}
    odd = {"rewards": [[1.0, None]], "seconds": {"a": "slow", "b": True, "c": 1, "d": None}}
    assert decode_scored(odd, 1, 2).seconds == {"c": 1.0}  # only finite numbers
    assert decode_scored({"rewards": [[1.0, None]], "seconds": [1.0]}, 1, 2).seconds == {}


@pytest.mark.integration
def test_the_remote_pool_returns_the_services_seconds(remote):
    scored = remote.submit(**GROUP).result(timeout=RESULT_TIMEOUT_S)
    assert set(scored.seconds) == set(NAMES) and all(s >= 0 for s in scored.seconds.values())


@pytest.mark.integration
def test_raising_function_is_a_reward_error_naming_it(remote):
    with pytest.raises(RewardError) as info:
        remote.submit(**group("RAISE", "a")).result(timeout=RESULT_TIMEOUT_S)
    err = info.value
    assert type(err) is RewardError and err.reason == "reward_error" and err.function == "flaky_reward"
    assert "ZeroDivisionError: boom in the reward" in str(err) and "Fix:" in str(err)
    assert_remote_works(remote)


@pytest.mark.integration
def test_hanging_function_is_a_reward_timeout(remote):
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"reward_timeout_s=2 s") as info:
        remote.submit(**group("HANG", "a")).result(timeout=RESULT_TIMEOUT_S)
    assert time.monotonic() - start < 8
    assert info.value.reason == "reward_timeout"
    assert_remote_works(remote)  # the server's pool replaced the killed worker


@pytest.mark.integration
def test_wrong_length_is_bad_output(remote):
    with pytest.raises(RewardBadOutput, match="returned 1 values for 2 completions") as info:
        remote.submit(**group("SHORT", "a")).result(timeout=RESULT_TIMEOUT_S)
    assert info.value.reason == "reward_bad_output" and info.value.function == "flaky_reward"


@pytest.mark.integration
def test_inconsistent_lengths_and_unencodable_columns_fail_clearly(remote, server):
    with pytest.raises(ValueError, match=r"columns\['answer'\]"):
        remote.submit(["p"], ["a"], [[1]], {"answer": ["a", "b"]})
    with pytest.raises(ValueError, match="G >= 1"):
        remote.submit([], [], [])
    resp = httpx.post(f"{server}/v1/score", json={**group("a", "b"), "completion_ids": [[1]]}, timeout=10)
    assert resp.status_code == 422 and "completion_ids has 1 entries" in resp.json()["message"]
    with pytest.raises(RewardError, match="as JSON") as info:  # a counted failure, not a crash of the caller
        remote.submit(**{**group("a"), "columns": {"answer": [{1, 2}]}}).result(timeout=RESULT_TIMEOUT_S)
    assert info.value.reason == "reward_error"


@pytest.mark.integration
def test_other_functions_or_weights_on_the_server_are_refused(server):
    with pytest.raises(ValueError, match=r"serves reward functions \['length_reward'.*name \['length_reward'\]"):
        RemoteRewardPool(server, TIMEOUT_S, expected_names=["length_reward"])
    with pytest.raises(ValueError, match="reward_weights are"):
        RemoteRewardPool(server, TIMEOUT_S, expected_names=NAMES, expected_weights=[1.0, 1.0, 1.0])


@pytest.mark.integration
def test_close_fails_pending_groups(server):
    pool = RemoteRewardPool(server, TIMEOUT_S)
    pending = pool.submit(**group("HANG", "a"))
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RewardError, match="closed") as info:
        pending.result(timeout=5)
    assert info.value.reason == "reward_error"
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(**GROUP)


def test_unreachable_service_is_a_reward_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"{url} was not ready within 1 s .*Fix:"):
        RemoteRewardPool(url, TIMEOUT_S, connect_timeout_s=1)
    assert time.monotonic() - start < 5


@pytest.mark.integration
def test_sigterm_stops_server_and_workers_and_the_client_sees_it_down(tmp_path, child_pids, shared_server):
    def ours() -> set[int]:  # descendants of this test process, less the shared server's (it may replace a worker)
        shared = psutil.Process(shared_server[0].pid)
        return child_pids() - {shared.pid} - {p.pid for p in shared.children(recursive=True)}

    before = ours()
    proc, url = start_server(write_config(tmp_path / "config.yaml"), tmp_path / "server.log")
    pool = RemoteRewardPool(url, TIMEOUT_S)
    try:
        assert_remote_works(pool)  # the server's worker processes exist now
        procs = psutil.Process(proc.pid).children(recursive=True)
        tree = {p.pid: " ".join(p.cmdline()) for p in procs}
        assert any("spawn_main" in cmd for cmd in tree.values()), tree
        assert stop_server(proc) == 0, (tmp_path / "server.log").read_text()
        # the workers are gone too, not orphaned (multiprocessing's resource tracker exits on its own,
        # once it sees the server's end of its pipe close)
        deadline = time.monotonic() + 5
        while (left := {p.pid: tree[p.pid] for p in procs if running(p)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left
        assert ours() - before == set()
        with pytest.raises(RewardError, match=rf"could not reach the reward service at {url}.*Fix:") as info:
            pool.submit(**GROUP).result(timeout=RESULT_TIMEOUT_S)
        assert info.value.reason == "reward_error"
    finally:
        pool.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


# ------------------------------------------------------------------------------------------ make_reward_pool
def test_make_reward_pool_is_local_without_a_url(monkeypatch):
    monkeypatch.delenv(REWARD_URL_ENV, raising=False)
    with make_reward_pool(run_config()) as pool:
        assert isinstance(pool, RewardPool) and pool.names == NAMES


@pytest.mark.integration
def test_make_reward_pool_is_remote_from_config_env_or_argument(server, monkeypatch):
    monkeypatch.delenv(REWARD_URL_ENV, raising=False)
    with make_reward_pool(run_config(reward_url=server)) as pool:
        assert isinstance(pool, RemoteRewardPool) and pool.url == server and pool.names == NAMES
    monkeypatch.setenv(REWARD_URL_ENV, server)
    with make_reward_pool(run_config()) as pool:
        assert isinstance(pool, RemoteRewardPool) and pool.url == server
        assert_remote_works(pool)
    dead = f"http://127.0.0.1:{free_port()}"
    with make_reward_pool(run_config(reward_url=dead), url=server) as pool:  # the argument wins
        assert isinstance(pool, RemoteRewardPool) and pool.url == server
    with pytest.raises(ValueError, match="serves reward functions"):
        make_reward_pool(GRPOConfig(reward_funcs=[f"{FNS}:length_reward"], reward_timeout_s=TIMEOUT_S))
