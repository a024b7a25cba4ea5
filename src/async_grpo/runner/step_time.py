"""Where a step's wall time goes: the trainer's time split, one lap per optimizer step.

A step's wall time runs from the end of the previous step to the end of this one, so the laps of a run tile its step
loop with no gap: waiting for the step's rollouts (the producer's queue, a streamed step's chunks, the determinism
schedule's wait before a push), the trainer's compute (the optimizer step, and the old logprobs of a generation round
trained more than once), the weight push (and waiting for a background one to settle), the held-out evaluation, the
checkpoint, and the step's own logging. What no phase covers (the progress bar, the prompt ledger, small
bookkeeping) is `time/other_s`, so the parts always add up to the wall time and a large `other` means something is
untimed. The verl and prime-rl trackers' `timing_s/*` metrics split a step the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# the named parts of a step, in the order they are logged (`time/<phase>_s`)
PHASES = ("wait", "compute", "push", "eval", "checkpoint", "log")


class StepClock:
    """Accumulates seconds per phase of the current step and closes each step with `lap`.

    Args:
        now: the clock, in seconds (`time.perf_counter`; a test passes its own).

    Phases do not nest: time a statement in exactly one `phase` (a phase inside another would count twice).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._start = now()
        self._spent = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the seconds of the `with` body (also when it raises) in phase `name`.

        Raises:
            KeyError: `name` is not one of `PHASES`.
        """
        if name not in self._spent:
            raise KeyError(f"unknown step phase {name!r}; one of {PHASES}")
        start = self._now()
        try:
            yield
        finally:
            self._spent[name] += self._now() - start

    def move(self, seconds: float, *, source: str, target: str) -> None:
        """Re-book `seconds` already counted in `source` as `target` (a streamed step waits for its chunks inside
        the optimizer step: that wait is `wait`, not `compute`); at most what `source` holds moves."""
        moved = min(max(seconds, 0.0), self._spent[source])
        self._spent[source] -= moved
        self._spent[target] += moved

    def lap(self) -> dict[str, float]:
        """Close the current step and start the next one.

        Returns:
            `time/step_s` (seconds since the previous lap, or since the clock was made), `time/<phase>_s` for every
            phase of `PHASES`, and `time/other_s` = step - the phases (seconds not in any phase; never negative,
            since phases do not overlap).
        """
        end = self._now()
        wall = end - self._start
        split = {f"time/{name}_s": seconds for name, seconds in self._spent.items()}
        split["time/other_s"] = max(wall - sum(self._spent.values()), 0.0)
        split["time/step_s"] = wall
        self._start = end
        self._spent = dict.fromkeys(PHASES, 0.0)
        return split
