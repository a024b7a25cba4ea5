"""weight_sync_overlap's parts: a frozen copy of the pushed weights, and one push in flight on a background thread."""

from __future__ import annotations

import threading

import pytest
import torch
from vllm.distributed.weight_transfer import ModuleSource

from async_grpo.runner.overlapped_push import OverlappedPush
from async_grpo.transports.weights.cast import CastSource
from async_grpo.transports.weights.frozen import FrozenSource


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _values(source) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in source}


def test_a_frozen_source_yields_the_weights_of_freeze_time_until_thawed():
    model = _model()
    source = FrozenSource(ModuleSource(model))
    assert not source.frozen and source.metadata() == ModuleSource(model).metadata()
    before = _values(source)
    held = source.freeze()
    assert source.frozen and held == sum(p.numel() * 4 for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the optimizer moves on
    for name, tensor in source:
        assert torch.equal(tensor, before[name])  # every pass: the copy
    assert _values(source).keys() == before.keys()
    with pytest.raises(RuntimeError, match="already frozen"):
        source.freeze()
    source.thaw()
    for name, tensor in source:
        assert torch.equal(tensor, before[name] + 1.0)  # the live weights again


def test_a_frozen_cast_source_holds_its_copy_in_the_pushed_dtype():
    model = _model()
    source = FrozenSource(CastSource(ModuleSource(model), torch.bfloat16))
    held = source.freeze()
    assert held == sum(p.numel() * 2 for p in model.parameters())
    assert {t.dtype for _, t in source} == {torch.bfloat16}
    assert [m.dtype for m in source.metadata()] == [torch.bfloat16] * 4


def test_a_push_runs_beside_the_next_step_and_sends_the_weights_it_started_with():
    model = _model()
    source = FrozenSource(ModuleSource(model))
    started, release = threading.Event(), threading.Event()
    sent: list[dict[str, torch.Tensor]] = []

    def push() -> float:
        started.set()
        assert release.wait(10)
        sent.append(_values(source))
        return 0.25

    start_weights = _values(source)
    overlap = OverlappedPush(source, push, timeout_s=10)
    assert overlap.settle() is None and not overlap.in_flight  # nothing in flight yet
    overlap.start()
    assert started.wait(10) and overlap.in_flight
    with torch.no_grad():  # the next optimizer step while the push is on the wire
        for p in model.parameters():
            p.mul_(2.0)
    with pytest.raises(RuntimeError, match="still in flight"):
        overlap.start()
    release.set()
    assert overlap.settle() == 0.25 and not overlap.in_flight
    assert all(torch.equal(sent[0][k], start_weights[k]) for k in start_weights)  # not the moved weights
    assert not source.frozen  # thawed once the push ended
    overlap.close()


def test_a_failed_push_is_raised_where_it_is_settled_and_thaws_the_source():
    source = FrozenSource(ModuleSource(_model()))

    def push() -> float:
        raise ConnectionError("vLLM went away")

    overlap = OverlappedPush(source, push, timeout_s=10)
    overlap.start()
    with pytest.raises(ConnectionError, match="went away"):
        overlap.settle()
    assert not source.frozen and not overlap.in_flight
    overlap.start()
    overlap.drain()  # logged, not raised
    assert not overlap.in_flight
    overlap.close()


def test_a_push_that_outlives_the_timeout_is_a_timeout_error():
    source = FrozenSource(ModuleSource(_model()))
    release = threading.Event()
    overlap = OverlappedPush(source, lambda: float(release.wait(10)), timeout_s=0.05)
    overlap.start()
    with pytest.raises(TimeoutError, match="did not end within"):
        overlap.settle()
    release.set()
    overlap.close()
