"""The collapse guard (`runner/collapse.py`) on hand-computed reward histories, and what the recipe does with a
collapse (`GRPORecipe.on_collapse`: warn, stop, roll back to the newest checkpoint at or before the best held-out
evaluation). Issue 48: the tool-calling example fell from 1.33 to 0.28 in one run of five."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.runner.collapse import CollapseGuard, collapse_threshold
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.runner.state import TrainState, save_checkpoint
from async_grpo.trainer.distributed import DistInfo


def test_the_threshold_scales_with_the_best_and_the_gain():
    assert collapse_threshold(1.67, 1.33, 0.5) == pytest.approx(1.67 - 0.5 * 1.67)  # 0.835
    assert collapse_threshold(0.363, 0.283, 0.5) == pytest.approx(0.363 - 0.5 * 0.363)
    assert collapse_threshold(0.9, -0.5, 0.5) == pytest.approx(0.9 - 0.5 * 1.4)  # the gain is the larger margin
    assert collapse_threshold(0.0, 0.0, 0.5) == pytest.approx(-5e-7)


def test_the_tool_examples_collapse_is_seen_and_its_good_runs_are_not():
    guard = CollapseGuard(0.5, window_steps=20)
    history = [(0, 1.329), (50, 1.52), (100, 1.67), (150, 1.41), (200, 1.55)]  # a good run, noisy
    assert all(guard.observe_eval(step, r) is None for step, r in history)
    assert guard.eval_best == 1.67 and guard.eval_best_step == 100
    collapse = guard.observe_eval(300, 0.278)  # the collapsed run of the issue
    assert collapse is not None and collapse.signal == "eval/reward" and collapse.step == 300
    assert collapse.threshold == pytest.approx(0.835) and collapse.best == 1.67 and guard.collapses == 1
    assert collapse.describe() == "step 300: eval/reward 0.278 fell below 0.835 (best 1.67)"
    assert guard.observe_eval(310, math.nan) is None  # a failed evaluation is no verdict


def test_the_rolling_reward_judges_runs_without_a_held_out_set():
    guard = CollapseGuard(0.5, window_steps=3)
    verdicts = [guard.observe_step(step, rewards, None) for step, rewards in enumerate(
        [[1.0, 1.0], [1.0, math.nan], [1.0], [2.0], [2.0], [2.0], [0.2], [0.1], [0.1]], start=1
    )]  # fmt: skip
    # window means from step 3: 1.0 (first), 1.33, 1.67, 2.0 (best, sd 0), 1.4 (above 2.0 - 0.5 * 2.0 = 1.0), then
    # 0.77: below 1.0, but the window [2.0, 0.2, 0.1] straddles the fall (standard error 0.62, 3 of them 1.85 > 1.23);
    # then 0.13 (standard error 0.03): collapsed
    assert verdicts[:8] == [None] * 8
    assert verdicts[8] is not None and verdicts[8].signal == "rolling reward" and verdicts[8].step == 9
    assert verdicts[8].value == pytest.approx(0.4 / 3) and verdicts[8].threshold == pytest.approx(1.0)
    assert guard.observe_step(10, [0.1], None) is None  # the next verdict waits for a whole new window


def test_a_noisy_reward_that_keeps_rising_is_not_a_collapse():
    """A reward model's unbounded scores: step means swing by +-1.2 around a mean that rises (the robustness cell
    reward_model_cpu seed 0 busy, held-out 1.07 -> 2.13, was flagged at step 92 before the guard weighed the noise);
    a fall many standard errors deep still is one."""
    import random

    rng = random.Random(0)
    guard = CollapseGuard(0.5, window_steps=20)
    rising = [0.2 + 0.015 * step + rng.gauss(0.0, 1.2) for step in range(100)]
    assert all(guard.observe_step(step, [r], None) is None for step, r in enumerate(rising, start=1))
    fell = [guard.observe_step(step, [rng.gauss(-2.0, 0.3)], None) for step in range(101, 121)]
    assert any(v is not None and v.signal == "rolling reward" for v in fell)
    held_out = CollapseGuard(0.5, window_steps=20)
    held_out.observe_eval(0, 1.07, 0.40)
    held_out.observe_eval(50, 2.00, 0.44)
    assert held_out.observe_eval(100, 0.90, 0.44) is None  # 1.1 below the best, within 3 x 0.62
    assert held_out.observe_eval(150, 0.28, 0.02) is not None  # issue 48's fall, with a tight standard error


def test_a_collapse_in_the_first_steps_is_judged_against_the_first_steps():
    """Issue 48's collapsed run: training reward about 1.3 for 5 steps, then about 0.02 (tool calls malformed)."""
    guard = CollapseGuard(0.5, window_steps=20)
    rewards = [1.22, 1.42, 1.36, 1.04, 1.51] + [0.02] * 20
    verdicts = [guard.observe_step(step, [r], None) for step, r in enumerate(rewards, start=1)]
    first = next(i for i, v in enumerate(verdicts, start=1) if v is not None)
    assert guard.rolling_first == pytest.approx(sum(rewards[:5]) / 5)
    assert 6 < first <= 12, first  # the mean of the steps so far falls below 1.31 - 0.5 * 1.31 within a few steps


def test_an_entropy_floor_is_watched_only_when_set():
    quiet = CollapseGuard(0.5, window_steps=2)
    assert all(quiet.observe_step(s, [1.0], 0.001) is None for s in range(1, 6))
    guard = CollapseGuard(0.5, window_steps=2, min_entropy=0.05)
    assert guard.observe_step(1, [1.0], 0.2) is None
    collapse = guard.observe_step(2, [1.0], 0.01)
    assert collapse is None  # mean 0.105 over the window
    collapse = guard.observe_step(3, [1.0], 0.01)
    assert collapse is not None and collapse.signal == "entropy" and collapse.value == pytest.approx(0.01)


def test_the_rollback_target_is_the_newest_checkpoint_at_or_before_the_best_evaluation(tmp_path):
    guard = CollapseGuard(0.5, window_steps=10)
    for step, reward in [(0, 1.3), (20, 1.6), (40, 1.5)]:
        guard.observe_eval(step, reward)
    found = [(10, tmp_path / "c10"), (20, tmp_path / "c20"), (30, tmp_path / "c30")]
    assert guard.rollback_target(found, 50) == tmp_path / "c20"
    assert guard.rollback_target(found[2:], 50) is None  # only a checkpoint from after the best
    rolling = CollapseGuard(0.5, window_steps=10)  # no held-out set: before the collapsed window
    assert rolling.rollback_target(found, 35) == tmp_path / "c20"


class FakeLearner:
    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


class FakeRecovery:
    def __init__(self) -> None:
        self.pushes = 0

    def push(self) -> float:
        self.pushes += 1
        return 0.25


def recipe(tmp_path, **overrides) -> GRPORecipe:
    config = GRPOConfig(output_dir=str(tmp_path), **overrides)
    r = GRPORecipe(config, DistInfo(rank=0, world_size=1, local_rank=0))
    r.learner, r.recovery = FakeLearner(), FakeRecovery()
    return r


def test_warn_logs_and_goes_on(tmp_path, caplog):
    r = recipe(tmp_path)
    r.collapse.observe_eval(0, 1.3)
    metrics = r.on_collapse(r.collapse.observe_eval(10, 0.1))
    assert metrics["collapse/detected"] == 1.0 and not r.stopped_by_collapse
    assert "collapse: step 10: eval/reward 0.1 fell below" in caplog.text


def test_stop_ends_the_step_loop(tmp_path):
    r = recipe(tmp_path, on_collapse="stop")
    r.collapse.observe_eval(0, 1.3)
    r.on_collapse(r.collapse.observe_eval(10, 0.1))
    assert r.stopped_by_collapse and r.recovery.pushes == 0 and r.learner.loaded == []


def test_rollback_restores_the_good_checkpoint_pushes_it_and_stops_when_the_rollbacks_are_spent(tmp_path):
    r = recipe(tmp_path, on_collapse="rollback", save_steps=10, collapse_max_rollbacks=1)
    good = {"weights": torch.ones(2)}
    save_checkpoint(TrainState(step=10, learner=good), tmp_path / "checkpoint-10")
    save_checkpoint(TrainState(step=30, learner={"weights": torch.zeros(2)}), tmp_path / "checkpoint-30")
    for step, reward in [(0, 1.3), (10, 1.6), (20, 1.5)]:
        r.collapse.observe_eval(step, reward)
    metrics = r.on_collapse(r.collapse.observe_eval(40, 0.1))
    assert len(r.learner.loaded) == 1 and torch.equal(r.learner.loaded[0]["weights"], good["weights"])
    assert r.recovery.pushes == 1 and metrics["collapse/rollbacks"] == 1.0 and not r.stopped_by_collapse
    assert metrics["collapse/rollback_push_seconds"] == 0.25 and "weight_sync/seconds" not in metrics
    r.on_collapse(r.collapse.observe_eval(50, 0.1))  # a second collapse, no rollback left
    assert r.stopped_by_collapse and r.recovery.pushes == 1


def test_rollback_needs_periodic_checkpoints_and_refuses_full_determinism():
    with pytest.raises(ValueError, match="on_collapse=rollback goes back to a checkpoint, but save_steps is 0"):
        GRPOConfig(on_collapse="rollback")
    with pytest.raises(ValueError, match="with full_determinism"):
        GRPOConfig(on_collapse="rollback", save_steps=10, full_determinism=True)


def test_a_run_that_stays_collapsed_is_reported_once_per_fall():
    """examples/guess_cpu.yaml at learning_rate 1e-3 (seed 1) fell from 0.69 to about 0.1 at step 21 and stayed
    there: on_collapse=warn logged a warning every five steps to the end. Now once per fall; a recovery and a new
    fall, or a rollback, report again."""
    guard = CollapseGuard(0.5, window_steps=5)
    steps = iter(range(1, 1000))
    seen = [guard.observe_step(next(steps), [r], None) for r in [0.7, 0.69, 0.7, 0.71, 0.69] + [0.1] * 40]
    assert sum(v is not None for v in seen) == 1 and guard.collapses == 1
    again = [guard.observe_step(next(steps), [r], None) for r in [0.7] * 10 + [0.05] * 10]  # recovered, fell again
    assert sum(v is not None for v in again) == 1 and guard.collapses == 2
    guard.rolled_back()
    held = CollapseGuard(0.5, window_steps=5)
    assert held.observe_eval(0, 1.0) is None and held.observe_eval(10, 0.1) is not None
    assert held.observe_eval(20, 0.1) is None  # still down
    held.rolled_back()
    assert held.observe_eval(30, 0.1) is not None  # the restored policy is judged anew
