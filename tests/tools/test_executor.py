"""Running tool calls safely: spawned workers, per-call timeout, CPU-seconds and memory limits; every failure is an
outcome the model reads, counted by kind, and the pool keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from async_grpo.tools.executor import ToolExecutor, ToolOutcome, check_arguments
from async_grpo.tools.loading import load_tools

FNS = Path(__file__).with_name("tool_fns.py")
NAMES = ["add", "echo", "boom", "hang", "crash", "spin", "hog"]


@pytest.fixture(scope="module")
def executor():
    tools = load_tools([f"{FNS}:{n}" for n in NAMES])
    with ToolExecutor(tools, num_workers=2, timeout_s=3.0, cpu_seconds=1.0, memory_mb=512) as ex:
        yield ex


def call(ex: ToolExecutor, name: str, arguments, **kw) -> ToolOutcome:
    return ex.submit(name, arguments, **kw).result(timeout=60)


def test_results_come_back_as_text(executor):
    ok = call(executor, "add", {"a": 2, "b": 40})
    assert (ok.content, ok.failure, ok.ok) == ("42", None, True) and 0 < ok.seconds < 30
    assert call(executor, "echo", {"text": "hé"}).content == '{"echo": "hé"}'  # non-strings as JSON


def test_refused_before_running(executor):
    unknown = call(executor, "abacus", {})
    assert unknown.failure == "unknown_tool" and "there is no tool 'abacus'" in unknown.content
    assert unknown.content.startswith("error: ") and unknown.seconds == 0.0
    not_offered = call(executor, "add", {"a": 1, "b": 2}, allowed=["echo"])
    assert not_offered.failure == "unknown_tool" and "['echo']" in not_offered.content
    for args, says in (
        ({"a": 1}, "missing ['b']"),
        ({"a": 1, "b": 2, "c": 3}, "unknown ['c']"),
        ({"a": "1", "b": 2}, "must be integer"),
        ({"a": True, "b": 2}, "must be integer"),
        ([1, 2], "must be a JSON object"),
    ):
        out = call(executor, "add", args)
        assert out.failure == "bad_arguments" and says in out.content, (args, out)


def test_a_raising_tool_is_an_error_the_model_reads(executor):
    out = call(executor, "boom", {"text": "x"})
    assert out.failure == "exception" and out.content == "error: boom raised RuntimeError: boom on x"


def test_a_hanging_tool_is_killed_at_the_timeout_and_the_pool_recovers(executor):
    t0 = time.monotonic()
    out = call(executor, "hang", {"text": "x"})
    assert out.failure == "timeout" and "within 3 s" in out.content and 2.5 < time.monotonic() - t0 < 20
    assert call(executor, "add", {"a": 1, "b": 1}).content == "2"


def test_a_crash_kills_only_that_call(executor):
    out = call(executor, "crash", {"text": "x"})
    assert out.failure == "crashed" and "exit code 3" in out.content
    assert call(executor, "add", {"a": 2, "b": 2}).content == "4"


def test_the_cpu_seconds_limit_stops_a_busy_tool_before_its_timeout():
    with ToolExecutor(load_tools([f"{FNS}:spin", f"{FNS}:add"]), num_workers=1, timeout_s=60.0, cpu_seconds=1.0) as ex:
        t0 = time.monotonic()
        out = call(ex, "spin", {"text": "x"})
        assert out.failure == "crashed" and "CPU time limit" in out.content, out
        assert time.monotonic() - t0 < 45  # SIGXCPU after ~1-2 CPU seconds, not the 60 s timeout
        assert call(ex, "add", {"a": 2, "b": 2}).content == "4"


def test_the_memory_limit_fails_the_allocation_inside_the_tool(executor):
    out = call(executor, "hog", {"megabytes": 2048})  # above the 512 MiB address-space limit
    assert out.failure == "exception" and "MemoryError" in out.content
    assert call(executor, "hog", {"megabytes": 8}).content == str(8 * 2**20)


def test_calls_run_concurrently_from_async_code(executor):
    async def main():
        return await asyncio.gather(*(executor.call("add", {"a": i, "b": i}) for i in range(6)))

    assert [o.content for o in asyncio.run(main())] == [str(2 * i) for i in range(6)]


def test_async_tools_are_awaited_in_their_workers_and_the_calls_of_a_turn_overlap():
    tools = load_tools([f"{FNS}:wait_and_stamp", f"{FNS}:async_boom"])
    assert tools[0].schema["function"]["parameters"]["required"] == ["seconds"]  # described like a plain def

    async def turn(ex: ToolExecutor, seconds: float, calls: int) -> list[ToolOutcome]:
        return await asyncio.gather(*(ex.call("wait_and_stamp", {"seconds": seconds}) for _ in range(calls)))

    with ToolExecutor(tools, num_workers=3, timeout_s=5.0, cpu_seconds=1.0, memory_mb=512) as ex:
        outcomes = asyncio.run(turn(ex, 2.5, 3))  # 2.5 s each: overlap despite the workers' staggered start-up
        assert all(o.ok for o in outcomes), outcomes
        stamps = [json.loads(o.content) for o in outcomes]
        assert max(s["start"] for s in stamps) < min(s["end"] for s in stamps)  # the three waits overlapped
        raised = call(ex, "async_boom", {"x": 7})
        assert raised.failure == "exception" and "ValueError: async tool failed on 7" in raised.content
        (hung,) = asyncio.run(turn(ex, 30.0, 1))  # an awaited call past tool_timeout_s: killed, counted
        assert hung.failure == "timeout" and hung.content.startswith("error: ")
        assert call(ex, "wait_and_stamp", {"seconds": 0.0}).ok  # the pool serves again


def test_closed_executor_answers_with_an_error():
    ex = ToolExecutor(load_tools([f"{FNS}:add"]), num_workers=1)
    ex.close()
    assert ex.closed and call(ex, "add", {"a": 1, "b": 1}).failure == "crashed"


def test_outcome_json_round_trip_and_argument_check_without_types():
    out = ToolOutcome("x", "timeout", 1.5)
    assert ToolOutcome.from_json(out.to_json()) == out
    with pytest.raises(ValueError):
        ToolOutcome.from_json({"content": 1})
    (tool,) = load_tools([f"{FNS}:add"], describe=False)
    assert check_arguments(tool, {"a": "anything", "b": None}) is None  # untyped schema: names only
    assert "missing ['b']" in check_arguments(tool, {"a": 1})
