"""Tool calls on the reward service (how they run on Kubernetes): the tool route of a real
`python -m async_grpo.rewards.server` subprocess and its client `RemoteToolExecutor`; and conversational completions
(tool calls and results) reaching reward functions intact through the spawned workers and the service's JSON."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool
from async_grpo.tools.loading import load_tools
from async_grpo.tools.remote import RemoteToolExecutor, ToolServiceError
from tests.rewards.test_reward_server import start_server, stop_server

TOOL_FNS = Path(__file__).parents[1] / "tools" / "tool_fns.py"
REWARD = f"{Path(__file__).with_name('tool_reward_fns.py')}:conversation_reward"
TOOLS = ["builtin:calculator", f"{TOOL_FNS}:boom", f"{TOOL_FNS}:hang"]
TOKEN = "s3cret-tool-token"
CONVERSATION = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}],
    },
    {"role": "tool", "name": "calculator", "content": "6"},
    {"role": "assistant", "content": "6"},
]
PROMPT = [{"role": "user", "content": "2*3"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-service")
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump({"reward_funcs": [REWARD], "tools": TOOLS, "tool_timeout_s": 2.0, "tool_num_workers": 2})
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("ASYNC_GRPO_REWARD_TOKEN", TOKEN)
    proc, url = start_server(config, tmp / "server.log")
    mp.undo()
    yield url
    assert stop_server(proc) == 0


def test_tool_calls_run_on_the_service_like_local_ones(service):
    remote = RemoteToolExecutor(service, TOOLS, timeout_s=2.0, token=TOKEN)
    # the schemas come from the service, identical to the ones a local load builds (transformers' get_json_schema)
    assert [t.schema for t in remote.tools] == [t.schema for t in load_tools(TOOLS)]
    assert [t.spec for t in remote.tools] == TOOLS
    try:

        async def calls():
            return await asyncio.gather(
                remote.call("calculator", {"expression": "347*912"}),
                remote.call("boom", {"text": "x"}),
                remote.call("hang", {"text": "x"}),
                remote.call("abacus", {}),
                remote.call("calculator", {"expression": 3}),
                remote.call("calculator", {"expression": "1"}, allowed=["boom"]),
            )

        ok, raised, hung, unknown, bad, not_offered = asyncio.run(calls())
        assert (ok.content, ok.failure) == ("316464", None) and ok.seconds > 0
        assert raised.failure == "exception" and "RuntimeError: boom on x" in raised.content
        assert hung.failure == "timeout" and "within 2 s" in hung.content
        assert unknown.failure == "unknown_tool" and bad.failure == "bad_arguments"  # checked with the full schemas
        assert not_offered.failure == "unknown_tool"
    finally:
        remote.close()


def test_the_service_must_serve_the_runs_tools_and_wants_the_token(service):
    with pytest.raises(ToolServiceError, match="serves tools"):
        RemoteToolExecutor(service, ["builtin:calculator"], timeout_s=2.0, token=TOKEN)
    with pytest.raises(ToolServiceError, match="serves tools"):  # same tools, another order: other prompts
        RemoteToolExecutor(service, TOOLS[::-1], timeout_s=2.0, token=TOKEN)
    with pytest.raises(ToolServiceError, match="could not list"):
        RemoteToolExecutor(service, TOOLS, timeout_s=2.0, token="wrong")


def test_conversational_completions_reach_reward_functions_intact(service):
    args = ([PROMPT] * 2, [CONVERSATION, CONVERSATION[:1]], [[1, 2, 3], [4]])
    with RewardPool([REWARD], num_workers=1) as local:  # pickled to a spawned worker
        assert local.submit(*args).result(timeout=60).rows == [[111.0], [11.0]]
    with RemoteRewardPool(service, 10.0, token=TOKEN) as remote:  # through the service's JSON
        assert remote.submit(*args).result(timeout=60).rows == [[111.0], [11.0]]
