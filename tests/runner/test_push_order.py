"""The policy version moves only once vLLM serves the new weights (regression for shared/repros/bump_before_push.py:
a version bumped before the push stamped groups sent during the push one version too new)."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.inference.health import InferenceLost
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.trainer.distributed import DistInfo
from async_grpo.transports.weights.push import PushReport


class RecordingPusher:
    """Stands in for `WeightPusher`: records the version the orchestrator would read while weights load."""

    def __init__(self, recipe: GRPORecipe, fail: bool = False):
        self.recipe, self.fail, self.seen = recipe, fail, []
        self.last_report = PushReport()

    def push(self, version: int) -> float:
        self.seen.append((version, self.recipe.version.value))
        if self.fail:
            raise ConnectionError("vLLM went away mid-push")
        return 0.25


def test_the_version_is_bumped_after_the_push_not_before():
    recipe = GRPORecipe(GRPOConfig(), DistInfo())
    recipe.pusher = RecordingPusher(recipe)
    assert recipe.push_weights() == 0.25
    assert recipe.push_weights() == 0.25
    # pushed as v+1 while every reader still saw v (vLLM was serving v until the push finished)
    assert recipe.pusher.seen == [(1, 0), (2, 1)]
    assert recipe.version.value == 2 and recipe.sync_times == [0.25, 0.25]


def test_a_failed_push_leaves_the_version_where_it_was():
    recipe = GRPORecipe(GRPOConfig(), DistInfo())
    recipe.pusher = RecordingPusher(recipe, fail=True)
    with pytest.raises(ConnectionError):
        recipe.push_weights()
    assert recipe.version.value == 0 and recipe.sync_times == []


class FlakyPusher(RecordingPusher):
    """Fails its first push (vLLM lost mid-push), then succeeds."""

    def push(self, version: int) -> float:
        self.seen.append((version, self.recipe.version.value))
        if len(self.seen) == 1:
            raise ConnectionError("vLLM went away mid-push")
        return 0.5


class RecordingRecovery:
    """Stands in for `InferenceRecovery`: records the reason, then pushes the current weights as `recover` does."""

    def __init__(self, recipe: GRPORecipe):
        self.recipe, self.reasons = recipe, []

    def recover(self, reason: str) -> float:
        self.reasons.append(reason)
        return self.recipe.push_weights()


def test_an_overlapped_push_that_failed_is_recovered_where_it_is_settled():
    """weight_sync_overlap: a background push that failed leaves the version where it was; settling it recovers the
    server (one new push, one version), and its seconds are kept for the next logged step."""
    import torch
    from vllm.distributed.weight_transfer import ModuleSource

    from async_grpo.runner.overlapped_push import OverlappedPush
    from async_grpo.transports.weights.frozen import FrozenSource

    recipe = GRPORecipe(GRPOConfig(), DistInfo())
    recipe.pusher = FlakyPusher(recipe)
    recipe.recovery = RecordingRecovery(recipe)
    recipe.push_source = FrozenSource(ModuleSource(torch.nn.Linear(2, 2)))
    recipe.overlap = OverlappedPush(recipe.push_source, recipe.push_weights, timeout_s=10)
    recipe.settle_push()  # nothing in flight: nothing happens
    assert recipe.settled_push == {} and recipe.recovery.reasons == []

    recipe.overlap.start()
    recipe.settle_push()
    assert recipe.recovery.reasons == ["a weight push failed: ConnectionError('vLLM went away mid-push')"]
    assert recipe.pusher.seen == [(1, 0), (1, 0)]  # the failed push did not move the version; the recovery's did
    assert recipe.version.value == 1 and recipe.settled_push == {"weight_sync/seconds": 0.5}
    assert not recipe.push_source.frozen and not recipe.overlap.in_flight

    recipe.overlap.start()  # the next push succeeds in the background
    recipe.settle_push()
    assert recipe.version.value == 2 and recipe.sync_times == [0.5, 0.5] and len(recipe.recovery.reasons) == 1
    recipe.overlap.close()


@pytest.mark.parametrize(
    ("overrides", "world_size", "sharing", "why"),
    [
        ({}, 1, "overlap", None),
        ({}, 1, "adaptive", None),
        ({}, 2, "overlap", "2 trainer ranks"),
        ({"use_peft": True, "vllm_lora_sync": True}, 1, "overlap", "vllm_lora_sync"),
        ({"full_determinism": True}, 1, "overlap", "full_determinism"),
        ({}, 1, "time_slice", "time_slice"),
    ],
    ids=["on", "adaptive", "ranks", "lora", "determinism", "time-slice"],
)
def test_weight_sync_overlap_says_why_it_is_off(overrides, world_size, sharing, why):
    """With each real sharing object: adaptive's `ThreadGovernor` once crashed here (it has no `enabled`)."""
    from async_grpo.inference.client import InferenceEndpoint
    from async_grpo.inference.replicas import ReplicaSet
    from async_grpo.runner.resource_sharing import ThreadGovernor, TimeSlice

    recipe = GRPORecipe(GRPOConfig(weight_sync_overlap=True, **overrides), DistInfo(world_size=world_size))
    replicas = ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")])  # nothing listens: nothing is called
    recipe.time_slice = (
        ThreadGovernor(replicas, 2, 1, set_threads=lambda n: None)
        if sharing == "adaptive"
        else TimeSlice(replicas, enabled=sharing == "time_slice")
    )
    found = recipe.overlap_off()
    assert found is None if why is None else why in found


class CountingPusher:
    """Stands in for the `ReplicaPusher` `InferenceRecovery` drives: counts server restarts."""

    def __init__(self):
        self.restarts = 0

    def recover_all(self, timeout_s: float) -> None:
        self.restarts += 1


def test_a_run_that_is_stopping_skips_a_failed_push_and_never_restarts_the_server(caplog):
    """Ctrl-C reached the launched vLLM server too, whose engine died mid-push; the run restarted it (a 20 s vLLM
    start) on its way out. While a stop signal is pending, a failed push is skipped (the step's checkpoint holds its
    weights) and a lost server is not restarted: the run stops. Without a signal, a failed push is recovered."""
    from async_grpo.inference.client import InferenceEndpoint
    from async_grpo.inference.health import InferenceHealth
    from async_grpo.inference.replicas import ReplicaSet
    from async_grpo.runner.recovery import InferenceRecovery

    pending: list[int | None] = [None]
    pushes: list[str] = []

    def push_weights() -> float:
        pushes.append("push")
        if len(pushes) == 1 or pending[0] is not None:
            raise ConnectionError("vLLM went away mid-push")
        return 0.5

    pusher = CountingPusher()
    recovery = InferenceRecovery(
        health=InferenceHealth(), replicas=ReplicaSet([InferenceEndpoint("http://127.0.0.1:9")]), pusher=pusher, push_weights=push_weights,
        log_metrics=lambda metrics, step: None, current_step=lambda: 7, current_version=lambda: 6, max_restarts=3,
        recovery_timeout_s=10.0, log_hint=Path("vllm.log"), stop_signal=lambda: pending[0],
    )  # fmt: skip
    assert recovery.push() == 0.5 and pusher.restarts == 1  # no signal: recovered, the weights pushed again
    pending[0] = 2  # SIGINT received during the step
    assert recovery.push() == 0.0 and pusher.restarts == 1
    assert "the weight push of step 7 was skipped: the run is stopping (signal 2)" in caplog.text
    with pytest.raises(KeyboardInterrupt, match="not restarted"):
        recovery.surviving(lambda: (_ for _ in ()).throw(InferenceLost("a generation request failed")))
    assert pusher.restarts == 1
