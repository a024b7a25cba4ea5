"""`TrainState`: everything a resumed run needs, in one dataclass, and its checkpoint on disk.

The runner captures a `TrainState` from its live roles (`GRPORecipe.state()`) and restores one into them
(`GRPORecipe.restore()`); `save_checkpoint` / `load_checkpoint` move it to and from a folder:

    <checkpoint>/
        train_state.pt    the TrainState's fields and `format_version` (torch.save: tensors and plain Python values
                          only, so `load_checkpoint` reads it with `weights_only=True` and a planted pickle cannot run
                          code on resume)
        meta.json         format version, step, policy version, MLflow run id (readable without torch)
        model/            the policy as a Hugging Face folder (written by the runner; loadable by vllm serve)

A checkpoint is written into a temporary sibling folder and renamed into place, so a crash mid-write never
leaves a folder that looks complete.

The file carries `FORMAT_VERSION`, and `load_checkpoint` checks it and the set of keys before anything is restored:
a checkpoint of another format, or a damaged one, is refused at once with `CheckpointFormatError`, naming what
differs, instead of failing late inside a role or resuming with a field silently defaulted. A checkpoint written
before the version existed (no `format_version`) is read as version 1 (what the last unversioned release wrote). An
older version this release still reads (`READABLE_FORMAT_VERSIONS`) is carried forward by `UPGRADES`, one version at
a time, before its keys are checked.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from async_grpo.checkpoint_layout import (
    FORMAT_KEY,
    FORMAT_VERSION,
    META_FILE,
    MODEL_DIR,
    READABLE_FORMAT_VERSIONS,
    STATE_FILE,
)
from async_grpo.transports.drops import DropReason


class CheckpointFormatError(ValueError):
    """A checkpoint's train_state.pt is not one this version reads: another format version, keys missing or
    unknown, a field of the wrong type, or a file that cannot be read at all (truncated, not a torch file). Raised
    by `load_checkpoint` before anything is restored; the message names the file, what differs and the fix."""


@dataclass
class TrainState:
    """A run's resumable state.

    Attributes:
        step: optimizer steps completed.
        policy_version: the version vLLM serves (bumped at each weight push).
        generation_rounds: generation rounds trained so far (`produce` calls; axolotl's rollouts, `max_rollouts`).
            Format version 1 named it `rollouts`.
        learner: `Learner.state_dict()`: model weights, optimizer and scheduler state, counters.
        rng: the process RNG states (`capture_rng()`): python, numpy, torch CPU and CUDA.
        sampler: the prompt sampler's position (`PromptSampler.state_dict()`), None without one.
        replay: the replay buffer (`ReplayBuffer.state_dict()`), None when off.
        reroll: the deferred re-roll FIFO (`RerollQueue.state_dict()`), None when off.
        drops: dropped groups by reason (`transports.drops.DropReason` -> count).
        mlflow_run_id: the MLflow run to continue, None before tracking started.
        weight_syncs: weight pushes so far.
        num_tokens: prompt + completion tokens trained on so far (TRL's cumulative `num_tokens` metric).
        schedule: under `full_determinism`, the orchestrator's schedule (`Orchestrator.schedule_state`: the
            untrained groups sampled at older policy versions, the prompts drawn since, the sampler's live
            position), so a resumed run continues it exactly; None otherwise.
        unlogged_metrics: metrics logged before the checkpoint that MLflow had not taken yet
            (`Tracker.unlogged_metrics`: {"key", "value", "timestamp" (ms), "step"}); the resumed run writes them.
    """

    step: int = 0
    policy_version: int = 0
    generation_rounds: int = 0
    learner: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    sampler: dict[str, Any] | None = None
    replay: dict[str, Any] | None = None
    reroll: dict[str, Any] | None = None
    drops: dict[DropReason, int] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    weight_syncs: int = 0
    num_tokens: int = 0
    schedule: dict[str, Any] | None = None
    unlogged_metrics: list[dict[str, Any]] = field(default_factory=list)


def capture_rng() -> dict[str, Any]:
    """The global RNG states of this process: python `random`, numpy (as plain values and a tensor, which
    `torch.load(weights_only=True)` reads), torch CPU, and every CUDA device."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global RNG states from `capture_rng()` (CUDA only when both sides have it)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: TrainState, path: str | os.PathLike, write_model=None) -> Path:
    """Write `state` to the folder `path` atomically (temporary sibling, then rename); returns the path.

    Args:
        state: what to save.
        path: the checkpoint folder (replaced if it exists).
        write_model: optional callable(folder) that writes the Hugging Face model into `folder/model`.

    Raises:
        OSError: the folder could not be written (not writable, disk full: the errno is kept); the temporary folder
            is removed and nothing else is touched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        # through a Python file: a failed write raises OSError with its errno (torch.save to a path raises a bare
        # RuntimeError from its C++ stream, e.g. "basic_ios::clear: iostream error" on a full disk)
        with open(tmp / STATE_FILE, "wb") as out:
            torch.save({FORMAT_KEY: FORMAT_VERSION, **{f.name: getattr(state, f.name) for f in fields(state)}}, out)
        meta = {
            FORMAT_KEY: FORMAT_VERSION,
            "step": state.step,
            "policy_version": state.policy_version,
            "mlflow_run_id": state.mlflow_run_id,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if write_model is not None:
            write_model(tmp / MODEL_DIR)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        io_error = as_os_error(err)
        if io_error is not None and io_error is not err:
            raise io_error from err
        raise
    return path


def as_os_error(err: BaseException) -> OSError | None:
    """`err` as an OSError when it reports a failed read or write: itself if it is one, else an OSError with the errno
    that safetensors' Rust writer puts in its message (`SafetensorError("... I/O error: No space left on device
    (os error 28)")`, raised by `save_pretrained`); None for anything else."""
    if isinstance(err, OSError):
        return err
    found = re.search(r"\(os error (\d+)\)", str(err))
    return OSError(int(found.group(1)), str(err)) if found else None


def load_checkpoint(path: str | os.PathLike) -> TrainState:
    """Read a `save_checkpoint` folder.

    A checkpoint folder may come from the submitter (`resume_from_checkpoint` on a shared volume), so the state is
    read with `torch.load(weights_only=True)`: tensors and plain values only, never arbitrary pickled objects.

    Raises:
        FileNotFoundError: `path` holds no `train_state.pt` (not a checkpoint, or an interrupted write).
        pickle.UnpicklingError: the file holds anything but tensors and plain values (e.g. a planted pickle).
        CheckpointFormatError: the file cannot be read, or is not this version's format (`check_format`).
    """
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint (no {STATE_FILE}). Fix: point at a folder written by save_checkpoint."
        )
    from async_grpo.data import PromptItem
    from async_grpo.transports.messages import EpisodeSpan, RolloutGroup

    # our own dataclasses (replay buffer groups, re-roll prompts) are the only classes besides tensors and plain
    # values that a checkpoint holds; torch rebuilds them field by field, running none of their code
    with torch.serialization.safe_globals([RolloutGroup, EpisodeSpan, PromptItem]):
        try:
            data = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise  # a class outside the allowed set: refused as such (a planted pickle)
        except (RuntimeError, EOFError, OSError, ValueError) as err:
            raise CheckpointFormatError(
                f"{file} cannot be read ({type(err).__name__}: {err}): the file is damaged or was not written by "
                "save_checkpoint. Fix: resume from an earlier checkpoint-<step> folder, or start a fresh run "
                "(resume_from_checkpoint=false)."
            ) from err
    return TrainState(**check_format(data, file))


def _rename(old: str, new: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An upgrade that renames the key `old` to `new` (a key that is absent is left for the key check to name)."""

    def upgrade(data: dict[str, Any]) -> dict[str, Any]:
        return {(new if key == old else key): value for key, value in data.items()}

    return upgrade


# version -> the function that turns that version's train-state dict into the next version's; a rename or a new field
# with a default belongs here, so older checkpoints keep resuming (`checkpoint_layout.READABLE_FORMAT_VERSIONS`).
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _rename(
        "rollouts", "generation_rounds"
    ),  # issue 49: a rollout is a sampled episode; a `produce` call is a round
}


def check_format(data: object, file: str | os.PathLike = STATE_FILE) -> dict[str, Any]:
    """The TrainState fields of a loaded train_state.pt, after checking its format; `file` names it in messages.

    Accepted: `format_version` == `FORMAT_VERSION` with exactly the TrainState fields, or no `format_version` (written
    before versioning) with exactly version 1's fields, or an older version that `UPGRADES` carries forward (version
    1 -> 2: `rollouts` renamed `generation_rounds`). `step`, `policy_version`, `generation_rounds`, `weight_syncs` and
    `num_tokens` must be non-negative integers and `learner` a dict.

    Raises:
        CheckpointFormatError: anything else, naming the version or the keys that differ.
    """
    fix = (
        "Fix: resume with the async-grpo version that wrote this checkpoint, or start a fresh run "
        "(resume_from_checkpoint=false, or another output_dir)."
    )
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{file} holds a {type(data).__name__}, not a train state dict. {fix}")
    data = dict(data)
    written_as = data.pop(FORMAT_KEY, None)
    version = 1 if written_as is None else written_as  # the last unversioned release wrote version 1's fields
    if isinstance(version, bool) or version not in READABLE_FORMAT_VERSIONS:
        raise CheckpointFormatError(
            f"{file} has checkpoint format version {version!r}; this async-grpo reads versions "
            f"{READABLE_FORMAT_VERSIONS[0]}-{FORMAT_VERSION}. {fix}"
        )
    while version < FORMAT_VERSION:
        data = UPGRADES[version](data)
        version += 1
    version = written_as
    expected = {f.name for f in fields(TrainState)}
    missing, unknown = sorted(expected - data.keys()), sorted(data.keys() - expected)
    if missing or unknown:
        written = f"format version {version}" if version is not None else "no format version (an older release)"
        raise CheckpointFormatError(
            f"{file} ({written}) does not hold this version's train state: missing {missing or 'none'}, unknown "
            f"{unknown or 'none'}. {fix}"
        )
    for name in ("step", "policy_version", "generation_rounds", "weight_syncs", "num_tokens"):
        value = data[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointFormatError(f"{file}: {name}={value!r} is not a non-negative integer. {fix}")
    if not isinstance(data["learner"], dict):
        raise CheckpointFormatError(f"{file}: learner is a {type(data['learner']).__name__}, not a dict. {fix}")
    return data
