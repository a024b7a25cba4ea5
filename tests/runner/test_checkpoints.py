"""Checkpoint folders, rotation, the resume lookup and the stop-signal guard."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from async_grpo import checkpoint_layout
from async_grpo.config import ConfigError, load_config
from async_grpo.runner import checkpoints
from async_grpo.runner.checkpoints import StopGuard
from async_grpo.runner.state import TrainState, save_checkpoint


def write(root: Path, step: int) -> Path:
    return save_checkpoint(
        TrainState(step=step, mlflow_run_id=f"run{step}"), checkpoint_layout.checkpoint_dir(root, step)
    )


def checkpointer(out_dir: Path, save, **settings) -> checkpoints.Checkpointer:
    """A `Checkpointer` over `save` with the checkpoint section's defaults, overridden by `settings`."""
    section = load_config(None, [f"{k}={v}" for k, v in settings.items()]).checkpoint
    return checkpoints.Checkpointer(
        out_dir=out_dir, save_steps=section.save_steps, save_total_limit=section.save_total_limit,
        checkpoint_on_signal=section.checkpoint_on_signal, max_steps=10, save=save, guard=StopGuard(),
    )  # fmt: skip


def test_rotation_keeps_the_newest_n_and_clears_interrupted_writes(tmp_path):
    for step in (2, 10, 4, 8):
        write(tmp_path, step)
    (tmp_path / ".checkpoint-12.tmp-abc").mkdir()  # a write killed half-way
    deleted = checkpoints.rotate_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-4"]
    assert [s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)] == [8, 10]
    assert not (tmp_path / ".checkpoint-12.tmp-abc").exists()
    assert checkpoints.rotate_checkpoints(tmp_path, None) == []  # None keeps all


def test_a_failed_write_deletes_nothing(tmp_path):
    for step in (1, 2):
        write(tmp_path, step)

    def broken_save(path):
        def write_model(folder):
            raise OSError("disk full")

        return save_checkpoint(TrainState(step=3), path, write_model=write_model)

    with pytest.raises(OSError, match="disk full"):
        checkpointer(tmp_path, broken_save, save_total_limit=1).write(3)
    assert [s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)] == [1, 2]  # both kept: the new one failed
    assert not list(tmp_path.glob(".checkpoint-3*"))


def test_a_periodic_checkpoint_on_a_full_disk_is_counted_and_the_run_trains_on(tmp_path):
    write(tmp_path, 2)
    full = {"disk": True}

    def save(path):
        def write_model(folder):
            if full["disk"]:
                raise OSError(28, "No space left on device")

        return save_checkpoint(TrainState(step=int(path.name.split("-")[1])), path, write_model=write_model)

    ckpt = checkpointer(tmp_path, save, save_steps=2, save_total_limit=1)
    metrics: dict[str, float] = {}
    ckpt.after_step(4, metrics)  # does not raise: training goes on
    assert metrics == {"checkpoint/failed_writes": 1.0} and "checkpoint/seconds" not in metrics
    assert [s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)] == [2]  # the resume point stays
    assert not list(tmp_path.glob(".checkpoint-4*"))
    full["disk"] = False  # space freed: the next save_steps writes and rotates
    metrics = {}
    ckpt.after_step(6, metrics)
    assert metrics["checkpoint/failed_writes"] == 1.0 and metrics["checkpoint/seconds"] >= 0.0
    assert [s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)] == [6]


def test_checkpoint_now_rotates_after_the_new_one_is_complete(tmp_path):
    for step in (1, 2):
        write(tmp_path, step)
    seen = []

    def save(path):
        seen.append([s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)])  # nothing deleted yet
        return write(tmp_path, 3)

    assert checkpointer(tmp_path, save, save_total_limit=1).write(3) >= 0.0
    assert seen == [[1, 2]] and [s for s, _ in checkpoint_layout.complete_checkpoints(tmp_path)] == [3]


def test_resume_true_picks_the_newest_complete_checkpoint(tmp_path):
    write(tmp_path, 3)
    write(tmp_path, 12)
    (tmp_path / "checkpoint-40").mkdir()  # incomplete: no train_state.pt
    (tmp_path / ".checkpoint-50.tmp-x").mkdir()
    (tmp_path / "checkpoint-final").mkdir()
    path = checkpoint_layout.resolve_resume(True, tmp_path)
    assert path == tmp_path / "checkpoint-12"
    assert checkpoints.read_meta(path)["mlflow_run_id"] == "run12"
    assert checkpoint_layout.resolve_resume(str(tmp_path / "checkpoint-3"), tmp_path) == tmp_path / "checkpoint-3"
    assert checkpoint_layout.resolve_resume(None, tmp_path) is None


def test_resume_true_without_checkpoints_starts_fresh_and_a_bad_path_is_an_error(tmp_path, caplog):
    with caplog.at_level("INFO"):
        assert checkpoint_layout.resolve_resume(True, tmp_path / "missing") is None
    assert "starting a fresh run" in caplog.text
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=.*Fix:"):
        checkpoint_layout.resolve_resume(str(tmp_path / "checkpoint-40"), tmp_path)


@pytest.mark.parametrize(("override", "field"), [
    ("save_total_limit=0", "save_total_limit"), ("save_steps=-1", "save_steps"),
    ("checkpoint_signal_grace_s=0", "checkpoint_signal_grace_s"),
    ("checkpoint_on_signal=maybe", "checkpoint_on_signal"),
])  # fmt: skip
def test_bad_checkpoint_values_name_the_field_and_the_fix(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert field in str(info.value) and "Fix:" in str(info.value)


def test_checkpoint_fields_take_hf_values():
    config = load_config(None, ["save_steps=null", "resume_from_checkpoint=false", "save_total_limit=2"]).checkpoint
    assert (config.save_steps, config.resume_from_checkpoint, config.save_total_limit) == (0, None, 2)
    assert load_config(None, ["resume_from_checkpoint=true"]).checkpoint.resume_from_checkpoint is True
    assert (
        load_config(None, ["resume_from_checkpoint=/x/checkpoint-4"]).checkpoint.resume_from_checkpoint
        == "/x/checkpoint-4"
    )
    assert checkpoints.save_every(0, 100) == 0 and checkpoints.save_every(5, 100) == 5
    assert checkpoints.save_every(0.25, 100) == 25  # HF: below 1 a fraction of the steps


def test_stop_guard_lets_a_step_finish_and_a_second_signal_stops_at_once():
    guard = StopGuard(max_wait_s=None)
    assert guard.on_signal(signal.SIGTERM) is True and guard.consistent  # between steps: stop now
    guard = StopGuard(max_wait_s=None)
    guard.begin()
    assert guard.on_signal(signal.SIGTERM) is False and not guard.consistent
    assert guard.on_signal(signal.SIGINT) is True  # Ctrl-C twice: now
    guard = StopGuard(max_wait_s=None)
    guard.begin()
    guard.on_signal(signal.SIGTERM)
    guard.end()
    with pytest.raises(KeyboardInterrupt):
        guard.check()
    assert guard.consistent


def test_a_settled_step_is_checkpointable_but_holds_a_signal_until_its_metrics_are_logged():
    guard = StopGuard(max_wait_s=None)
    guard.begin()
    guard.settle()  # learner, version and counters agree; evaluation and logging still run
    assert guard.consistent
    assert guard.on_signal(signal.SIGTERM) is False  # waits: the step's loss must reach MLflow first
    guard.end()
    with pytest.raises(KeyboardInterrupt):
        guard.check()


def test_stop_guard_abandons_a_step_that_outlives_the_grace():
    guard = StopGuard(max_wait_s=0.2)
    guard.begin()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt, match="abandoned"):
        assert guard.on_signal(signal.SIGTERM) is False
        while time.perf_counter() - t0 < 5:  # a step that never ends
            time.sleep(0.01)
    assert time.perf_counter() - t0 < 2 and not guard.consistent


def test_a_disarmed_guard_never_interrupts_later():
    guard = StopGuard(max_wait_s=0.1)
    guard.begin()
    assert guard.on_signal(signal.SIGTERM) is False
    guard.disarm()  # the step failed instead of ending: cleanup must not be interrupted
    time.sleep(0.3)
    assert not guard.consistent


def test_a_full_disk_is_an_oserror_with_its_errno_from_the_state_and_the_model_writers(tmp_path, monkeypatch):
    from async_grpo.runner import state as state_module

    with monkeypatch.context() as patch:  # the state file on a full disk: /dev/full answers every write with ENOSPC
        patch.setattr(state_module, "open", lambda path, mode: open("/dev/full", mode), raising=False)  # noqa: SIM115
        with pytest.raises(OSError) as info:  # torch.save to a path would raise a bare RuntimeError
            save_checkpoint(TrainState(step=1), tmp_path / "checkpoint-1")
    assert info.value.errno == 28

    def safetensors_full(folder):  # what save_pretrained raises on a full disk (a SafetensorError)
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as info:
        save_checkpoint(TrainState(step=2), tmp_path / "checkpoint-2", write_model=safetensors_full)
    assert info.value.errno == 28 and "serializing" in str(info.value)
    assert not list(tmp_path.iterdir())  # both temporary folders removed
    with pytest.raises(ValueError, match="bug"):  # anything else is not taken for a disk problem
        save_checkpoint(TrainState(step=3), tmp_path / "checkpoint-3", write_model=lambda f: int("bug"))
