"""prepare_dataset: unit tests through `python_func`, plus one run through the kfp.local SubprocessRunner."""

import json
import os
from datetime import UTC, datetime

import datasets
import pytest
from kfp import dsl, local

from async_grpo import dataset_source
from components.prepare_dataset.component import prepare_dataset


def _artifact(tmp_path):
    return dsl.Dataset(uri=str(tmp_path / "artifact" / "dataset"), name="dataset", metadata={})


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_builtin_task_keeps_its_own_disjoint_held_out_split(tmp_path):
    out = _artifact(tmp_path)
    result = prepare_dataset.python_func(dataset_uri="builtin:reverse", dataset=out, seed=3)

    saved = datasets.load_from_disk(out.path)
    assert set(saved) == {"train", "eval"}
    assert (result.train_rows, result.eval_rows, result.prompt_format) == (4000, 200, "standard")
    assert len(saved["train"]) == 4000 and len(saved["eval"]) == 200
    assert set(saved["train"]["prompt"]).isdisjoint(saved["eval"]["prompt"])
    assert out.metadata["source"] == "builtin:reverse" and out.metadata["eval_rows"] == 200
    assert out.metadata["columns"] == ["prompt", "answer"]


def test_file_is_split_by_eval_fraction_with_the_seed(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(100)]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    first, second = _artifact(tmp_path / "a"), _artifact(tmp_path / "b")

    result = prepare_dataset.python_func(dataset_uri=f"file://{path}", dataset=first, eval_fraction=0.1, seed=7)
    prepare_dataset.python_func(dataset_uri=str(path), dataset=second, eval_fraction=0.1, seed=7)

    a, b = datasets.load_from_disk(first.path), datasets.load_from_disk(second.path)
    assert (result.train_rows, result.eval_rows) == (90, 10)
    assert sorted(list(a["train"]["prompt"]) + list(a["eval"]["prompt"])) == sorted(r["prompt"] for r in rows)
    assert list(a["eval"]["prompt"]) == list(b["eval"]["prompt"])  # same seed, same split
    assert first.metadata["source"] == str(path)


def test_explicit_eval_file_is_used_whole(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"t{i}"} for i in range(20)])
    held = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"e{i}"} for i in range(5)])
    out = _artifact(tmp_path)

    result = prepare_dataset.python_func(dataset_uri=str(train), eval_dataset_uri=str(held), dataset=out)

    assert (result.train_rows, result.eval_rows) == (20, 5)
    assert list(datasets.load_from_disk(out.path)["eval"]["prompt"]) == [f"e{i}" for i in range(5)]


def test_conversational_prompts_pass_with_a_chat_template(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"reverse {w}"}], "answer": w[::-1]} for w in ("abc", "hello", "xyz")
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)

    result = prepare_dataset.python_func(
        dataset_uri=str(path),
        dataset=_artifact(tmp_path),
        eval_fraction=0.34,
        model_name_or_path="builtin:tiny",
        max_prompt_length=64,
    )

    assert result.prompt_format == "conversational"


def test_conversational_prompts_fail_without_a_chat_template(tmp_path):
    from async_grpo.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "no-template")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}] * 4)

    with pytest.raises(ValueError, match="no chat_template"):
        prepare_dataset.python_func(
            dataset_uri=str(path),
            dataset=_artifact(tmp_path),
            eval_fraction=0.25,
            model_name_or_path=str(tmp_path / "no-template"),
        )


def test_missing_prompt_column_names_the_fix(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}] * 4)

    with pytest.raises(ValueError, match="column 'prompt' missing"):
        prepare_dataset.python_func(dataset_uri=str(path), dataset=_artifact(tmp_path))


def test_every_prompt_too_long_fails_before_training(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 50}] * 10)

    with pytest.raises(ValueError, match="max_prompt_length=8"):
        prepare_dataset.python_func(
            dataset_uri=str(path),
            dataset=_artifact(tmp_path),
            eval_fraction=0.2,
            model_name_or_path="builtin:tiny",
            max_prompt_length=8,
        )


def test_bad_eval_fraction_without_eval_set(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}] * 10)

    with pytest.raises(ValueError, match="eval_fraction"):
        prepare_dataset.python_func(dataset_uri=str(path), dataset=_artifact(tmp_path), eval_fraction=0.0)


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")  # the cluster image, ignored locally
def test_runs_under_the_kfp_local_subprocess_runner(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(40)])
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))

    task = prepare_dataset(dataset_uri=str(path), eval_fraction=0.25, seed=1)

    assert (task.outputs["train_rows"], task.outputs["eval_rows"]) == (30, 10)
    assert task.outputs["resolved_uri"] == str(path) and len(task.outputs["train_digest"]) == 64
    artifact = task.outputs["dataset"]
    assert artifact.metadata["eval_rows"] == 10 and artifact.metadata["date_source"] == "clock"
    assert len(datasets.load_from_disk(artifact.path)["eval"]) == 10
    assert dataset_source.read_record(artifact.path).train_digest == task.outputs["train_digest"]


# ------------------------------------------------------------------ which data a run reads, and its record
SCHEDULED = "2026-11-26T03:00:00Z"


def _rows(n, tag=""):
    return [{"prompt": f"question {i}{tag}", "answer": str(i)} for i in range(n)]


def _dated(folder, day, rows, mtime=None):
    path = _write_jsonl(folder / f"{day}.jsonl", rows)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_date_path_reads_the_scheduled_days_file(tmp_path):
    wanted = _dated(tmp_path, "2026-11-26", _rows(20))
    _dated(tmp_path, "2026-11-27", _rows(30))
    out = _artifact(tmp_path)

    result = prepare_dataset.python_func(
        dataset_uri=str(tmp_path / "{date}.jsonl"), dataset=out, eval_fraction=0.1,
        schedule_time_utc=SCHEDULED, create_time_utc="2026-11-27T08:00:00Z",
    )  # fmt: skip

    assert result.resolved_uri == str(wanted) and (result.train_rows, result.eval_rows) == (18, 2)
    assert out.metadata["source"] == str(tmp_path / "{date}.jsonl")
    assert out.metadata["resolved_uri"] == out.metadata["eval_resolved_uri"] == str(wanted)
    assert (out.metadata["run_date"], out.metadata["date_source"]) == ("2026-11-26", "schedule_time_utc")


@pytest.mark.parametrize(
    ("schedule", "create", "day", "source"),
    [
        ("{{$.pipeline_job_schedule_time_utc}}", "2026-11-25T23:59:59Z", "2026-11-25", "create_time_utc"),
        ("", "2026-11-25T10:00:00Z", "2026-11-25", "create_time_utc"),
        ("{{$.pipeline_job_schedule_time_utc}}", "{{$.pipeline_job_create_time_utc}}", None, "clock"),
    ],
)
def test_date_falls_back_to_the_creation_time_then_the_clock(tmp_path, schedule, create, day, source):
    day = day or datetime.now(UTC).date().isoformat()
    _dated(tmp_path, day, _rows(10))
    out = _artifact(tmp_path)

    prepare_dataset.python_func(
        dataset_uri=str(tmp_path / "{date}.jsonl"), dataset=out, schedule_time_utc=schedule, create_time_utc=create,
        eval_fraction=0.2,
    )  # fmt: skip

    assert (out.metadata["run_date"], out.metadata["date_source"]) == (day, source)
    assert out.metadata["resolved_uri"] == str(tmp_path / f"{day}.jsonl")


def test_missing_date_file_is_refused_naming_the_resolved_path_and_the_dates_source(tmp_path):
    _dated(tmp_path, "2026-11-25", _rows(10))

    with pytest.raises(FileNotFoundError) as err:
        prepare_dataset.python_func(
            dataset_uri=str(tmp_path / "{date}.jsonl"), dataset=_artifact(tmp_path), schedule_time_utc=SCHEDULED
        )
    assert str(tmp_path / "2026-11-26.jsonl") in str(err.value)
    assert "the run date from schedule_time_utc" in str(err.value)


def test_eval_dataset_takes_the_date_too(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    _dated(tmp_path / "train", "2026-11-26", _rows(20))
    held = _dated(tmp_path / "eval", "2026-11-26", _rows(4, tag="e"))
    out = _artifact(tmp_path)

    result = prepare_dataset.python_func(
        dataset_uri=str(tmp_path / "train" / "{date}.jsonl"), eval_dataset_uri=f"file://{tmp_path}/eval/{{date}}.jsonl",
        dataset=out, schedule_time_utc=SCHEDULED,
    )  # fmt: skip

    assert (result.train_rows, result.eval_rows) == (20, 4)
    assert out.metadata["eval_resolved_uri"] == str(held)
    assert out.metadata["eval_source"] == str(tmp_path / "eval" / "{date}.jsonl")


def test_folder_of_files_reads_the_newest(tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    _dated(drop, "2026-11-24", _rows(10), mtime=1_000)
    newest = _dated(drop, "2026-11-20", _rows(12, tag="!"), mtime=3_000)  # newest by time, not by name
    _dated(drop, "2026-11-25", _rows(14), mtime=2_000)
    out = _artifact(tmp_path)

    result = prepare_dataset.python_func(dataset_uri=str(drop), dataset=out, eval_fraction=0.25)

    assert result.resolved_uri == str(newest) and result.train_rows + result.eval_rows == 12
    assert all(p.endswith("!") for p in datasets.load_from_disk(out.path)["train"]["prompt"])


def test_save_to_disk_folder_is_still_read_as_a_dataset(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(_rows(8)), "test": datasets.Dataset.from_list(_rows(2, tag="t")),
    }).save_to_disk(str(saved))  # fmt: skip

    result = prepare_dataset.python_func(
        dataset_uri=str(saved), eval_dataset_uri=str(saved), dataset=_artifact(tmp_path)
    )

    assert (result.train_rows, result.eval_rows, result.resolved_uri) == (8, 2, str(saved))


def test_folder_without_data_files_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no data file .*Fix:"):
        prepare_dataset.python_func(dataset_uri=str(tmp_path / "empty"), dataset=_artifact(tmp_path))


def test_split_digests_are_stable_and_follow_the_rows(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", _rows(40))
    first, second, third = _artifact(tmp_path / "a"), _artifact(tmp_path / "b"), _artifact(tmp_path / "c")

    one = prepare_dataset.python_func(dataset_uri=str(path), dataset=first, eval_fraction=0.1, seed=3)
    two = prepare_dataset.python_func(dataset_uri=str(path), dataset=second, eval_fraction=0.1, seed=3)
    changed = _rows(40)
    changed[5]["answer"] = "five"
    _write_jsonl(path, changed)
    three = prepare_dataset.python_func(dataset_uri=str(path), dataset=third, eval_fraction=0.1, seed=3)

    assert len(one.train_digest) == 64 and one.train_digest == two.train_digest
    assert first.metadata["eval_digest"] == second.metadata["eval_digest"]
    assert {three.train_digest, third.metadata["eval_digest"]} != {one.train_digest, first.metadata["eval_digest"]}
    saved = datasets.load_from_disk(first.path)  # the digest is that of the split as saved
    assert one.train_digest == dataset_source.rows_digest(saved["train"])


def test_digests_json_beside_the_splits_holds_the_record(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", _rows(20))
    out = _artifact(tmp_path)

    prepare_dataset.python_func(dataset_uri=str(path), dataset=out, eval_fraction=0.1, schedule_time_utc=SCHEDULED)

    record = dataset_source.read_record(out.path)
    assert record.resolved_uri == str(path) and record.date_source == "schedule_time_utc"
    assert record.run_date == "2026-11-26"
    assert (record.train_digest, record.eval_digest) == (out.metadata["train_digest"], out.metadata["eval_digest"])
    assert set(datasets.load_from_disk(out.path)) == {"train", "eval"}  # the extra file does not disturb loading


def test_bad_schedule_time_is_refused_before_reading(tmp_path):
    with pytest.raises(ValueError, match=r"schedule_time_utc='soon' is not an ISO 8601 timestamp"):
        prepare_dataset.python_func(
            dataset_uri="builtin:reverse", dataset=_artifact(tmp_path), schedule_time_utc="soon"
        )


@pytest.fixture
def in_pod(tmp_path, monkeypatch):
    """A cluster pod whose workspace volume is `tmp_path/workspace`."""
    from async_grpo.launch import k8s_policy

    volume = tmp_path / "workspace"
    volume.mkdir()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setattr(k8s_policy, "DEFAULT_DATA_MOUNT_PATH", str(volume))
    return volume


def test_in_a_pod_a_dated_folder_on_the_volume_is_read(in_pod, tmp_path):
    (in_pod / "data" / "2026-11-26").mkdir(parents=True)
    wanted = _dated(in_pod / "data" / "2026-11-26", "part", _rows(10))

    result = prepare_dataset.python_func(
        dataset_uri=f"{in_pod}/data/{{date}}", dataset=_artifact(tmp_path), schedule_time_utc=SCHEDULED,
        eval_fraction=0.2,
    )  # fmt: skip

    assert result.resolved_uri == str(wanted)


@pytest.mark.parametrize("spec", ["{outside}/{date}.jsonl", "{volume}/../outside/{date}.jsonl", "{outside}"])
def test_in_a_pod_a_date_or_folder_spec_off_the_volume_is_refused_before_reading(in_pod, tmp_path, spec):
    outside = tmp_path / "outside"
    outside.mkdir()
    _dated(outside, "2026-11-26", _rows(10))
    uri = spec.replace("{outside}", str(outside)).replace("{volume}", str(in_pod))

    with pytest.raises(ValueError, match="must be a normalized path on the workspace volume"):
        prepare_dataset.python_func(dataset_uri=uri, dataset=_artifact(tmp_path), schedule_time_utc=SCHEDULED)


def test_in_a_pod_the_check_applies_to_the_resolved_path(in_pod, tmp_path, monkeypatch):
    outside = _write_jsonl(tmp_path / "outside.jsonl", _rows(10))
    monkeypatch.setattr(
        dataset_source,
        "resolve_local_path",
        lambda spec, when: dataset_source.ResolvedSource(spec, str(outside)),  # what a resolver bug would return
    )

    with pytest.raises(ValueError, match=r"\(resolved to '.*outside.jsonl'\): in a cluster pod"):
        prepare_dataset.python_func(dataset_uri=f"{in_pod}/data.jsonl", dataset=_artifact(tmp_path))
