"""Streaming group scoring in the orchestrator, rollout pacing, and the DataProducer protocol.

Background runs use the fake vLLM client of test_orchestrator (generation only) and the real reward pool.
"""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError, load_config
from async_grpo.data import PromptItem, PromptSampler
from async_grpo.orchestrator.orchestrator import Orchestrator
from async_grpo.orchestrator.producer import (
    BaseDataProducer,
    DataProducer,
    ProducerConfig,
    RunProducer,
    StepStream,
    VLLMProducer,
    load_data_producer,
)
from async_grpo.orchestrator.progress import ProducerState
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.rewards.pool import RewardPool
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import TrainBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

from .test_orchestrator import STOP_TIMEOUT_S, WAIT_S, G, ScriptedClient, decode, expected_advantages, spec


def orchestrator(
    client,
    reward_pool,
    version,
    *,
    groups_per_step=4,
    streaming_min_groups=None,
    queue_size=8,
    max_staleness=10**6,
    **pacing,
) -> Orchestrator:
    drops = DropCounter()
    prompts = [PromptItem(prompt=f"p{i}", prompt_ids=[10 + i], columns={"answer": "ok"}) for i in range(3)]
    return Orchestrator(
        client_factory=lambda: client, prompts=PromptSampler(prompts, seed=0), rollout=SingleTurnRollout(reward_pool, decode),
        sampling=SamplingSettings(num_generations=G, max_completion_length=G, temperature=1.0),
        reward_names=reward_pool.names, reward_weights=reward_pool.weights,
        scale_rewards="group", groups_per_step=groups_per_step, max_staleness=max_staleness,
        vllm_sync_interval=1, max_inflight_groups=4,
        queue=RolloutQueue(maxsize=queue_size, max_staleness=max_staleness, drops=drops), version=version,
        drops=drops, streaming_min_groups=streaming_min_groups, **pacing,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    with RewardPool([spec("length_reward"), spec("constant_reward")], num_workers=2, timeout_s=20) as p:
        yield p


@pytest.mark.integration
def test_streaming_emits_ordered_chunks_and_the_step_metrics_on_the_last(pool):
    version = PolicyVersion()
    client = ScriptedClient(version, bump=False)
    orch = orchestrator(client, pool, version, groups_per_step=4, streaming_min_groups=2)
    orch.start()
    try:
        producer = VLLMProducer(orch, orch.queue, version, ProducerConfig(), streaming=True)
        steps = [producer.produce(None, i, timeout_s=WAIT_S)[0] for i in range(2)]
        chunks = [list(stream) for stream in steps]
    finally:
        orch.stop(timeout_s=STOP_TIMEOUT_S)
    assert orch.error is None
    for stream, got in zip(steps, chunks, strict=True):
        assert isinstance(stream, StepStream)
        assert [len(c.groups) for c in got] == [2, 2]
        assert [c.final for c in got] == [False, True]
        assert got[0].metrics == {}  # only the final chunk carries the step's metrics
        metrics = stream.metrics
        assert metrics["streaming/chunks"] == 2.0
        assert metrics["reward"] == pytest.approx(3.5)  # length 1..4 + constant 1, over all 4 groups
        assert metrics["rewards/length_reward/mean"] == pytest.approx(2.5)
        for grp in stream.groups:  # group scaling: each chunk's advantages are the whole step's
            assert grp.advantages == pytest.approx(expected_advantages([i + 2.0 for i in range(G)]), abs=1e-6)
        assert list(stream) == got  # a second pass replays the received chunks
    assert len(client.calls) >= 8


def test_pacing_with_rollouts_reuse_and_on_policy_warmup(pool):
    """required_version: rollout r (steps_per_generation=2 step batches of 2 groups, each trained 3 times) is
    consumed from trainer step r*2*3 on; warm-up rollouts get no max_staleness slack."""
    orch = orchestrator(
        None,
        pool,
        PolicyVersion(),
        groups_per_step=2,
        max_staleness=1,
        steps_per_generation=2,
        rollout_reuse=3,
        sync_warmup_rollouts=1,
    )
    # launches 0..3 -> rollout 0 (first step 0, warm-up: exact), 4..7 -> rollout 1 (first step 6, slack 1)
    assert [orch.required_version(n) for n in (0, 3, 4, 7, 8)] == [0, 0, 5, 5, 11]
    plain = orchestrator(None, pool, PolicyVersion(), groups_per_step=2, max_staleness=2)
    assert [plain.required_version(n) for n in (0, 2, 4, 6)] == [-2, -1, 0, 1]  # unchanged default pacing


def test_streaming_chunk_must_divide_the_step(pool):
    with pytest.raises(ValueError, match="must divide groups_per_step"):
        orchestrator(None, pool, PolicyVersion(), groups_per_step=4, streaming_min_groups=3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["streaming_min_groups=3"], "groups_per_step=16 is not a multiple of it"),
    (["streaming_min_groups=2", "per_device_train_batch_size=64"], "not a multiple of per_device_train_batch_size"),
    (["streaming_min_groups=8", "scale_rewards=batch"], "scale_rewards=batch"),
    (["streaming_min_groups=8", "num_iterations=2"], "reuse a complete rollout"),
    (["data_producer=x.py:f", "dynamic_sampling=true"], "data_producer replaces the builtin orchestrator"),
])  # fmt: skip
def test_streaming_and_producer_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("examples/tiny_cpu.yaml", overrides)
    assert "Fix:" in str(err.value)


def test_producer_config_validates_and_counts_steps():
    cfg = ProducerConfig(mini_epochs=2, steps_per_generation=3, num_iterations=2)
    assert cfg.steps_per_rollout == 12
    for bad in ({"mini_epochs": 0}, {"prefetch_depth": 0}, {"max_rollouts": 0}, {"sync_warmup_rollouts": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ProducerConfig(**bad)
    config = load_config("examples/tiny_cpu.yaml", ["mini_epochs=2", "max_rollouts=5", "prefetch_depth=3"])
    assert ProducerConfig.from_config(config) == ProducerConfig(mini_epochs=2, max_rollouts=5, prefetch_depth=3)


PRODUCER_PY = """
from async_grpo.orchestrator.producer import BaseDataProducer, ProducerConfig


class Fixed(BaseDataProducer):
    def produce(self, model, global_step, **kwargs):
        return []


def good(config, tokenizer):
    return Fixed(ProducerConfig(steps_per_generation=2))


def bad(config, tokenizer):
    return object()


class Plain:
    # only the three DataProducer methods and a config, no base class

    def __init__(self, config, tokenizer):
        self.config = ProducerConfig(max_rollouts=3)
        self.begun = []

    def produce(self, model, global_step, **kwargs):
        return ["batch"]

    def on_rollout_begin(self, global_step):
        self.begun.append(global_step)

    def on_rollout_end(self, rollout, global_step):
        pass


NOT_CALLABLE = 3
"""


def test_load_data_producer_checks_the_protocol(tmp_path):
    path = tmp_path / "producers.py"
    path.write_text(PRODUCER_PY)
    producer = load_data_producer(f"{path}:good", None, None)
    assert isinstance(producer, DataProducer) and isinstance(producer, BaseDataProducer)
    assert producer.config.steps_per_generation == 2
    with pytest.raises(ValueError, match="lacks the DataProducer protocol.*Fix"):
        load_data_producer(f"{path}:bad", None, None)
    with pytest.raises(ValueError, match="data_producer .*has no attribute 'missing'.*callables there: .*good"):
        load_data_producer(f"{path}:missing", None, None)
    with pytest.raises(ValueError, match="a int, not a callable"):
        load_data_producer(f"{path}:NOT_CALLABLE", None, None)
    with pytest.raises(ValueError, match="no builtin data producer.*Fix: unset data_producer"):
        load_data_producer("builtin:reverse_exact_match", None, None)  # a reward's name is not a producer
    plain = load_data_producer(f"{path}:Plain", None, None)  # wrapped: the run's lifecycle is the default one
    assert isinstance(plain, RunProducer) and plain.config.max_rollouts == 3
    plain.start(), plain.on_rollout_begin(4), plain.mark_trained([]), plain.stop()
    assert plain.produce(None, 4) == ["batch"] and plain.producer.begun == [4]
    assert plain.queue_depth == 0 and plain.launched_total is None and plain.wait_before_push(0, 1.0) is None
    assert plain.state_dict(0, 1.0) == ProducerState()


def test_step_stream_ends_at_an_emptied_final_chunk_and_counts_waits():
    """A final chunk whose groups were all dropped as stale still ends the step (the queue keeps it)."""
    from .test_orchestrator import hand_group

    drops = DropCounter()
    queue = RolloutQueue(maxsize=4, max_staleness=0, drops=drops)
    stop = __import__("threading").Event()
    fresh = hand_group([[1.0], [2.0]], [1, 1], [False, False], version=3)
    stale = hand_group([[1.0], [2.0]], [1, 1], [False, False], version=0)
    queue.put(TrainBatch([fresh], {}, final=False), stop)
    queue.put(TrainBatch([stale], {"reward": 1.0}, final=True), stop)
    stream = StepStream(queue, lambda: 3, timeout_s=5.0)
    assert [c.groups for c in stream] == [[fresh]]
    assert stream.metrics["streaming/chunks"] == 1.0 and stream.metrics["reward"] == 1.0
    assert drops.snapshot() == {"stale": 1}
    assert stream.wait_s >= 0.0
