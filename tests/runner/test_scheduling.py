"""`resource_sharing`: which mode `auto` picks, and that a disabled time slice touches no server."""

from __future__ import annotations

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.inference.replicas import ReplicaSet
from async_grpo.runner.scheduling import TimeSlice, resolve_resource_sharing


@pytest.mark.parametrize(("mode", "launched", "streaming", "expected"), [
    ("auto", True, False, "time_slice"),  # the local backend's own servers share this machine
    ("auto", False, False, "overlap"),  # attached servers / Kubernetes pods have their own resources
    ("auto", True, True, "overlap"),  # streaming overlaps training with generation by design
    ("overlap", True, False, "overlap"),
    ("time_slice", False, False, "time_slice"),
])
def test_auto_time_slices_only_servers_on_this_machine(mode, launched, streaming, expected):
    assert resolve_resource_sharing(mode, launched_here=launched, streaming=streaming) == expected


def test_for_run_follows_the_config_and_a_disabled_slice_is_a_no_op():
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])  # nothing listens: any call would fail
    assert TimeSlice.for_run(GRPOConfig(), replicas, launched_here=True).enabled
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
