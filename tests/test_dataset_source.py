"""dataset_source: the run date and where it came from, `{date}` paths, newest-file folders, row digests, the record."""

import json
import os
from datetime import UTC, date, datetime

import datasets
import pytest

from async_grpo import dataset_source
from async_grpo.data import FILE_LOADERS
from async_grpo.dataset_source import (
    CLOCK,
    CREATE_TIME,
    SCHEDULE_TIME,
    DatasetRecord,
    RunDate,
    read_record,
    resolve_local_path,
    rows_digest,
    run_date,
    substitute_date,
)

NOW = datetime(2026, 11, 26, 23, 30, tzinfo=UTC)
DAY = RunDate(date(2026, 11, 26), SCHEDULE_TIME)


def _touch(path, mtime, text='{"prompt": "p"}\n'):
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


@pytest.mark.parametrize(
    ("schedule", "create", "expected"),
    [
        ("2026-11-25T03:00:00Z", "2026-11-26T09:00:00Z", RunDate(date(2026, 11, 25), SCHEDULE_TIME)),
        ("2026-11-25T03:00:00.123456Z", "", RunDate(date(2026, 11, 25), SCHEDULE_TIME)),
        ("2026-11-25T23:30:00-05:00", "", RunDate(date(2026, 11, 26), SCHEDULE_TIME)),  # UTC's date, not local
        ("2026-11-25T03:00:00", "", RunDate(date(2026, 11, 25), SCHEDULE_TIME)),  # no offset: UTC
        ("", "2026-11-24T10:00:00Z", RunDate(date(2026, 11, 24), CREATE_TIME)),
        ("{{$.pipeline_job_schedule_time_utc}}", "2026-11-24T10:00:00Z", RunDate(date(2026, 11, 24), CREATE_TIME)),
        ("0001-01-01T00:00:00Z", "1970-01-01T00:00:00Z", RunDate(date(2026, 11, 26), CLOCK)),  # Go zero, epoch
        ("{{$.pipeline_job_schedule_time_utc}}", "{{$.pipeline_job_create_time_utc}}", RunDate(NOW.date(), CLOCK)),
        ("", "", RunDate(NOW.date(), CLOCK)),
    ],
)
def test_run_date_prefers_the_schedule_then_the_creation_then_the_clock(schedule, create, expected):
    assert run_date(schedule, create, now=NOW) == expected


def test_run_date_without_a_clock_reading_is_today_in_utc():
    assert run_date() == RunDate(datetime.now(UTC).date(), CLOCK)


@pytest.mark.parametrize("field", ["schedule_time_utc", "create_time_utc"])
def test_a_time_that_is_not_iso_8601_is_refused_naming_the_input(field):
    with pytest.raises(ValueError, match=rf"{field}='yesterday' is not an ISO 8601 timestamp.*Fix:"):
        run_date(**{field: "yesterday"})


def test_only_the_literal_date_token_is_replaced():
    assert substitute_date("/w/{date}/x-{date}.jsonl", DAY) == "/w/2026-11-26/x-2026-11-26.jsonl"
    # no format mini-language: other braces, format specs and attribute lookups stay literal
    for spec in ("/w/{date:%Y}.jsonl", "/w/{0}.jsonl", "/w/{date.year}.jsonl", "/w/{{date}}.jsonl", "/w/{DATE}"):
        assert substitute_date(spec, DAY) == spec.replace("{date}", "2026-11-26")
    assert substitute_date("/w/{date:%Y}.jsonl", DAY) == "/w/{date:%Y}.jsonl"


def test_a_date_path_resolves_to_the_run_dates_file(tmp_path):
    wanted = _touch(tmp_path / "2026-11-26.jsonl", 1_000)
    _touch(tmp_path / "2026-11-25.jsonl", 2_000)

    source = resolve_local_path(f"file://{tmp_path}/{{date}}.jsonl", DAY)

    assert source.path == str(wanted) and source.when == DAY and source.newest_of is None
    assert "{date} = 2026-11-26 from schedule_time_utc" in source.describe()


def test_a_missing_date_path_names_the_resolved_path_and_the_dates_source(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        resolve_local_path(str(tmp_path / "{date}.jsonl"), RunDate(date(2026, 11, 24), CREATE_TIME))
    message = str(err.value)
    assert str(tmp_path / "2026-11-24.jsonl") in message
    assert "the run date from create_time_utc" in message and "Fix:" in message


def test_a_folder_of_data_files_resolves_to_its_newest(tmp_path):
    _touch(tmp_path / "a.jsonl", 3_000)
    newest = _touch(tmp_path / "b.parquet", 5_000)
    _touch(tmp_path / "c.jsonl", 4_000)
    _touch(tmp_path / "notes.txt", 9_000)  # not a data file
    _touch(tmp_path / ".incoming.jsonl", 9_000)  # still being written
    (tmp_path / "sub").mkdir()  # folders are not searched

    source = resolve_local_path(str(tmp_path), DAY)

    assert source.path == str(newest) and source.newest_of == str(tmp_path) and source.when is None
    assert "newest data file of" in source.describe()


def test_equal_modification_times_go_to_the_greater_name(tmp_path):
    _touch(tmp_path / "2026-11-25.jsonl", 7_000)
    later = _touch(tmp_path / "2026-11-26.jsonl", 7_000)
    assert resolve_local_path(str(tmp_path), DAY).path == str(later)


def test_a_dated_folder_resolves_to_its_newest_file(tmp_path):
    (tmp_path / "2026-11-26").mkdir()
    newest = _touch(tmp_path / "2026-11-26" / "part-1.json", 10)
    assert resolve_local_path(str(tmp_path / "{date}"), DAY).path == str(newest)


def test_a_save_to_disk_folder_is_a_dataset_not_a_folder_of_files(tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "p"}]).save_to_disk(str(saved))
    _touch(saved / "extra.json", 2**31)  # even with a newer data file beside it
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p"}])}).save_to_disk(str(dd))

    assert resolve_local_path(str(saved), DAY).path == str(saved)
    assert resolve_local_path(str(dd), DAY).path == str(dd)
    assert resolve_local_path(str(dd), DAY).newest_of is None


def test_a_folder_without_data_files_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(ValueError, match=r"holds no data file .* it holds: README.md. Fix:"):
        resolve_local_path(str(tmp_path), DAY)
    (tmp_path / "README.md").unlink()
    with pytest.raises(ValueError, match="it holds: nothing"):
        resolve_local_path(str(tmp_path), DAY)


def test_resolving_a_resolved_path_changes_nothing(tmp_path):
    _touch(tmp_path / "2026-11-26.jsonl", 1)
    first = resolve_local_path(str(tmp_path), DAY)
    assert resolve_local_path(first.path, RunDate(date(2030, 1, 1), CLOCK)).path == first.path


def test_the_folder_suffixes_are_the_loaders():
    assert set(dataset_source.DATA_FILE_SUFFIXES) == set(FILE_LOADERS)


ROWS = [
    {"prompt": "reverse: abc", "answer": "cba"},
    {"prompt": [{"role": "user", "content": "héllo"}], "answer": "olléh"},
]


def test_the_digest_is_a_stable_content_hash():
    saved = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    reordered_columns = saved.select_columns(["answer", "prompt"])

    assert rows_digest(ROWS) == rows_digest(json.loads(json.dumps(ROWS)))  # two calls, fresh objects
    assert rows_digest(saved) == rows_digest(reordered_columns) == rows_digest(list(saved))
    # sha256 of the canonical JSON line, the same on any machine: printf '{"a":"x","b":1}\n' | sha256sum
    assert rows_digest([{"b": 1, "a": "x"}]) == "b9726bbcdf05823038cfdf7612b50329709a519a5da6f1ac21671f6b5dd31dc2"


def test_the_digest_changes_with_a_value_a_row_or_the_order():
    base = rows_digest(ROWS)
    changed = [dict(ROWS[0], answer="cbA"), ROWS[1]]
    assert rows_digest(changed) != base
    assert rows_digest(ROWS[:1]) != base
    assert rows_digest(ROWS[::-1]) != base
    assert rows_digest([{"n": 1}]) != rows_digest([{"n": 1.0}])


def test_the_record_round_trips_through_digests_json(tmp_path):
    record = DatasetRecord("/w/2026-11-26.jsonl", "/w/eval.jsonl", "2026-11-26", SCHEDULE_TIME, "a" * 64, "b" * 64)
    path = record.write(tmp_path)

    assert path.name == "digests.json" and json.loads(path.read_text())["train_digest"] == "a" * 64
    assert read_record(str(tmp_path)) == record
    assert read_record(f"file://{tmp_path}") == record
    assert read_record(str(tmp_path / "missing")) is None and read_record("builtin:reverse") is None


def test_a_malformed_record_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "digests.json").write_text('{"train_digest": 3}')
    with pytest.raises(ValueError, match=r"digests.json' is not a dataset record .*Fix: remove it"):
        read_record(str(tmp_path))
    (tmp_path / "digests.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a dataset record"):
        read_record(str(tmp_path))
