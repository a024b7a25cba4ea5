"""Agent episodes on the reward service (how they run on Kubernetes): a real `python -m async_grpo.rewards.server`
subprocess running a function agent (tests/agents/remote_agent_fns.py), its client `RemoteAgentRunner`, and the
agent calling a real `AgentEndpoint` served here with a scripted generation client. The outcome comes back as a
local runner gives it, failures of the service are `exception` outcomes, cancellation reaches the service; the
rollout uses the service when one is set and the trainer's preflight never imports the agent then."""

from __future__ import annotations

import asyncio
import socket
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from async_grpo.agents import remote
from async_grpo.agents.endpoint import AgentEndpoint
from async_grpo.agents.execution import AgentOutcome
from async_grpo.agents.remote import (
    AgentServiceError,
    EndpointBinding,
    RemoteAgentRunner,
    endpoint_binding,
    outcome_from_json,
    outcome_to_json,
)
from async_grpo.config import GRPOConfig
from async_grpo.inference.server import free_port
from async_grpo.launch.k8s_pods import POD_IP_ENV
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.preflight import preflight
from async_grpo.runner.tool_setup import build_agent_rollout
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.render import render_ids
from tests.agents.test_endpoint import TextClient
from tests.agents.test_rollout import AgentRewardScorer, item, run
from tests.rewards.test_reward_server import start_server, stop_server

SPEC = f"{Path(__file__).with_name('remote_agent_fns.py')}:agent"
TOKEN = "s3cret-agent-token"
AGENT_TIMEOUT_S = 3.0
PROMPT = [{"role": "user", "content": "6*7?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The reward service of a run whose agent is SPEC (agent_timeout_s 3 s), with TOKEN. Yields its URL."""
    tmp = tmp_path_factory.mktemp("agent-service")
    config = tmp / "config.yaml"
    fields = {"reward_funcs": ["builtin:agent_reward"], "agent": SPEC, "agent_timeout_s": AGENT_TIMEOUT_S}
    config.write_text(yaml.safe_dump(fields))
    mp = pytest.MonkeyPatch()
    mp.setenv("ASYNC_GRPO_REWARD_TOKEN", TOKEN)
    proc, url = start_server(config, tmp / "server.log")
    mp.undo()
    yield url
    assert stop_server(proc) == 0, (tmp / "server.log").read_text()


def episode(tok, client, body, max_turns=4):
    """Serve an endpoint here, open one session and run `body(endpoint, session)` on the loop; (result, session)."""

    async def main():
        endpoint = AgentEndpoint(tok)
        await endpoint.start()
        session = endpoint.open_session(client, SamplingSettings(1, 100, 0.7), lambda: 5, max_turns=max_turns)
        try:
            return await body(endpoint, session), session
        finally:
            await endpoint.aclose()

    return asyncio.run(main())


def test_a_function_agent_runs_on_the_service_against_the_trainers_endpoint(tok, service):
    runner = RemoteAgentRunner(service, TOKEN, agent=SPEC)  # checks the service runs this run's agent
    client = TextClient(tok, ["42<|im_end|>"])
    row = {"prompt": PROMPT, "answer": "42"}

    async def body(endpoint, session):
        return await runner.run(row, endpoint.url, session.key, 10.0)

    outcome, session = episode(tok, client, body)
    assert outcome.fault is None and outcome.value == 1.0 and outcome.seconds > 0, outcome
    # the call the service's agent made was served here, by the run's sampling, and recorded exactly
    (call,) = session.calls
    assert client.requests[0]["prompt_ids"] == render_ids(tok, PROMPT, None, add_generation_prompt=True)
    assert client.requests[0]["temperature"] == 0.7
    assert call.completion_ids == tok.encode("42<|im_end|>", add_special_tokens=False) and call.version == 5
    assert session.final_conversation[-1] == {"role": "assistant", "content": "42"}


def test_failed_episodes_come_back_as_outcomes_and_the_service_caps_the_timeout(tok, service):
    runner = RemoteAgentRunner(service, TOKEN)

    async def body(endpoint, session):
        raised = await runner.run({"mode": "raise", "answer": "x"}, endpoint.url, session.key, 10.0)
        start = time.monotonic()
        slow = await runner.run({"mode": "sleep", "sleep_s": 60, "marker": "/dev/null"}, endpoint.url, session.key,
                                600.0)  # fmt: skip
        return raised, slow, time.monotonic() - start

    (raised, slow, waited), _ = episode(tok, TextClient(tok, []), body)
    assert raised.fault == "exception" and raised.value is None
    assert "RuntimeError: agent bug on 'x'" in raised.log  # the service's traceback, as a local runner logs it
    assert slow.fault == "timeout" and f"agent_timeout_s={AGENT_TIMEOUT_S:g}" in slow.log
    assert AGENT_TIMEOUT_S <= waited < AGENT_TIMEOUT_S + 5  # the service's agent_timeout_s, not the asked 600 s


def test_the_function_agent_does_not_see_the_services_token(tok, service):
    async def body(endpoint, session):
        return await RemoteAgentRunner(service, TOKEN).run({"mode": "env"}, endpoint.url, session.key, 10.0)

    outcome, _ = episode(tok, TextClient(tok, []), body)
    assert outcome == AgentOutcome(0.0, None, "", outcome.seconds)  # popped from the server's env at its start


def test_cancelling_an_episode_cancels_it_on_the_service(tok, service, tmp_path):
    marker = tmp_path / "cancelled"

    async def body(endpoint, session):
        task = asyncio.ensure_future(
            RemoteAgentRunner(service, TOKEN).run(
                {"mode": "sleep", "sleep_s": 60, "marker": str(marker)}, endpoint.url, session.key, 60.0
            )
        )
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the service polls its client's connection about once a second
            if marker.exists():
                break
            await asyncio.sleep(0.1)

    episode(tok, TextClient(tok, []), body)
    assert marker.read_text() == "cancelled"


def test_an_unreachable_or_refusing_service_is_an_exception_outcome_never_a_crash(tok, service):
    down = f"http://127.0.0.1:{free_port()}"

    async def body(endpoint, session):
        return (
            await RemoteAgentRunner(down, TOKEN).run({"prompt": PROMPT}, endpoint.url, session.key, 5.0),
            await RemoteAgentRunner(service, "wrong").run({"prompt": PROMPT}, endpoint.url, session.key, 5.0),
            await RemoteAgentRunner(service, TOKEN).run({"prompt": PROMPT}, endpoint.url, session.key, -1.0),
        )

    (unreachable, unauthorized, malformed), session = episode(tok, TextClient(tok, []), body)
    for outcome in (unreachable, unauthorized, malformed):
        assert outcome.fault == "exception" and outcome.value is None
        assert "did not run the episode" in outcome.log and "Fix:" in outcome.log
    assert "ConnectError" in unreachable.log
    assert "HTTP 401" in unauthorized.log and "unauthorized" in unauthorized.log
    assert "HTTP 422" in malformed.log and "invalid agent episode request: timeout_s:" in malformed.log
    assert session.calls == []


def test_the_runner_refuses_a_service_that_runs_another_agent_or_none(service):
    with pytest.raises(AgentServiceError, match="runs agent=.*this run declares agent='other.py:run'.*Fix:"):
        RemoteAgentRunner(service, TOKEN, agent="other.py:run")
    with pytest.raises(AgentServiceError, match=r"agent_command=\['python', 'a.py'\]"):
        RemoteAgentRunner(service, TOKEN, agent_command=["python", "a.py"])
    with pytest.raises(AgentServiceError, match="could not ask the reward service.*HTTP 401"):
        RemoteAgentRunner(service, "wrong", agent=SPEC)
    with pytest.raises(AgentServiceError, match="could not ask the reward service"):
        RemoteAgentRunner(f"http://127.0.0.1:{free_port()}", TOKEN, agent=SPEC)
    with pytest.raises(ValueError, match="reward_url='ftp://x' is not an http"):
        RemoteAgentRunner("ftp://x")


def test_the_rollout_sends_its_episodes_to_the_service(tok, service):
    config = GRPOConfig(reward_funcs=["builtin:agent_reward"], agent=SPEC, agent_timeout_s=AGENT_TIMEOUT_S)
    ro = build_agent_rollout(config, AgentRewardScorer(), tok, service=(service, TOKEN))
    assert isinstance(ro.runner, RemoteAgentRunner) and ro.binding.host == "127.0.0.1"  # a service on loopback
    it = item(tok)
    it = type(it)(PROMPT, it.prompt_ids, {"answer": "42"})
    group = run(ro, TextClient(tok, ["42<|im_end|>", "41<|im_end|>"]), it, g=2)
    assert sorted(r[0] for r in group.rewards_per_func) == [0.0, 1.0]
    assert group.rollout_stats["agent/faults"] == [0.0, 0.0] and group.rollout_stats["agent/calls"] == [1.0, 1.0]


def test_without_a_service_the_rollout_runs_the_agent_here(tok, monkeypatch):
    monkeypatch.delenv("ASYNC_GRPO_REWARD_URL", raising=False)
    config = GRPOConfig(reward_funcs=["builtin:agent_reward"], agent=SPEC)
    ro = build_agent_rollout(config, AgentRewardScorer(), tok)
    assert type(ro.runner).__name__ == "FunctionAgent"
    ro.close()


def test_the_outcome_travels_as_json():
    outcome = AgentOutcome(0.5, None, "log", 1.25)
    assert outcome_from_json(outcome_to_json(outcome)) == outcome
    assert outcome_from_json({"value": 1, "fault": None, "log": "", "seconds": 0}) == AgentOutcome(1.0, None, "", 0.0)
    for bad in ([], {"value": "1", "fault": None, "log": "", "seconds": 0}, {"value": True, "log": "", "seconds": 0},
                {"value": None, "fault": None, "seconds": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="not an agent outcome"):
            outcome_from_json(bad)


def test_the_endpoint_listens_where_the_reward_pods_reach_it(monkeypatch):
    assert remote.POD_IP_ENV == POD_IP_ENV  # the variable the kubernetes launcher sets from the downward API
    assert endpoint_binding("http://127.0.0.1:8080", 8700, 4) == EndpointBinding()  # a service on this machine
    assert endpoint_binding("http://localhost:8080", 8700, 4) == EndpointBinding()
    monkeypatch.setenv(POD_IP_ENV, "10.1.2.3")
    assert endpoint_binding("http://run-reward:8080", 8700, 4) == EndpointBinding("0.0.0.0", 8700, 4, "10.1.2.3")
    monkeypatch.setenv(POD_IP_ENV, "fd00::7")
    assert endpoint_binding("http://run-reward:8080", 8700, 4).host == "::"
    monkeypatch.delenv(POD_IP_ENV)  # e.g. the evaluate step's pod: the address its host name resolves to
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.9.8.7")
    assert endpoint_binding("http://run-reward:8080", 8700, 4).advertise_host == "10.9.8.7"


def _two_free_ports_in_a_row() -> int:
    """The first of two consecutive ports that are both free on all interfaces right now.

    `free_port()` vouches for one port on 127.0.0.1 only; the port after it may be held by another test's server or an
    outgoing connection, which made this test fail once in CI (stop 65).
    """
    for _ in range(100):
        first = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("0.0.0.0", first))
                b.bind(("0.0.0.0", first + 1))
            except OSError:
                continue
        return first
    raise AssertionError("found no two consecutive free ports in 100 tries")


def test_endpoints_take_the_first_free_ports_of_the_range_and_advertise_the_pod_ip(tok):
    first = _two_free_ports_in_a_row()

    async def main():
        endpoints = [AgentEndpoint(tok, "0.0.0.0", port=first, port_count=2, advertise_host="127.0.0.1")
                     for _ in range(3)]  # fmt: skip
        await endpoints[0].start()
        await endpoints[1].start()
        try:
            with pytest.raises(OSError, match=f"agent_endpoint_port: .* no free port of {first}-{first + 1}.*Fix:"):
                await endpoints[2].start()
            async with httpx.AsyncClient() as http:  # listening on all interfaces, reached at the advertised host
                answers = [await http.get(f"{e.url}/models") for e in endpoints[:2]]
            return [e.url for e in endpoints[:2]], [a.status_code for a in answers]
        finally:
            for e in endpoints[:2]:
                await e.aclose()

    urls, codes = asyncio.run(main())
    assert urls == [f"http://127.0.0.1:{first}/v1", f"http://127.0.0.1:{first + 1}/v1"]
    assert codes == [401, 401]  # served (no episode key given)


def test_with_a_reward_service_the_trainers_preflight_never_imports_the_agent(tmp_path, monkeypatch):
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(
            """
            import pathlib

            pathlib.Path(__file__).with_name("imported").write_text("yes")


            def run(row, base_url, api_key):
                return 1.0
            """
        )
    )
    config = GRPOConfig(reward_funcs=["builtin:agent_reward"], agent=f"{agent}:run")
    monkeypatch.setenv("ASYNC_GRPO_REWARD_URL", "http://run-reward:8080")  # as the kubernetes launcher sets it
    report = preflight(config, target="local", skip=["model", "dataset", "output_dir", "mlflow", "reward_url"])
    assert not (tmp_path / "imported").exists()
    assert any(note.startswith("agent: the reward service loads and runs it") for note in report.skipped)
    assert not [p for p in report.problems if p.field.startswith("agents")]
    monkeypatch.delenv("ASYNC_GRPO_REWARD_URL")
    preflight(config, target="local", skip=["model", "dataset", "output_dir", "mlflow", "reward_url"])
    assert (tmp_path / "imported").exists()  # without a service the agent runs here, and is imported to check it
