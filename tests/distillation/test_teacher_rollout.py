"""The training rollout with the teacher (`distillation.rollout`): what it adds to a group (logprobs, seconds, trace
spans), which rollout asks the teacher (the orchestrator's only), the step metrics `distill/*`, and a failing teacher
in a running orchestrator: its groups are dropped and counted (`dropped_groups/teacher_error`), the rest trained, and a
teacher that fails every group stops the run as a dead reward service does. Fake vLLM client and scorer; the teacher
is the stub HTTP server of `stub_teacher`."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import Future

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.distillation import DistillationConfig
from async_grpo.data import PromptItem, PromptSampler
from async_grpo.distillation.rollout import TeacherRollout, with_teacher
from async_grpo.distillation.teacher import TeacherClient, TeacherError, TeacherScores
from async_grpo.inference.client import Completion
from async_grpo.inference.server import free_port
from async_grpo.orchestrator.batching import make_train_batch, teacher_metrics
from async_grpo.orchestrator.failures import RewardServiceError
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.runner.report import pipeline_metrics
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import RolloutGroup
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue
from async_grpo.transports.scorer import ScoredGroup
from tests.distillation.stub_teacher import StubTeacher, expected

G = 3
WAIT_S = 30.0
STOP_TIMEOUT_S = 15.0
SAMPLING = SamplingSettings(num_generations=G, max_completion_length=4, temperature=1.0)


def decode(ids: list[int]) -> str:
    return "".join(chr(65 + i % 26) for i in ids)


class FakeClient:
    """vLLM stand-in: completion j of a group is j + 1 tokens [40, 41, ...]; records whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        await asyncio.sleep(0.005)
        return [Completion(list(range(40, 41 + j)), [-0.5] * (j + 1), "", "stop") for j in range(n)]

    async def aclose(self) -> None:
        self.closed = True


class FakeScorer:
    """Scores every completion by its length, at once (no worker process)."""

    names = ["length"]
    weights = [1.0]

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        out: Future = Future()
        out.set_result(ScoredGroup(rows=[[float(len(ids))] for ids in completion_ids]))
        return out

    def set_trainer_state(self, **fields) -> None:
        pass

    def close(self) -> None:
        pass


class FakeTeacher:
    """A `TeacherClient` stand-in: each token's logprob is -token / 100 and, with `topk` K, its top K at every position
    are ids t + 1..t + K of logprobs -j / 10 (j = 1..K); records the loop it was used on. `topk_width` overrides the
    number of top-k entries it answers (a client bug the rollout must catch)."""

    def __init__(self, topk: int = 0, topk_width: int | None = None) -> None:
        self.calls = 0
        self.closed = False
        self.topk = topk
        self.topk_width = topk if topk_width is None else topk_width

    async def score_group(self, prompt_ids, completion_ids) -> TeacherScores:
        self.calls += 1
        await asyncio.sleep(0.01)
        logprobs = [[-t / 100 for t in ids] for ids in completion_ids]
        if not self.topk:
            return TeacherScores(logprobs)
        width = range(1, self.topk_width + 1)
        ids = [[[t + j for j in width] for t in row] for row in completion_ids]
        values = [[[-j / 10 for j in width] for _ in row] for row in completion_ids]
        return TeacherScores(logprobs, ids, values)

    async def aclose(self) -> None:
        self.closed = True


def item(i: int = 0) -> PromptItem:
    return PromptItem(prompt=f"prompt {i}", prompt_ids=[10 + i, 20 + i], columns={})


# ------------------------------------------------------------------ the wrapper
@pytest.mark.parametrize("record_spans", [False, True])
def test_the_wrapper_fills_the_teachers_logprobs_seconds_and_spans(record_spans):
    teachers: list[FakeTeacher] = []

    def make() -> FakeTeacher:
        teachers.append(FakeTeacher())
        return teachers[-1]

    rollout = TeacherRollout(SingleTurnRollout(FakeScorer(), decode, record_spans=record_spans), make)

    async def run() -> list[RolloutGroup]:
        groups = [await rollout(FakeClient(), item(i), SAMPLING, version=lambda: 0) for i in range(2)]
        assert not teachers[0].closed
        await rollout.aclose()
        return groups

    groups = asyncio.run(run())
    assert len(teachers) == 1 and teachers[0].calls == 2 and teachers[0].closed  # one client per loop, closed there
    for group in groups:
        assert group.teacher_logprobs == [[-t / 100 for t in ids] for ids in group.completion_ids]
        assert 0.01 <= group.teacher_seconds < 5
        assert group.rewards_per_func == [[1.0], [2.0], [3.0]]  # the inner rollout scored it
        if not record_spans:
            assert group.spans == []
            continue
        for spans, ids in zip(group.spans, group.completion_ids, strict=True):
            assert [s.name for s in spans] == ["generation", "reward length", "teacher"]
            teacher = spans[-1]
            assert teacher.kind == "EVALUATOR" and teacher.start_ns <= teacher.end_ns
            assert teacher.attributes == {"seconds": group.teacher_seconds, "tokens": len(ids), "unscored_tokens": 0}
            assert teacher.outputs["mean_logprob"] == pytest.approx(sum(-t / 100 for t in ids) / len(ids))
    assert rollout.tool_schemas == [] and rollout.without_tools() is None


def test_the_wrapper_fills_the_teachers_topk_and_refuses_a_misshapen_one():
    rollout = TeacherRollout(SingleTurnRollout(FakeScorer(), decode), lambda: FakeTeacher(topk=2))

    async def run(rollout) -> RolloutGroup:
        try:
            return await rollout(FakeClient(), item(), SAMPLING, version=lambda: 0)
        finally:
            await rollout.aclose()

    group = asyncio.run(run(rollout))
    assert group.teacher_logprobs == [[-t / 100 for t in ids] for ids in group.completion_ids]
    assert group.teacher_topk_ids == [[[t + 1, t + 2] for t in ids] for ids in group.completion_ids]
    assert group.teacher_topk_logprobs == [[[-0.1, -0.2]] * len(ids) for ids in group.completion_ids]
    plain = asyncio.run(run(TeacherRollout(SingleTurnRollout(FakeScorer(), decode), FakeTeacher)))
    assert plain.teacher_topk_ids == [] and plain.teacher_topk_logprobs == []  # reverse_kl: no top-k
    bad = TeacherRollout(SingleTurnRollout(FakeScorer(), decode), lambda: FakeTeacher(topk=2, topk_width=0))
    with pytest.raises(TeacherError, match="do not fit the group.*teacher_topk_ids.*one common K > 0"):
        asyncio.run(run(bad))


def test_a_new_event_loop_gets_a_new_teacher_client():
    teachers: list[FakeTeacher] = []
    rollout = TeacherRollout(
        SingleTurnRollout(FakeScorer(), decode), lambda: teachers.append(FakeTeacher()) or teachers[-1]
    )
    for _ in range(2):
        asyncio.run(rollout(FakeClient(), item(), SAMPLING, version=lambda: 0))
    assert len(teachers) == 2
    rollout.close()  # the loops are gone: the client is forgotten, the inner rollout left to its owner


def test_with_teacher_wraps_only_a_distilling_runs_rollout():
    inner = SingleTurnRollout(FakeScorer(), decode)
    assert with_teacher(DistillationConfig(), inner) is inner
    wrapped = with_teacher(DistillationConfig(teacher_url="http://127.0.0.1:8002/v1"), inner)
    assert isinstance(wrapped, TeacherRollout) and wrapped.inner is inner
    with pytest.raises(ValueError, match="teacher_url is not set"):  # the launcher had to set it
        with_teacher(DistillationConfig(teacher_model_name_or_path="/models/teacher"), inner)


def test_the_producers_rollout_asks_the_teacher_and_evaluations_does_not(tmp_path):
    """`build_producer` wraps the orchestrator's rollout; the runner's own (`GRPORecipe.rollout`, which evaluation
    runs) is the one passed in, unwrapped."""
    from async_grpo.runner.builders import build_producer

    config = GRPOConfig(
        model_name_or_path="builtin:tiny", dataset="builtin:reverse", output_dir=str(tmp_path),
        teacher_url="http://127.0.0.1:8002/v1", temperature=1.0,
    )  # fmt: skip
    inner = SingleTurnRollout(FakeScorer(), decode)
    producer = build_producer(
        config, tokenizer=None, train_items=[item()], rollout=inner, client_factory=FakeClient,
        reward_names=["length"], reward_weights=[1.0], version=PolicyVersion(), drops=DropCounter(), world_size=1,
    )  # fmt: skip
    assert isinstance(producer.orchestrator.rollout, TeacherRollout) and producer.orchestrator.rollout.inner is inner


# ------------------------------------------------------------------ metrics
def test_teacher_metrics_mean_seconds_and_unscored_trained_tokens():
    nan = math.nan

    def group(teacher, seconds, mask=None):
        lengths = [len(row) for row in teacher] or [2, 1]
        return RolloutGroup(
            prompt_ids=[1], completion_ids=[[5] * n for n in lengths], sampling_logprobs=[[-1.0] * n for n in lengths],
            truncated=[False] * len(lengths), completions=["x"] * len(lengths), prompt="p", columns={},
            policy_version=0, rewards_per_func=[[float(i)] for i in range(len(lengths))], loss_mask=mask or [],
            teacher_logprobs=teacher, teacher_seconds=seconds,
        )  # fmt: skip

    a = group([[-1.0, nan, nan], [nan]], 0.5, mask=[[1, 1, 0], [1]])  # the masked-out NaN (a tool token) not counted
    b = group([[-1.0, -2.0], [-3.0]], 1.5)
    plain = group([], 0.0)
    assert teacher_metrics([a, b, plain]) == {"distill/teacher_seconds": 1.0, "distill/teacher_tokens_unscored": 2.0}
    assert teacher_metrics([plain]) == {}
    metrics = make_train_batch([a, b], ["r"], [1.0], "group").metrics
    assert metrics["distill/teacher_seconds"] == 1.0 and metrics["distill/teacher_tokens_unscored"] == 2.0
    assert "distill/teacher_seconds" not in make_train_batch([plain], ["r"], [1.0], "group").metrics


# ------------------------------------------------------------------ a running orchestrator
def make_orchestrator(rollout, drops: DropCounter, version: PolicyVersion, client: FakeClient, n_prompts: int = 3):
    prompts = [item(i) for i in range(n_prompts)]
    return Orchestrator(
        client_factory=lambda: client, prompts=PromptSampler(prompts, seed=0), rollout=rollout, sampling=SAMPLING,
        reward_names=["length"], reward_weights=[1.0], scale_rewards="group", groups_per_step=2,
        max_staleness=10**6, vllm_sync_interval=1, max_inflight_groups=2,
        queue=RolloutQueue(maxsize=2, max_staleness=10**6, drops=drops), version=version, drops=drops,
    )  # fmt: skip


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {WAIT_S:.0f} s waiting for {what}")
        time.sleep(0.05)


def test_a_teacher_error_drops_the_group_and_counts_it_as_teacher_error():
    clients: list[TeacherClient] = []

    def make() -> TeacherClient:
        clients.append(TeacherClient(stub.url, model="m", max_retries=0))
        return clients[-1]

    with StubTeacher() as stub:
        stub.rule = lambda body: ("status", 400, "prompt too long") if body["prompt"][0][0] == 11 else None
        drops, version, client = DropCounter(), PolicyVersion(), FakeClient()
        orch = make_orchestrator(TeacherRollout(SingleTurnRollout(FakeScorer(), decode), make), drops, version, client)
        orch.start()
        try:
            batches = [orch.queue.get(current_version=version.value, timeout_s=WAIT_S) for _ in range(2)]
            wait_until(lambda: drops.snapshot().get("teacher_error", 0) >= 1, "a teacher_error drop")
        finally:
            orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert not orch.alive and orch.error is None and client.closed
    assert len(clients) == 1 and clients[0]._http.is_closed  # built and closed on the orchestrator's loop
    assert set(drops.snapshot()) <= {"teacher_error", "shutdown"}
    for batch in batches:
        assert batch.metrics["distill/teacher_seconds"] > 0 and batch.metrics["distill/teacher_tokens_unscored"] == 0
        for group in batch.groups:
            assert group.prompt_ids != [11, 21]  # the refused prompt never reaches a batch
            assert group.teacher_logprobs == [
                pytest.approx(expected(group.prompt_ids, c)) for c in group.completion_ids
            ]
    metrics = pipeline_metrics(
        [0], version=0, depth=0, waited_s=0.0, step_s=0.0, generation_rounds=1, world_size=1, drops=drops.snapshot()
    )
    assert metrics["dropped_groups/teacher_error"] >= 1


def test_a_teacher_that_fails_every_group_stops_the_run_naming_the_teacher():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: every group fails to connect, never retried
    drops, version, client = DropCounter(), PolicyVersion(), FakeClient()
    rollout = TeacherRollout(
        SingleTurnRollout(FakeScorer(), decode), lambda: TeacherClient(url, model="m", max_retries=0)
    )
    orch = make_orchestrator(rollout, drops, version, client)
    orch.reward_failure_timeout_s = 0.3
    orch.reward_watch.timeout_s = 0.3
    orch.start()
    try:
        wait_until(lambda: orch.error is not None, "the orchestrator to give up on the teacher")
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert isinstance(orch.error, RewardServiceError) and "teacher_url" in str(orch.error)
    assert drops.snapshot()["teacher_error"] >= 2
    assert not any(reason.startswith(("generation", "inference")) for reason in drops.snapshot())  # not vLLM's fault
