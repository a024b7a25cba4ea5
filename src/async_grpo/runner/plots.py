"""The run in pictures: the staleness histogram of a window of steps, and the end-of-run summary figure.

Both are drawn with matplotlib's object API (`matplotlib.figure.Figure` on the Agg canvas, no pyplot state), so they
can be drawn on the tracker's writer thread while the trainer goes on. `StepHistory` keeps, per step, the few values
the summary draws (a handful of floats per step: a 100,000-step run holds a few MB).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from matplotlib.figure import Figure

from async_grpo.runner.step_time import PHASES

# the per-step values the summary figure draws, by its panel
SUMMARY_KEYS = ("reward", "eval/reward", "kl", "entropy", "staleness/mean", "staleness/max")


@dataclass
class StepHistory:
    """Per step, the values the summary figure draws, and the staleness of the groups of the current plot window.

    Attributes:
        steps: the optimizer steps recorded, in order.
        values: key (one of `SUMMARY_KEYS`, or `time/<phase>_s`) -> {step: value}; a step without the key (no held-out
            evaluation at it, say) is simply absent.
        window: staleness (policy versions) -> fresh groups trained at it, since the last staleness figure.
        window_start: the first step of the current window.
    """

    steps: list[int] = field(default_factory=list)
    values: dict[str, dict[int, float]] = field(default_factory=dict)
    window: Counter = field(default_factory=Counter)
    window_start: int = 1

    def record(self, step: int, metrics: Mapping[str, float], staleness: list[int]) -> None:
        """Keep step `step`'s summary values from `metrics` (the keys of `SUMMARY_KEYS` and the time split) and add
        its fresh groups' `staleness` to the window."""
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)
        for key, value in metrics.items():
            if value is not None and (key in SUMMARY_KEYS or key.startswith("time/")):
                self.values.setdefault(key, {})[step] = float(value)
        self.window.update(staleness)

    def record_eval(self, step: int, reward: float) -> None:
        """Keep a held-out reward measured at `step` outside the step loop (before the first step: 0; the final
        evaluation: the last step)."""
        self.values.setdefault("eval/reward", {})[step] = float(reward)

    def take_window(self, step: int) -> tuple[Counter, int, int]:
        """The staleness counts since the last call, with the window's first and last step (`step`); starts the
        next window after `step`."""
        taken, start = self.window, self.window_start
        self.window, self.window_start = Counter(), step + 1
        return taken, start, step


def staleness_figure(counts: Mapping[int, int], first_step: int, last_step: int, max_staleness: int) -> Figure:
    """A bar chart of how many fresh groups were trained at each staleness (policy versions between sampling and
    training) over steps `first_step`..`last_step`, with the `max_staleness` bound marked."""
    fig = Figure(figsize=(5.0, 3.2), layout="constrained")
    ax = fig.add_subplot()
    top = max([max_staleness, *counts]) if counts else max_staleness
    xs = list(range(top + 1))
    ax.bar(xs, [counts.get(x, 0) for x in xs], color="tab:blue")
    ax.axvline(max_staleness + 0.5, color="tab:red", linestyle="--", label=f"max_staleness = {max_staleness}")
    ax.set_xticks(xs)
    ax.set_xlabel("staleness (policy versions)")
    ax.set_ylabel("groups trained")
    total = sum(counts.values())
    ax.set_title(f"staleness, steps {first_step}-{last_step} ({total} groups)")
    ax.legend(loc="upper right")
    return fig


def summary_figure(history: StepHistory, title: str) -> Figure:
    """The run on one page, each against the optimizer step: reward (training mean and held-out), KL and entropy,
    staleness (mean and max), and the time split (seconds per step by phase, stacked: `runner.step_time`)."""
    fig = Figure(figsize=(11.0, 7.0), layout="constrained")
    axes = fig.subplots(2, 2)
    fig.suptitle(title)

    def line(ax, key: str, label: str, **style) -> None:
        points = sorted(history.values.get(key, {}).items())
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, **style)

    ax = axes[0][0]
    line(ax, "reward", "training reward (step mean)")
    line(ax, "eval/reward", "held-out reward", marker="o")
    ax.set_title("reward")
    ax = axes[0][1]
    line(ax, "kl", "KL")
    line(ax, "entropy", "entropy (nats per token)")
    ax.set_title("KL and entropy")
    ax = axes[1][0]
    line(ax, "staleness/mean", "mean")
    line(ax, "staleness/max", "max", linestyle="--")
    ax.set_title("staleness (policy versions)")
    ax = axes[1][1]
    steps = [s for s in history.steps if s in history.values.get("time/step_s", {})]
    parts = [*PHASES, "other"]
    ax.stackplot(steps, [[history.values.get(f"time/{p}_s", {}).get(s, 0.0) for s in steps] for p in parts],
                 labels=parts)  # fmt: skip
    ax.set_title("time split (seconds per step)")
    for row in axes:
        for ax in row:
            ax.set_xlabel("step")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best", fontsize="small")
    return fig
