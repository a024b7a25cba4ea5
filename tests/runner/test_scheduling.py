"""`resource_sharing`: which mode `auto` picks, and that a disabled time slice touches no server."""

from __future__ import annotations

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.inference.replicas import ReplicaSet
from async_grpo.runner.scheduling import TimeSlice, resolve_resource_sharing


@pytest.mark.parametrize(("mode", "launched", "streaming", "threads", "cuda", "expected"), [
    ("auto", True, False, None, False, "time_slice"),  # a trainer on every core beside the local vLLM CPU server
    ("auto", True, False, 2, False, "time_slice"),
    ("auto", True, False, 1, False, "overlap"),  # 1 of 2 cores: vLLM keeps its own core, overlap wins
    ("auto", False, False, None, False, "overlap"),  # attached servers / Kubernetes pods have their own resources
    ("auto", True, True, None, False, "overlap"),  # streaming overlaps training with generation by design
    ("auto", True, False, None, True, "overlap"),  # GPU: separate memory; time_slice is the user's call
    ("overlap", True, False, None, False, "overlap"),
    ("time_slice", False, False, 1, True, "time_slice"),
])
def test_auto_time_slices_only_a_trainer_on_the_cores_of_its_own_vllm(mode, launched, streaming, threads, cuda,
                                                                       expected):
    assert resolve_resource_sharing(mode, launched_here=launched, streaming=streaming, trainer_threads=threads,
                                    cores=2, cuda=cuda) == expected


def test_for_run_follows_the_config_and_a_disabled_slice_is_a_no_op():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])  # nothing listens: any call would fail
    assert TimeSlice.for_run(GRPOConfig(torch_num_threads=64), replicas, launched_here=True).enabled
    assert not TimeSlice.for_run(GRPOConfig(torch_num_threads=1), replicas, launched_here=True).enabled
    assert not TimeSlice.for_run(GRPOConfig(resource_sharing="overlap"), replicas, launched_here=True).enabled
    off = TimeSlice(replicas, enabled=False)
    with off:
        pass
    assert off.paused_s == 0.0


def test_time_slice_with_streaming_is_refused():
    with pytest.raises(ValueError, match="resource_sharing"):
        GRPOConfig(resource_sharing="time_slice", streaming_min_groups=1, num_generations=8,
                   per_device_train_batch_size=8)


def test_a_dead_server_does_not_break_the_step():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])
    with TimeSlice(replicas, enabled=True) as ts:
        pass
    assert ts.paused_s >= 0.0
