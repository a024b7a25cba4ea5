"""prepare_dataset: unit tests through `python_func`, plus one run through the kfp.local SubprocessRunner."""

import json

import datasets
import pytest
from kfp import dsl, local

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
    artifact = task.outputs["dataset"]
    assert artifact.metadata["eval_rows"] == 10
    assert len(datasets.load_from_disk(artifact.path)["eval"]) == 10
