"""The collapse guard: notice when a run's reward falls far below its best, and warn, stop or roll back.

An asynchronous run never sees the same schedule twice (which policy version samples which group, how stale each
batch is), so a configuration that learns in most runs can collapse in one (issue 48: the tool-calling example fell
from a held-out reward of 1.33 to 0.28 in about one run in five). The guard watches two signals:

- the held-out reward (`eval/reward`, at each evaluation): collapsed when it falls below
  ``best - collapse_reward_drop * max(|best|, best - first)``, where `best` is the best held-out reward so far and
  `first` the one before training, and the fall exceeds NOISE_Z standard errors of the difference (`eval/reward_se`
  of both evaluations);
- the rolling training reward (the mean reward of the last `collapse_window_steps` steps' groups, NaN rewards left
  out; from MIN_ROLLING_STEPS steps on, over the steps seen while the window fills), judged by the same rule against
  its own best and first value, its standard error the spread of the window's step means over sqrt(steps); it covers
  runs without a held-out set;
- optionally the policy entropy (`entropy`, mean over the window) below `collapse_min_entropy`.

`CollapseGuard` is plain bookkeeping (no torch, no I/O); the recipe acts on its verdicts (`on_collapse`: warn, stop,
or roll back to the newest checkpoint written at or before the best held-out evaluation).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIN_ROLLING_STEPS", "NOISE_Z", "Collapse", "CollapseGuard", "collapse_threshold", "beyond_noise"]

# The rolling reward is judged once it holds this many steps (or the whole window, if shorter), over the steps it
# holds until the window is full: a collapse in the first steps (issue 48's run: tool calls malformed from step 6 on)
# is judged against the first few steps, not hidden inside a first window that already holds it.
MIN_ROLLING_STEPS = 5
# A fall counts only beyond this many standard errors of the difference between the best value and the current one.
# A reward model's scores are unbounded and noisy: on examples/reward_model_cpu.yaml the step means swing between
# -0.8 and 2.4 (sd ~1.2), so a 20-step window's mean has a standard error near 0.27, and the best of many windows sits
# high by chance. Without this the guard flagged a run whose held-out reward rose from 1.07 to 2.13 (robustness cell
# reward_model_cpu seed 0 busy: rolling 0.75 against a best window of 1.51). A real collapse (issue 48's tool run:
# 1.33 -> 0.28 held-out, every step near 0.3) is many standard errors down.
NOISE_Z = 3.0


def collapse_threshold(best: float, first: float, drop: float) -> float:
    """The reward below which a run counts as collapsed: ``best - drop * max(|best|, best - first)``.

    The margin scales with the reward's size (|best|) and with what the run gained (best - first), so a reward that
    went from 1.33 to a best of 1.67 collapses below 0.84 at drop 0.5, and one that went from 0.28 to 0.36 below 0.18.

    Args:
        best: the best reward seen.
        first: the first reward seen (before training, or the first full window).
        drop: the fraction of the margin (`collapse_reward_drop`), in (0, 1].
    """
    return best - drop * max(abs(best), best - first, 1e-6)


def beyond_noise(best: float, best_se: float, value: float, value_se: float) -> bool:
    """True when `value` lies below `best` by more than NOISE_Z standard errors of their difference,
    ``NOISE_Z * sqrt(best_se**2 + value_se**2)`` (a z-test of two independent means; both standard errors 0: any fall).

    Args:
        best, value: the best mean seen and the current one (reward units).
        best_se, value_se: their standard errors (>= 0; NaN counts as 0).
    """
    noise = math.hypot(0.0 if math.isnan(best_se) else best_se, 0.0 if math.isnan(value_se) else value_se)
    return best - value > NOISE_Z * noise


@dataclass(frozen=True)
class Collapse:
    """A collapse the guard saw.

    Attributes:
        step: the optimizer step it was seen at.
        signal: "eval/reward", "rolling reward" or "entropy".
        value: the signal's value then.
        threshold: the value below which it counts as collapsed.
        best: the best value seen before (for entropy: the floor).
    """

    step: int
    signal: str
    value: float
    threshold: float
    best: float

    def describe(self) -> str:
        """One line for the log: the step, the signal, its value, the threshold and the best."""
        return (
            f"step {self.step}: {self.signal} {self.value:.4g} fell below {self.threshold:.4g} (best {self.best:.4g})"
        )


class CollapseGuard:
    """Bookkeeping of the collapse signals (module docstring).

    Args:
        reward_drop: `collapse_reward_drop`, in (0, 1].
        window_steps: `collapse_window_steps`: steps in the rolling training reward and entropy (>= 1).
        min_entropy: `collapse_min_entropy` (nats per token); None: entropy is not watched.

    Raises:
        ValueError: reward_drop outside (0, 1] or window_steps < 1 (the config refuses them first).
    """

    def __init__(self, reward_drop: float, window_steps: int, min_entropy: float | None = None):
        if not 0.0 < reward_drop <= 1.0 or window_steps < 1:
            raise ValueError(
                f"collapse_reward_drop={reward_drop} must be in (0, 1] and collapse_window_steps={window_steps} >= 1"
            )
        self.reward_drop = reward_drop
        self.min_entropy = min_entropy
        self.eval_first: float | None = None
        self.eval_best: float | None = None
        self.eval_best_se = 0.0
        self.eval_best_step = 0
        self._rewards: deque[float] = deque(maxlen=window_steps)
        self._entropies: deque[float] = deque(maxlen=window_steps)
        self.rolling_first: float | None = None
        self.rolling_best: float | None = None
        self.rolling_best_se = 0.0
        self.collapses = 0  # collapses seen (each a metric `collapse/detected` at its step)
        self.down: set[str] = set()  # signals in a collapse now: reported once, again only after they recovered

    def observe_eval(self, step: int, reward: float, se: float = 0.0) -> Collapse | None:
        """A held-out reward at `step` with its standard error `se` (`eval/reward_se`; 0 when unknown); returns the
        collapse it shows, if any (never for the first one or NaN)."""
        if math.isnan(reward):
            return None
        if self.eval_first is None or self.eval_best is None:
            self.eval_first = self.eval_best = reward
            self.eval_best_se, self.eval_best_step = se, step
            return None
        threshold = collapse_threshold(self.eval_best, self.eval_first, self.reward_drop)
        if reward < threshold and beyond_noise(self.eval_best, self.eval_best_se, reward, se):
            return self._report(Collapse(step, "eval/reward", reward, threshold, self.eval_best))
        self.down.discard("eval/reward")
        if reward >= self.eval_best:
            self.eval_best, self.eval_best_se, self.eval_best_step = reward, se, step
        return None

    def observe_step(self, step: int, rewards: list[float], entropy: float | None) -> Collapse | None:
        """One optimizer step: its groups' rewards (NaN left out) and its mean entropy (None: not measured).
        Returns the collapse the rolling signals show, if any (the reward from MIN_ROLLING_STEPS steps on, the
        entropy once its window is full)."""
        finite = [r for r in rewards if not math.isnan(r)]
        if finite:
            self._rewards.append(sum(finite) / len(finite))
        if entropy is not None and not math.isnan(entropy):
            self._entropies.append(entropy)
        if len(self._rewards) >= min(self._rewards.maxlen or 1, MIN_ROLLING_STEPS):  # grows to the whole window
            rolling = statistics.fmean(self._rewards)
            n = len(self._rewards)
            se = statistics.stdev(self._rewards) / math.sqrt(n) if n > 1 else 0.0
            if self.rolling_first is None or self.rolling_best is None:
                self.rolling_first = self.rolling_best = rolling
                self.rolling_best_se = se
            else:
                threshold = collapse_threshold(self.rolling_best, self.rolling_first, self.reward_drop)
                if rolling < threshold and beyond_noise(self.rolling_best, self.rolling_best_se, rolling, se):
                    self._rewards.clear()  # the next verdict needs a whole new window
                    return self._report(Collapse(step, "rolling reward", rolling, threshold, self.rolling_best))
                self.down.discard("rolling reward")
                if rolling > self.rolling_best:
                    self.rolling_best, self.rolling_best_se = rolling, se
        if self.min_entropy is not None and len(self._entropies) == self._entropies.maxlen:
            mean = sum(self._entropies) / len(self._entropies)
            if mean < self.min_entropy:
                self._entropies.clear()
                return self._report(Collapse(step, "entropy", mean, self.min_entropy, self.min_entropy))
            self.down.discard("entropy")
        return None

    def _report(self, collapse: Collapse) -> Collapse | None:
        """`collapse`, counted, unless its signal is still down from an earlier one (None: a run that stays
        collapsed is reported once per fall, not at every window; on_collapse=warn logged one warning every five
        steps for the rest of such a run)."""
        if collapse.signal in self.down:
            return None
        self.down.add(collapse.signal)
        self.collapses += 1
        return collapse

    def rolled_back(self) -> None:
        """The run went back to a checkpoint: the rolling windows start again (the held-out best is kept: it is
        what the restored policy is judged against)."""
        self._rewards.clear()
        self._entropies.clear()
        self.down.clear()

    def rollback_target(self, checkpoints: list[tuple[int, Path]], collapse_step: int) -> Path | None:
        """The checkpoint to go back to: the newest of `checkpoints` ((step, folder) pairs that exist) written at or
        before the best held-out evaluation; without held-out evaluations, the newest written before the rolling
        window that collapsed at `collapse_step` began. None when there is none (nothing good to go back to)."""
        if self.eval_best is not None and self.eval_best_step > 0:
            limit = self.eval_best_step
        else:
            limit = collapse_step - (self._rewards.maxlen or 1)
        before = [path for step, path in sorted(checkpoints) if step <= limit]
        return before[-1] if before else None
