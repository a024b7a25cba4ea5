"""Episodes as MLflow traces (issue 53): written off the step, read back with `mlflow.search_traces`, and an outage
retried like any record."""

from __future__ import annotations

import threading
import time

import mlflow
import pytest

from async_grpo.config import GRPOConfig
from async_grpo.runner.report import episode_traces
from async_grpo.tracking import Tracker
from async_grpo.transports.messages import EpisodeSpan, RolloutGroup

T0 = 1_700_000_000_000_000_000  # ns


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return uri


def tool_group() -> RolloutGroup:
    """Two episodes of a tool-calling prompt: the first calls the calculator and is right, the second answers at
    once and is wrong; sampled at policy version 3."""
    spans = [
        [
            EpisodeSpan("turn 1", "LLM", T0, T0 + 40_000_000, outputs={"text": "<tool_call>add</tool_call>"},
                        attributes={"prompt_tokens": 12, "completion_tokens": 6, "policy_version": 3}),
            EpisodeSpan("tool calculator", "TOOL", T0 + 41_000_000, T0 + 43_000_000,
                        inputs={"arguments": {"expression": "2+3"}}, outputs={"result": "5"}),
            EpisodeSpan("env step 1", "TASK", T0 + 40_500_000, T0 + 44_000_000, inputs={"action": "call"},
                        outputs={"observation": "5", "reward": None, "done": False}),
            EpisodeSpan("turn 2", "LLM", T0 + 45_000_000, T0 + 60_000_000, outputs={"text": "5"},
                        attributes={"prompt_tokens": 25, "completion_tokens": 2, "policy_version": 3}),
            EpisodeSpan("reward accuracy", "EVALUATOR", T0 + 61_000_000, T0 + 62_000_000, outputs={"value": 1.0},
                        attributes={"seconds": 0.001}),
        ],
        [
            EpisodeSpan("turn 1", "LLM", T0, T0 + 40_000_000, outputs={"text": "7"},
                        attributes={"prompt_tokens": 12, "completion_tokens": 2, "policy_version": 3}),
            EpisodeSpan("reward accuracy", "EVALUATOR", T0 + 61_000_000, T0 + 62_000_000, outputs={"value": 0.0},
                        attributes={"seconds": 0.001}),
        ],
    ]  # fmt: skip
    return RolloutGroup(
        prompt_ids=[1, 2, 3], completion_ids=[[4, 5, 6], [7]], sampling_logprobs=[[-0.1] * 3, [-0.2]],
        truncated=[False, False], completions=["<tool_call>add</tool_call>5", "7"], prompt="What is 2+3?",
        columns={}, policy_version=3, rewards_per_func=[[1.0], [0.0]], rewards=[1.0, 0.0], advantages=[0.7, -0.7],
        spans=spans,
    )  # fmt: skip


def test_each_episode_is_a_trace_of_the_run_with_its_turns_tool_calls_and_rewards(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store, log_traces_steps=1))
    traces = episode_traces([tool_group()], step=7, version=4, reward_names=["accuracy"], decode=str)
    t0 = time.perf_counter()
    tracker.log_episode_traces(traces)
    assert time.perf_counter() - t0 < 0.05  # queued, never written on the caller's thread
    tracker.end(timeout_s=60)
    assert tracker.stats["traces_written"] == 2 and tracker.stats["failed"] == 0

    found = mlflow.search_traces(run_id=tracker.run_id, return_type="list", order_by=["timestamp_ms ASC"])
    found = sorted(found, key=lambda t: t.data.spans[0].attributes["sample"])
    assert len(found) == 2
    first, second = found
    root = first.data.spans[0]
    assert root.name == "episode" and root.span_type == "AGENT"
    assert root.inputs == {"prompt": "What is 2+3?"}
    assert root.outputs["reward"] == 1.0 and root.outputs["advantage"] == 0.7
    assert root.outputs["rewards"] == {"accuracy": 1.0}
    assert root.attributes["policy_version"] == 3 and root.attributes["staleness"] == 1 and root.attributes["step"] == 7
    assert first.info.tags["async_grpo.step"] == "7"
    children = [(s.name, s.span_type) for s in first.data.spans[1:]]
    assert children == [("turn 1", "LLM"), ("env step 1", "TASK"), ("tool calculator", "TOOL"), ("turn 2", "LLM"),
                        ("reward accuracy", "EVALUATOR")]  # fmt: skip
    step, tool = first.data.spans[2], first.data.spans[3]
    assert tool.inputs == {"arguments": {"expression": "2+3"}} and tool.outputs == {"result": "5"}
    assert (tool.end_time_ns - tool.start_time_ns) == 2_000_000
    assert tool.parent_id == step.span_id and step.parent_id == root.span_id  # the call ran inside the step
    assert first.data.spans[1].attributes["policy_version"] == 3
    assert [s.name for s in second.data.spans] == ["episode", "turn 1", "reward accuracy"]
    assert second.data.spans[0].outputs["reward"] == 0.0
    assert mlflow.search_traces(run_id=tracker.run_id, filter_string="tag.async_grpo.step = '7'", return_type="list")


def test_traces_written_during_an_outage_are_tried_again_and_the_metrics_all_arrive(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store, log_traces_steps=1))
    back = threading.Event()
    real_search = tracker._client.search_traces

    def search_while_down(*args, **kwargs):  # MLflow's exporter retries on its own; reading back raises
        if not back.is_set():
            raise ConnectionError("tracking server down")
        return real_search(*args, **kwargs)

    tracker._client.search_traces = search_while_down
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_episode_traces(episode_traces([tool_group()], step=1, version=3, reward_names=["accuracy"],
                                              decode=str))  # fmt: skip
    tracker.log_metrics({"loss": 0.5}, step=2)
    time.sleep(2.5)
    assert tracker.stats["retries"] >= 1 and tracker.stats["traces_written"] == 0
    back.set()
    tracker.end(timeout_s=60)
    assert tracker.stats["traces_written"] == 2 and tracker.stats["failed"] == 0 and tracker.stats["dropped"] == 0
    history = mlflow.MlflowClient(store).get_metric_history(tracker.run_id, "loss")
    assert [m.step for m in history] == [1, 2]
    assert len(mlflow.search_traces(run_id=tracker.run_id, return_type="list")) == 2  # tried again, not written twice


def test_a_trace_mlflow_did_not_keep_is_counted_as_failed(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store, log_traces_steps=1))
    real_start = tracker._client.start_trace
    started = []

    def first_lost(*args, **kwargs):  # the first episode's trace goes to another experiment: not this run's
        started.append(1)
        if len(started) == 1:
            kwargs["run_id"] = None
            kwargs["experiment_id"] = mlflow.create_experiment("elsewhere")
        return real_start(*args, **kwargs)

    tracker._client.start_trace = first_lost
    tracker.log_episode_traces(episode_traces([tool_group()], step=3, version=3, reward_names=["accuracy"],
                                              decode=str))  # fmt: skip
    tracker.end(timeout_s=60)
    assert tracker.stats["traces_written"] == 1 and tracker.stats["failed"] == 1


def test_while_the_writer_is_behind_traces_are_skipped_and_counted_never_the_metrics(tmp_path, store):
    from async_grpo.tracking import TRACE_BACKLOG_LIMIT

    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store, log_traces_steps=1))
    gate = threading.Event()
    real = tracker._client.log_batch

    def slow(*args, **kwargs):  # the writer is stuck on the first metrics write until released
        gate.wait(30)
        return real(*args, **kwargs)

    tracker._client.log_batch = slow
    tracker.log_metrics({"loss": 0.0}, step=0)
    time.sleep(0.5)  # the writer holds it
    for step in range(1, TRACE_BACKLOG_LIMIT + 1):
        tracker.set_tags({f"t{step}": "x"})  # records that are not metrics fill the queue
    traces = episode_traces([tool_group()], step=9, version=3, reward_names=["accuracy"], decode=str)
    tracker.log_episode_traces(traces)
    tracker.log_metrics({"loss": 1.0}, step=1)  # metrics are still queued
    gate.set()
    tracker.end(timeout_s=60)
    assert tracker.stats["traces_dropped"] == 2 and tracker.stats["traces_written"] == 0
    history = mlflow.MlflowClient(store).get_metric_history(tracker.run_id, "loss")
    assert [m.step for m in history] == [0, 1]
