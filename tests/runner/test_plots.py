"""The run's figures (`runner.plots`): what they draw, from a hand-made history."""

from __future__ import annotations

from collections import Counter

from async_grpo.runner.plots import StepHistory, staleness_figure, summary_figure


def test_the_staleness_window_counts_fresh_groups_per_staleness_and_restarts_after_each_figure():
    history = StepHistory()
    history.record(1, {"reward": 0.5, "loss": 9.0}, [0, 1, 1])
    history.record(2, {"reward": 0.7, "eval/reward": 0.6}, [2])
    counts, first, last = history.take_window(2)
    assert (counts, first, last) == (Counter({1: 2, 0: 1, 2: 1}), 1, 2)
    history.record(3, {"reward": 0.8, "time/step_s": 1.0}, [0])
    assert history.take_window(3) == (Counter({0: 1}), 3, 3)
    assert history.steps == [1, 2, 3]
    assert history.values["reward"] == {1: 0.5, 2: 0.7, 3: 0.8} and history.values["eval/reward"] == {2: 0.6}
    assert "loss" not in history.values  # only what the summary draws is kept
    history.record(3, {"time/compute_s": 0.5}, [])  # a second record of the same step adds to it
    assert history.steps == [1, 2, 3] and history.values["time/compute_s"] == {3: 0.5}

    fig = staleness_figure(counts, first, last, max_staleness=1)
    ax = fig.axes[0]
    assert [bar.get_height() for bar in ax.patches] == [1, 2, 1]  # staleness 0, 1, 2 (beyond the bound of 1)
    assert "steps 1-2 (4 groups)" in ax.get_title()


def test_the_summary_draws_reward_kl_entropy_staleness_and_the_stacked_time_split(tmp_path):
    history = StepHistory()
    for step in range(1, 6):
        split = {"time/step_s": 1.0, "time/wait_s": 0.25, "time/compute_s": 0.5, "time/push_s": 0.2,
                 "time/other_s": 0.05}  # fmt: skip
        history.record(step, {"reward": step / 10, "kl": 0.01, "entropy": 1.2, "staleness/mean": 0.5,
                              "staleness/max": 1.0, **split}, [0])  # fmt: skip
    history.record_eval(0, 0.3)  # before the first step, and the final evaluation after the loop
    history.record_eval(5, 0.45)
    assert history.steps == [1, 2, 3, 4, 5]
    fig = summary_figure(history, "demo: 5 steps")
    reward, kl, staleness, split = fig.axes
    assert [line.get_label() for line in reward.get_lines()] == ["training reward (step mean)", "held-out reward"]
    assert list(reward.get_lines()[1].get_xdata()) == [0, 5] and list(reward.get_lines()[1].get_ydata()) == [0.3, 0.45]
    assert list(reward.get_lines()[0].get_ydata()) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert [line.get_label() for line in kl.get_lines()] == ["KL", "entropy (nats per token)"]
    assert len(staleness.get_lines()) == 2
    layers = split.collections  # one stacked layer per phase and `other`
    assert [c.get_label() for c in layers] == ["wait", "compute", "push", "eval", "checkpoint", "log", "other"]
    top = layers[-1].get_paths()[0].vertices[:, 1].max()
    assert abs(top - 1.0) < 1e-9  # the stack reaches each step's wall time
    path = tmp_path / "summary.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
