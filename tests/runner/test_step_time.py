"""The step's time split (`runner.step_time.StepClock`) against a hand-driven clock."""

from __future__ import annotations

import pytest

from async_grpo.runner.step_time import PHASES, StepClock


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_and_other_add_up_to_the_time_between_laps():
    t = FakeClock()
    clock = StepClock(now=t)
    t.now += 0.5  # untimed: other
    with clock.phase("wait"):
        t.now += 2.0
    with clock.phase("compute"):
        t.now += 3.0
    with clock.phase("push"):
        t.now += 1.0
    with clock.phase("compute"):  # a phase entered twice adds up
        t.now += 0.25
    split = clock.lap()
    assert split["time/step_s"] == pytest.approx(6.75)
    assert (split["time/wait_s"], split["time/compute_s"], split["time/push_s"]) == (2.0, 3.25, 1.0)
    assert split["time/other_s"] == pytest.approx(0.5)
    assert sum(split[f"time/{p}_s"] for p in PHASES) + split["time/other_s"] == pytest.approx(split["time/step_s"])
    assert split["time/eval_s"] == split["time/checkpoint_s"] == split["time/log_s"] == 0.0

    t.now += 1.5  # the next step starts where the last lap ended: nothing is lost between steps
    with clock.phase("checkpoint"):
        t.now += 0.5
    second = clock.lap()
    assert (second["time/step_s"], second["time/checkpoint_s"], second["time/other_s"]) == (2.0, 0.5, 1.5)
    assert second["time/compute_s"] == 0.0


def test_a_streamed_wait_moves_from_compute_to_wait_and_a_raising_phase_is_still_counted():
    t = FakeClock()
    clock = StepClock(now=t)
    with clock.phase("compute"):
        t.now += 4.0
    clock.move(1.5, source="compute", target="wait")
    clock.move(10.0, source="push", target="wait")  # at most what the source holds: nothing
    with pytest.raises(RuntimeError), clock.phase("eval"):
        t.now += 0.75
        raise RuntimeError("held-out evaluation failed")
    split = clock.lap()
    assert (split["time/compute_s"], split["time/wait_s"], split["time/eval_s"]) == (2.5, 1.5, 0.75)
    assert split["time/step_s"] == 4.75 and split["time/other_s"] == 0.0
    with pytest.raises(KeyError, match="unknown step phase 'optimizer'"), clock.phase("optimizer"):
        pass
