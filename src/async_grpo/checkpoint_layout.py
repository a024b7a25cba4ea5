"""Where a run's checkpoints live on disk, and which one `resume_from_checkpoint` means.

A checkpoint is `<output_dir>/checkpoint-<step>/` (HF Trainer's layout) holding `train_state.pt` (the resumable
state), `meta.json` and the model folder `model/`. It is written atomically (a hidden temporary sibling renamed into
place, `runner.state.save_checkpoint`), so a folder named `checkpoint-<step>` holding `train_state.pt` is always
complete. This module only names and finds those folders: the runner writes and reads them, and preflight uses the
same rule to refuse a bad `resume_from_checkpoint` before anything starts.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
MODEL_DIR = "model"
# The layout of train_state.pt (`runner.state`), written into it and into meta.json. Raise it when a TrainState field
# is added, removed, renamed or changes meaning, and give the old version an upgrade (`runner.state.UPGRADES`) or drop
# it from READABLE_FORMAT_VERSIONS; a checkpoint of a version outside them is refused before anything starts
# (`format_mismatch`, preflight) and again when it is loaded (`runner.state.check_format`).
FORMAT_VERSION = 2
# The versions this release resumes: older ones are carried forward field by field (`runner.state.UPGRADES`).
READABLE_FORMAT_VERSIONS = (1, 2)
FORMAT_KEY = "format_version"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """`<output_dir>/checkpoint-<step>` (HF Trainer's name)."""
    return Path(output_dir) / f"{PREFIX}{step}"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in `output_dir`, oldest step first: folders named `checkpoint-<step>` that hold
    `train_state.pt` (temporary `.checkpoint-*.tmp-*` folders and half-written ones are skipped)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(resume: bool | str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint folder `resume_from_checkpoint` names: None for a fresh run; `true` gives the newest
    complete checkpoint in `output_dir`, or None (logged) when there is none, so a restarted pod's first start
    works (HF raises there instead); a path must be a complete checkpoint.

    Raises:
        FileNotFoundError: a path that is not a complete checkpoint (the message names the field and the fix).
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        found = complete_checkpoints(output_dir)
        if not found:
            logger.info("resume_from_checkpoint=true: no checkpoint in %s yet; starting a fresh run", output_dir)
            return None
        return found[-1][1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        missing = "does not exist" if not path.exists() else f"is not a complete checkpoint (no {STATE_FILE})"
        raise FileNotFoundError(
            f"resume_from_checkpoint={resume!r} {missing}. Fix: point at a `{PREFIX}<step>` folder of an earlier "
            "run, or set resume_from_checkpoint: true for the newest one in output_dir."
        )
    return path


def format_mismatch(checkpoint: str | Path) -> str | None:
    """Why this version cannot resume the checkpoint folder `checkpoint`, from its meta.json alone (no torch, no
    train_state.pt read: preflight's check): a message naming the folder, its format version and the fix when
    meta.json names a version outside READABLE_FORMAT_VERSIONS; None when it names one of those, names none (written before
    versioning: the keys of train_state.pt decide when it is loaded) or cannot be read (the load reports that)."""
    try:
        meta = json.loads((Path(checkpoint) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    version = meta.get(FORMAT_KEY) if isinstance(meta, dict) else None
    if version is None or version in READABLE_FORMAT_VERSIONS:
        return None
    return (
        f"{checkpoint} has checkpoint format version {version!r}; this async-grpo reads versions "
        f"{READABLE_FORMAT_VERSIONS[0]}-{FORMAT_VERSION}. "
        "Fix: resume with the async-grpo version that wrote it, or start a fresh run (resume_from_checkpoint=false, "
        "or another output_dir)."
    )
