"""`resource_sharing`: which mode `auto` picks, the vLLM CPU threads of each mode, that a disabled time slice touches
no server, and the adaptive `ThreadGovernor` (thread counts following vLLM's requests in flight, inside a real
model's forward and backward)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.inference.replicas import ReplicaSet
from async_grpo.runner import resource_sharing
from async_grpo.runner.resource_sharing import ThreadGovernor, TimeSlice, resolve_resource_sharing, vllm_cpu_threads


@pytest.mark.parametrize(
    ("mode", "launched", "streaming", "threads", "cuda", "on_policy", "expected"),
    [
        ("auto", True, False, None, False, False, "adaptive"),  # a trainer on every core beside the local vLLM server
        ("auto", True, False, 2, False, False, "adaptive"),
        ("auto", True, True, None, False, False, "adaptive"),  # streaming overlaps too
        ("auto", True, False, None, False, True, "time_slice"),  # on-policy: nothing to overlap, vLLM gets every core
        ("auto", True, True, None, False, True, "adaptive"),  # streamed on-policy steps do overlap
        ("auto", True, False, 1, False, False, "overlap"),  # 1 of 2 cores: vLLM keeps its own core, overlap wins
        ("auto", False, False, None, False, False, "overlap"),  # attached servers / Kubernetes pods: own resources
        ("auto", True, False, None, True, False, "overlap"),  # GPU: separate memory; time_slice is the user's call
        ("overlap", True, False, None, False, False, "overlap"),
        ("time_slice", False, False, 1, True, False, "time_slice"),
        ("adaptive", False, False, 1, True, True, "adaptive"),
    ],
)
def test_auto_shares_cores_only_for_a_trainer_on_the_cores_of_its_own_vllm(
    mode, launched, streaming, threads, cuda, on_policy, expected
):
    assert (
        resolve_resource_sharing(
            mode,
            launched_here=launched,
            streaming=streaming,
            trainer_threads=threads,
            cores=2,
            cuda=cuda,
            on_policy=on_policy,
        )
        == expected
    )


@pytest.mark.parametrize(
    ("mode", "trainer_threads", "cores", "expected"),
    [
        ("adaptive", None, 2, 1),
        ("adaptive", None, 16, 8),
        ("adaptive", None, 1, 1),
        ("time_slice", None, 2, None),  # every core: the trainer waits while vLLM generates
        ("overlap", 1, 4, 3),
        ("overlap", None, 4, 2),
        ("overlap", 4, 4, 2),  # never two pools on every core
    ],
)
def test_vllm_cpu_threads_leave_the_trainer_its_cores(mode, trainer_threads, cores, expected):
    assert vllm_cpu_threads(mode, trainer_threads, cores) == expected


def test_for_run_follows_the_config_and_a_disabled_slice_is_a_no_op():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])  # nothing listens: any call would fail
    assert TimeSlice.for_run(GRPOConfig(torch_num_threads=64, max_staleness=0), replicas, launched_here=True).enabled
    governor = TimeSlice.for_run(
        GRPOConfig(torch_num_threads=64), replicas, launched_here=True, model=torch.nn.Linear(2, 2)
    )
    assert isinstance(governor, ThreadGovernor) and governor.full == 64
    cores = len(os.sched_getaffinity(0))
    assert governor.low == max(1, cores - max(1, cores // 2))  # the cores vLLM leaves, not 64 - vLLM's threads
    assert not TimeSlice.for_run(GRPOConfig(torch_num_threads=1), replicas, launched_here=True).enabled
    assert not TimeSlice.for_run(GRPOConfig(resource_sharing="overlap"), replicas, launched_here=True).enabled
    off = TimeSlice(replicas, enabled=False)
    with off:
        pass
    assert off.paused_s == 0.0


def test_time_slice_with_streaming_is_refused():
    with pytest.raises(ValueError, match="resource_sharing"):
        GRPOConfig(
            resource_sharing="time_slice", streaming_min_groups=1, num_generations=8, per_device_train_batch_size=8
        )


def test_a_dead_server_does_not_break_the_step():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    with TimeSlice(replicas, enabled=True) as ts:
        pass
    assert ts.paused_s >= 0.0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_governor_gives_the_trainer_every_core_only_while_vllm_is_idle():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    calls: list[int] = []
    clock = FakeClock()
    gov = ThreadGovernor(replicas, full_threads=4, low_threads=2, set_threads=calls.append, clock=clock)
    gov.update()  # outside a step (evaluation, old_logps): untouched
    assert calls == []
    replica = replicas.pick()  # a generation request in flight
    with gov:
        assert calls == [2]
        clock.now = 1.5
        gov.update()
        replicas.done(replica, answered=True, tokens=10)  # vLLM idle again
        clock.now = 2.0
        gov.update()
        assert calls == [2, 4]
        clock.now = 3.0
        replicas.pick()
        gov.update()
        clock.now = 3.25
    assert calls == [2, 4, 2, 4]  # the step ends on every core
    assert gov.reduced_s == pytest.approx(1.5 + 0.5 + 0.25)  # 0-2.0 reduced (checked at 1.5 and 2.0), 3.0-3.25
    assert gov.metrics()["trainer/thread_switches"] == 4.0
    with pytest.raises(ValueError, match="low_threads"):
        ThreadGovernor(replicas, full_threads=1, low_threads=2)


def test_governor_checks_before_each_layer_forward_and_backward(tiny_model):
    """A real model: the count is checked once per decoder layer in the forward and once per layer in the
    backward, so a change of vLLM's activity in the middle of a backward takes effect at the next layer."""
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    layers = len(tiny_model.model.layers)
    checks: list[bool] = []
    gov = ThreadGovernor(replicas, full_threads=2, low_threads=1, set_threads=lambda n: None).install(tiny_model)
    real_update = gov.update
    gov.update = lambda: (checks.append(True), real_update())
    ids = torch.tensor([[1, 2, 3, 4]])
    tiny_model(input_ids=ids).logits.sum().backward()  # outside a step: hooks fire, nothing changes
    assert gov.threads == 2 and gov.switches == 0
    checks.clear()
    with gov:
        replica = replicas.pick()
        loss = tiny_model(input_ids=ids).logits.sum()
        assert gov.threads == 1  # vLLM busy: the forward ran on the reduced count
        replicas.done(replica, answered=True)
        loss.backward()
        assert gov.threads == 2  # idle again: the backward went back to every thread
    assert len(checks) == 1 + 2 * layers + 1  # enter, each layer's forward and backward, exit


def test_replica_set_measures_vllms_own_generation_speed():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    first = replicas.pick()
    second = replicas.pick()
    time.sleep(0.05)
    replicas.done(first, answered=True, tokens=30)
    replicas.done(second, answered=True, tokens=70)
    time.sleep(0.1)  # idle: not generating time
    metrics = replicas.metrics()
    assert 0.05 <= metrics["inference/generating_s"] < 0.1
    assert metrics["generation/vllm_tokens_per_s"] == pytest.approx(100 / metrics["inference/generating_s"])
    assert replicas.metrics()["inference/generating_s"] == metrics["inference/generating_s"]  # nothing since


@pytest.mark.parametrize(
    ("trainer_threads", "launched_here", "local_ranks", "cuda", "expected"),
    [
        (1, True, 1, False, (4, 1)),  # held to 1 thread for vLLM's sake: every core, or its own if faster
        (1, True, 2, False, (2, 1)),  # two trainer ranks on the machine share the cores
        (3, True, 2, False, (3, 2)),  # already above its share: its own, or one fewer
        (None, True, 1, False, (4, 3)),  # torch's default, every core: all of them, or one left to a busy neighbour
        (4, True, 1, False, (4, 3)),
        (1, False, 1, False, None),  # an attached server: torch_num_threads may be the pod's CPU limit
        (1, True, 1, True, None),  # a GPU trainer
        (1, True, 8, False, None),  # more ranks than cores: each keeps its one thread
    ],
)
def test_warm_start_threads(trainer_threads, launched_here, local_ranks, cuda, expected):
    got = resource_sharing.warm_start_threads(
        trainer_threads, launched_here=launched_here, local_ranks=local_ranks, cores=4, cuda=cuda
    )
    assert got == expected


def test_full_determinism_keeps_the_warm_start_on_the_trainers_threads():
    """The thread count changes the float sums, and the warm start's outcome is chaotic in them: under
    full_determinism it neither widens nor lets `FasterThreads` switch (None: the trainer's own count)."""
    assert resource_sharing.warm_start_threads(1, launched_here=True, cores=4) == (4, 1)
    assert resource_sharing.warm_start_threads(1, launched_here=True, cores=4, full_determinism=True) is None
    assert resource_sharing.warm_start_threads(None, launched_here=True, cores=4, full_determinism=True) is None


def test_torch_threads_sets_and_restores_the_count_even_on_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError), resource_sharing.torch_threads(target):
        assert torch.get_num_threads() == target
        raise RuntimeError("step failed")
    assert torch.get_num_threads() == before
    with resource_sharing.torch_threads(None):
        assert torch.get_num_threads() == before


class TestFasterThreads:
    """`FasterThreads` (issue 48): the warm start keeps whichever thread count is faster now, measured, so a busy
    neighbour on one core never leaves it on the slow count, and a quiet machine keeps every core."""

    @staticmethod
    def drive(chooser, seconds_per_token, steps: int, tokens: int = 1000) -> list[int]:
        """Run `steps` steps; each takes seconds_per_token(threads, step) x tokens; returns the count of each."""
        used = []
        chooser.start()
        for step in range(steps):
            used.append(chooser.current)
            chooser.after_step(seconds_per_token(chooser.current, step) * tokens, tokens)
        return used

    def test_a_quiet_machine_keeps_every_core_and_probes_rarely(self):
        calls = []
        chooser = resource_sharing.FasterThreads(2, 1, set_threads=calls.append)
        used = self.drive(chooser, lambda threads, step: {2: 0.109, 1: 0.200}[threads] * 1e-3, 400)
        assert chooser.chosen == 2 and used[:6] == [2, 2, 2, 1, 1, 1]
        assert used.count(1) <= 3 + 4 * 3  # the first probe, then one probe per (doubling) block
        assert calls[0] == 2 and chooser.switches == 0

    def test_a_busy_core_makes_it_narrow_at_a_cost_of_one_wide_step_per_probe(self):
        chooser = resource_sharing.FasterThreads(2, 1, set_threads=lambda n: None)
        used = self.drive(chooser, lambda threads, step: {2: 2.3, 1: 0.192}[threads] * 1e-3, 400)
        assert chooser.chosen == 1
        assert used.count(2) <= 3 + 5  # the first probe, then one aborted step per later probe

    def test_it_follows_a_neighbour_that_comes_and_goes(self):
        busy = range(100, 250)  # another process computes on one of the cores during these steps
        chooser = resource_sharing.FasterThreads(2, 1, set_threads=lambda n: None, block_steps=10, max_block_steps=40)

        def cost(threads, step):
            return ({2: 0.433, 1: 0.192} if step in busy else {2: 0.109, 1: 0.200})[threads] * 1e-3

        used = self.drive(chooser, cost, 400)
        assert used[90:100].count(2) >= 8 and used[200:250].count(1) >= 40 and used[360:].count(2) >= 35
        assert chooser.switches >= 2 and chooser.chosen == 2

    def test_a_neighbour_arriving_mid_block_costs_two_steps_not_the_block(self):
        """A block on the chosen count ends at its first step twice as slow as the other count (the demo beside a
        busy core ran 93 of 600 GRPO steps on the cliff count, 97 s, mostly in three whole blocks, before this)."""
        chooser = resource_sharing.FasterThreads(2, 1, set_threads=lambda n: None, block_steps=100)

        def cost(threads, step):
            return ({2: 2.3, 1: 0.192} if step >= 50 else {2: 0.109, 1: 0.200})[threads] * 1e-3

        used = self.drive(chooser, cost, 150)
        assert used[6:50] == [2] * 44  # quiet: the block on every core
        assert used[50:].count(2) <= 2 and chooser.chosen == 1

    def test_on_a_quiet_machine_fewer_threads_must_win_by_the_margin(self):
        """Rates within noise of each other keep every core: the quiet add18m steps measured 1 and 2 threads 2-17 %
        apart, either way round (docs/performance.md)."""
        chooser = resource_sharing.FasterThreads(2, 1, set_threads=lambda n: None)
        used = self.drive(chooser, lambda threads, step: {2: 2.13, 1: 1.97}[threads] * 1e-3, 400)
        assert chooser.chosen == 2 and used[6:].count(1) <= 4 * 3  # only the probes
        tight = resource_sharing.FasterThreads(2, 1, set_threads=lambda n: None, margin=0.0)
        self.drive(tight, lambda threads, step: {2: 2.13, 1: 1.97}[threads] * 1e-3, 10)
        assert tight.chosen == 1
        with pytest.raises(ValueError, match="margin=1.0"):
            resource_sharing.FasterThreads(2, 1, margin=1.0)

    def test_bad_counts_are_refused(self):
        with pytest.raises(ValueError, match="wide=1 must exceed narrow=1"):
            resource_sharing.FasterThreads(1, 1)
        with pytest.raises(ValueError, match="probe_steps=0"):
            resource_sharing.FasterThreads(2, 1, probe_steps=0)


class TestStepThreads:
    """`StepThreads`: the GRPO steps keep measuring every core against one fewer, so a neighbour that arrives after
    the warm start (on 2 cores beside one nice-19 busy loop our step took 10.1 s against 0.87 s alone) costs a probe
    step, not the run, and a quiet machine keeps every core."""

    def test_it_counts_the_padded_tokens_of_a_steps_forward_passes_only(self, tiny_model):
        ceilings: list[int] = []
        steps = resource_sharing.StepThreads(tiny_model, 2, ceilings.append)
        assert ceilings == [2] and steps.ceiling == 2
        tiny_model(input_ids=torch.ones(3, 7, dtype=torch.long))  # outside a step (evaluation): not counted
        for _ in range(2):
            steps.begin()
            tiny_model(input_ids=torch.ones(3, 7, dtype=torch.long)).logits.sum().backward()
            tiny_model(input_ids=torch.ones(1, 20, dtype=torch.long))  # a second micro-batch, packed
            assert steps.tokens == 3 * 7 + 20
            steps.end()
        assert steps.chooser.rate == {} and len(steps.chooser._samples) == 1  # the first step warms up

    def test_a_neighbour_after_the_warm_start_narrows_the_ceiling_and_its_going_widens_it(self, tiny_model, caplog):
        caplog.set_level("INFO", logger="async_grpo.runner.resource_sharing")
        clock = FakeClock()
        ceilings: list[int] = []
        steps = resource_sharing.StepThreads(
            tiny_model, 2, ceilings.append, clock=clock, block_steps=5, max_block_steps=10
        )
        ids = torch.ones(4, 25, dtype=torch.long)  # 100 padded tokens a step
        used = []
        for step in range(120):
            busy = 30 <= step < 80  # a neighbour computes on one core during these steps
            per_token = ({2: 0.0101, 1: 0.0014} if busy else {2: 0.00087, 1: 0.0012})[steps.ceiling]  # s, measured
            used.append(steps.ceiling)
            steps.begin()
            with torch.no_grad():
                tiny_model(input_ids=ids)
            clock.now += per_token * 100
            steps.end()
        assert used[20:30].count(2) >= 7  # quiet: every core
        assert used[45:80].count(1) >= 30  # busy: one fewer, after a probe
        assert used[105:].count(2) >= 12  # the neighbour left: every core again
        logged = [r.getMessage() for r in caplog.records]
        assert logged[0].startswith("GRPO steps: 2 torch threads ({2: 0.87, 1: 1.2} s per 1k padded tokens")
        assert any(m.startswith("GRPO steps: now 1 torch threads, not 2") for m in logged)
        assert steps.metrics() == {"trainer/thread_ceiling": float(steps.ceiling)}
        with pytest.raises(ValueError, match="full=1 leaves no choice"):
            resource_sharing.StepThreads(tiny_model, 1, ceilings.append)

    def test_the_governor_lowers_both_counts_by_one_under_a_narrowed_ceiling(self, tiny_model):
        replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
        calls: list[int] = []
        clock = FakeClock()
        gov = ThreadGovernor(replicas, 8, 4, set_threads=calls.append, clock=clock, measure=True).install(tiny_model)
        assert gov.steps is not None and gov.ceiling == 8
        gov.steps.chooser._switch(7, 3)  # as a probe of one fewer does
        gov._set_ceiling(7)
        replica = replicas.pick()
        with gov:
            assert gov.threads == 3  # vLLM generating: the low count, one fewer
            replicas.done(replica, answered=True)
            gov.update()
            assert gov.threads == 7
        assert gov.threads == 7 and gov.metrics()["trainer/thread_ceiling"] == 7.0
        unmeasured = ThreadGovernor(replicas, 2, 1, set_threads=calls.append).install(tiny_model)
        assert unmeasured.steps is None and "trainer/thread_ceiling" not in unmeasured.metrics()


@pytest.mark.parametrize(
    ("overrides", "launched", "full", "expected"),
    [
        ({}, True, 2, True),
        ({}, False, 2, False),  # attached servers, Kubernetes pods
        ({}, True, 1, False),  # nothing to choose
        ({"full_determinism": True}, True, 2, False),  # keeps the trainer's own threads
        ({"streaming_min_groups": 1}, True, 2, False),  # a streamed step's seconds include its chunk waits
    ],
)
def test_which_runs_measure_their_step_threads(overrides, launched, full, expected):
    config = GRPOConfig(**overrides)
    assert resource_sharing.measure_step_threads(config, launched, full) is (expected and not torch.cuda.is_available())


def test_for_run_measures_under_the_governor_and_the_time_slice(tiny_model):
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    governor = TimeSlice.for_run(GRPOConfig(torch_num_threads=2), replicas, launched_here=True, model=tiny_model)
    assert isinstance(governor, ThreadGovernor) and governor.steps is not None
    sliced = TimeSlice.for_run(
        GRPOConfig(torch_num_threads=2, max_staleness=0), replicas, launched_here=True, model=tiny_model
    )
    assert isinstance(sliced, TimeSlice) and sliced.enabled and sliced.threads is not None
    before = torch.get_num_threads()
    try:
        assert torch.get_num_threads() == 2  # the time slice's ceiling starts on every thread it was given
    finally:
        torch.set_num_threads(before)
    exact = TimeSlice.for_run(
        GRPOConfig(torch_num_threads=2, full_determinism=True), replicas, launched_here=True, model=tiny_model
    )
    assert isinstance(exact, ThreadGovernor) and exact.steps is None
