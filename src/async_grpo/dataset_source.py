"""Which data a dataset spec names for this run, and the record of what was read: `{date}` paths, newest-file
folders, and a content digest per split.

A recurring run picks up new data without anyone editing the pipeline: `/workspace/data/{date}.jsonl` names the
file of the run's date, and a folder of data files names its newest file. The resolved path and a content digest
of each split are recorded (the Dataset artifact's metadata and a `digests.json` beside the splits), so a run
says exactly which rows it trained on, on every machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATE_TOKEN = "{date}"  # the only placeholder: replaced literally (never str.format) by the run date, YYYY-MM-DD
# The file types `data.load_prompt_dataset` reads (its FILE_LOADERS; a test keeps the two equal).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# Files `datasets.save_to_disk` writes: a folder holding one is a saved dataset, never a folder of data files.
SAVED_DATASET_FILES = ("dataset_dict.json", "dataset_info.json", "state.json")
DIGESTS_FILE = "digests.json"  # the record written beside the splits of the prepare_dataset artifact
DIGEST_ALGORITHM = "sha256 of the rows as JSON lines, keys sorted (async_grpo.dataset_source.rows_digest)"
# Where the run date came from (`RunDate.source`).
SCHEDULE_TIME = "schedule_time_utc"  # the KFP run's scheduled time (PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER)
CREATE_TIME = "create_time_utc"  # the KFP run's creation time (PIPELINE_JOB_CREATE_TIME_UTC_PLACEHOLDER)
CLOCK = "clock"  # this machine's clock, in UTC: `async-grpo train`, kfp.local, or a backend that gave no time
_UNSET_BEFORE_YEAR = 1971  # Go's zero time (year 1) and the Unix epoch are how "no time" reaches us, not a date


@dataclass(frozen=True)
class RunDate:
    """The UTC date `{date}` stands for in this run.

    Attributes:
        day: the date.
        source: where it came from: SCHEDULE_TIME, CREATE_TIME or CLOCK.
    """

    day: date
    source: str

    @property
    def text(self) -> str:
        """The date as `{date}` is replaced by it: YYYY-MM-DD (ISO 8601)."""
        return self.day.isoformat()


def run_date(schedule_time_utc: str = "", create_time_utc: str = "", *, now: datetime | None = None) -> RunDate:
    """The run's UTC date: from its scheduled time, else its creation time, else the clock.

    A value that is empty, still the unsubstituted KFP placeholder (`{{$.pipeline_job_...}}`: KFP backends without
    the fix for kubeflow/pipelines#12616 pass it through as is), or Go's zero time / the Unix epoch counts as not
    given. Values
    are ISO 8601 / RFC 3339 (`2026-11-26T03:00:00Z`; `datetime.fromisoformat`, a trailing `Z` is UTC; a time
    without an offset is taken as UTC).

    Args:
        schedule_time_utc: the KFP run's scheduled time (a recurring run's slot; newer backends give one-off runs
            their creation time here).
        create_time_utc: the KFP run's creation time.
        now: the clock's reading (tests); None: `datetime.now(UTC)`.

    Returns:
        RunDate with the date and its source.

    Raises:
        ValueError: a given value that is not an ISO 8601 timestamp; the message names the input and the fix.
    """
    for field, value in ((SCHEDULE_TIME, schedule_time_utc), (CREATE_TIME, create_time_utc)):
        moment = _parse_time(field, value)
        if moment is not None:
            return RunDate(moment.date(), field)
    clock = now if now is not None else datetime.now(UTC)
    return RunDate(clock.astimezone(UTC).date(), CLOCK)


def _parse_time(field: str, value: str) -> datetime | None:
    """`value` as an aware UTC datetime, or None when it is not given (empty, a KFP placeholder, a zero time)."""
    text = (value or "").strip()
    if not text or (text.startswith("{{") and text.endswith("}}")):
        return None
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1] in "zZ" else text)
    except ValueError:
        raise ValueError(
            f"{field}={value!r} is not an ISO 8601 timestamp (e.g. 2026-11-26T03:00:00Z). Fix: leave it to the "
            "pipeline (it passes the KFP run's time) or leave it empty to use the clock."
        ) from None
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return None if moment.year < _UNSET_BEFORE_YEAR else moment


def substitute_date(spec: str, when: RunDate) -> str:
    """`spec` with every literal `{date}` replaced by `when.text` (YYYY-MM-DD); nothing else in it is interpreted.

    The replacement is digits and dashes only, so it cannot add a path separator or a `..` component: a path that
    is normalized and on the workspace volume stays so after substitution.
    """
    return spec.replace(DATE_TOKEN, when.text)


@dataclass(frozen=True)
class ResolvedSource:
    """A local dataset spec resolved for one run.

    Attributes:
        spec: the spec as given (`file://` stripped).
        path: the file or `save_to_disk` folder to read: `{date}` replaced, a folder of data files replaced by
            its newest file.
        when: the run date, when the spec held `{date}`; else None.
        newest_of: the folder the file was picked from, when the spec named a folder of data files; else None.
    """

    spec: str
    path: str
    when: RunDate | None = None
    newest_of: str | None = None

    def describe(self) -> str:
        """One line for the log: the spec, what it resolved to and why."""
        how = []
        if self.when is not None:
            how.append(f"{DATE_TOKEN} = {self.when.text} from {self.when.source}")
        if self.newest_of is not None:
            how.append(f"newest data file of {self.newest_of}")
        return f"{self.spec!r} -> {self.path!r}" + (f" ({'; '.join(how)})" if how else "")


def is_saved_dataset(folder: Path) -> bool:
    """True when `folder` holds a file `datasets.save_to_disk` writes (SAVED_DATASET_FILES)."""
    return any((folder / name).is_file() for name in SAVED_DATASET_FILES)


def newest_data_file(folder: Path) -> Path:
    """The newest data file directly in `folder`: the latest modification time (`st_mtime_ns`), ties broken by the
    greater name (so `2026-11-26.jsonl` wins over `2026-11-25.jsonl` copied in the same second).

    Data files are those ending in DATA_FILE_SUFFIXES (case-insensitive). Names starting with `.` are skipped,
    so a writer can fill `.part.jsonl` and rename it when it is complete. Subfolders are not searched.

    Raises:
        ValueError: the folder holds no data file; the message lists what it holds and the fix.
    """
    candidates = [
        entry
        for entry in os.scandir(folder)
        if not entry.name.startswith(".") and entry.name.lower().endswith(DATA_FILE_SUFFIXES) and entry.is_file()
    ]
    if not candidates:
        seen = sorted(os.listdir(folder))
        shown = ", ".join(seen[:10]) + (f", ... ({len(seen)} entries)" if len(seen) > 10 else "")
        raise ValueError(
            f"dataset folder {str(folder)!r} holds no data file ({', '.join(DATA_FILE_SUFFIXES)}) and is not a "
            f"datasets.save_to_disk folder (no {', '.join(SAVED_DATASET_FILES)}); it holds: {shown or 'nothing'}. "
            "Fix: put a data file in it, or point dataset at a file or a saved dataset."
        )
    newest = max(candidates, key=lambda e: (e.stat().st_mtime_ns, e.name))
    return folder / newest.name


def resolve_local_path(spec: str, when: RunDate) -> ResolvedSource:
    """The file or saved folder a local dataset spec names for this run.

    `{date}` is replaced by `when` (`substitute_date`); then a folder that is not a `datasets.save_to_disk` folder
    (`is_saved_dataset`) is replaced by its newest data file (`newest_data_file`). A spec without `{date}` naming
    a file or a saved folder comes back unchanged, so resolving a resolved path changes nothing.

    Args:
        spec: a local path (a `file://` prefix is stripped); hub ids and `builtin:` specs are not for this function.
        when: the run date (`run_date`: the KFP run's time in a pipeline; the clock, in UTC, for `async-grpo train`).

    Returns:
        ResolvedSource.

    Raises:
        FileNotFoundError: the path does not exist; the message gives the resolved path and, with `{date}`, the
            date and where it came from.
        ValueError: a folder with no data file that is not a saved dataset (`newest_data_file`).
    """
    spec = spec.removeprefix("file://")
    dated = DATE_TOKEN in spec
    path = Path(substitute_date(spec, when))
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {spec!r} does not exist"
            + (f": {str(path)!r} ({DATE_TOKEN} = {when.text}, the run date from {when.source})" if dated else "")
            + ". Fix: give an existing .jsonl/.json/.parquet file, a folder of them, a datasets.save_to_disk "
            "folder, or builtin:<task>"
            + (f"; for {DATE_TOKEN}, write the run date's file first" if dated else "")
            + "."
        )
    if path.is_dir() and not is_saved_dataset(path):
        return ResolvedSource(spec, str(newest_data_file(path)), when if dated else None, str(path))
    return ResolvedSource(spec, str(path), when if dated else None)


def rows_digest(rows: Iterable[Mapping[str, Any]]) -> str:
    """A content digest of a split: sha256 (hex) over its rows in order, each as one line of JSON with sorted keys.

    Each row is `json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)` plus a
    newline, UTF-8 encoded. It depends only on the values and their order: not on column order, Arrow chunking,
    the machine or the process (`datasets`' `_fingerprint` is none of these). It changes when any value, any row
    or the row order changes (or a value's JSON type, e.g. 1 -> 1.0).

    Args:
        rows: the split's rows (a `datasets.Dataset` iterates as dicts).

    Returns:
        64 hex characters.
    """
    digest = hashlib.sha256()
    for row in rows:
        line = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetRecord:
    """What a prepared dataset was made from: written as DIGESTS_FILE beside its splits.

    Attributes:
        resolved_uri: the training data read (`ResolvedSource.path`, or the hub id / builtin spec).
        eval_resolved_uri: the held-out data read; the same as `resolved_uri` when held out from it.
        run_date: the run date, YYYY-MM-DD.
        date_source: where the run date came from (SCHEDULE_TIME, CREATE_TIME or CLOCK).
        train_digest, eval_digest: `rows_digest` of the `train` and `eval` splits as saved.
        algorithm: how the digests are computed (DIGEST_ALGORITHM).
    """

    resolved_uri: str
    eval_resolved_uri: str
    run_date: str
    date_source: str
    train_digest: str
    eval_digest: str
    algorithm: str = DIGEST_ALGORITHM

    def write(self, folder: str | Path) -> Path:
        """Write the record as `<folder>/digests.json`; returns its path."""
        path = Path(folder) / DIGESTS_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path


def read_record(spec: str) -> DatasetRecord | None:
    """The DatasetRecord of a prepared dataset folder: `<spec>/digests.json`; None when `spec` is not a folder or
    has no such file (a builtin task, a hub id, a file, a folder saved by hand).

    Raises:
        ValueError: the file exists but is not a record (unreadable JSON, a missing or non-string field); the
            message names the file and the fix. Unknown fields are ignored (a newer writer's).
    """
    path = Path(spec.removeprefix("file://")) / DIGESTS_FILE
    if not path.is_file():
        return None
    names = {f.name for f in fields(DatasetRecord)}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(isinstance(data.get(n), str) for n in names):
            raise ValueError(f"expected string fields {sorted(names)}")
    except ValueError as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"{str(path)!r} is not a dataset record ({err}). Fix: remove it, or rerun prepare_dataset to write it."
        ) from None
    return DatasetRecord(**{n: data[n] for n in names})
