"""load_prompt_dataset over every supported source and prompt form, its errors, and prompt encoding."""

import json
import os
from datetime import UTC, date, datetime

import datasets
import pytest

from async_grpo.data import encode_prompt, load_prompt_dataset, prompt_columns, validate_prompt_dataset
from async_grpo.dataset_source import CLOCK, CREATE_TIME, RunDate
from async_grpo.tiny_model import build_tiny_tokenizer

STANDARD = [{"prompt": "reverse: abc\n", "answer": "cba"}, {"prompt": "reverse: xyz\n", "answer": "zyx"}]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: abc"}],
        "answer": "cba",
    },
    {"prompt": [{"role": "user", "content": "reverse: xyz"}], "answer": "zyx"},
]


def write(tmp_path, rows, fmt):
    """Write `rows` in format `fmt` under tmp_path; returns the spec string."""
    if fmt == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        path = tmp_path / "data.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "disk":
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "disk"])
@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
def test_loads_every_format_and_prompt_form(tmp_path, fmt, rows):
    ds = load_prompt_dataset(write(tmp_path, rows, fmt), split="train", seed=0)
    assert len(ds) == 2 and set(ds.column_names) == {"prompt", "answer"}
    assert ds[1]["answer"] == "zyx"
    prompt = ds[0]["prompt"]
    if rows is STANDARD:
        assert prompt == "reverse: abc\n"
    else:
        assert [(m["role"], m["content"]) for m in prompt] == [("system", "be brief"), ("user", "reverse: abc")]


def test_builtin_splits():
    train = load_prompt_dataset("builtin:reverse", split="train", seed=0)
    ev = load_prompt_dataset("builtin:reverse", split="eval", seed=0)
    assert len(train) == 4000 and len(ev) == 200 and not set(train["prompt"]) & set(ev["prompt"])
    assert load_prompt_dataset("builtin:add", split="train", seed=0).column_names == ["prompt", "answer"]


def test_dataset_dict_folder_picks_the_split(tmp_path):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(STANDARD), "test": datasets.Dataset.from_list(STANDARD[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompt_dataset(str(tmp_path / "dd"), split="train")) == 2
    assert len(load_prompt_dataset(str(tmp_path / "dd"), split="eval")) == 1
    datasets.DatasetDict({"a": dd["train"], "b": dd["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\]; none is a train split.*Fix"):
        load_prompt_dataset(str(tmp_path / "ab"), split="train")


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [{"text": "q", "label": "a"}],
            r"column 'prompt' missing; found columns \['text', 'label'\]. "
            r"Fix: rename your prompt column to 'prompt'",
        ),
        ([{"prompt": 3}], r"row 0 field 'prompt' is a int, not a string or a list of messages. Fix:"),
        ([{"prompt": ""}], "row 0 field 'prompt' is an empty string"),
        ([{"prompt": [{"role": "user"}]}], "row 0 field 'prompt' message 0 key 'content' is missing"),
        ([{"prompt": [{"role": "user", "content": 5}]}], "key 'content' is a int"),
        ([{"prompt": ["hello"]}], "message 0 is a str, not a dict"),
        ([{"prompt": []}], "empty message list"),
        ([{"prompt": "p", "completions": "c"}], r"column\(s\) \['completions'\] clash with reward-function arguments"),
    ],
)
def test_bad_prompts_raise_naming_field_and_fix(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        load_prompt_dataset(write(tmp_path, rows, "jsonl"), split="train")


def test_bad_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist. Fix"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"), split="train")
    (tmp_path / "data.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'. Fix: convert it"):
        load_prompt_dataset(str(tmp_path / "data.csv"), split="train")
    with pytest.raises(
        ValueError,
        match=r"unknown builtin task. Fix: use one of \['builtin:add', 'builtin:calc', 'builtin:guess', 'builtin:reverse'\]",
    ):
        load_prompt_dataset("builtin:nope", split="train")
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(ValueError, match="not a datasets.save_to_disk folder"):
        load_prompt_dataset(str(tmp_path / "empty_folder"), split="train")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="could not read it as json"):
        load_prompt_dataset(str(tmp_path / "broken.jsonl"), split="train")
    with pytest.raises(ValueError, match="split='test' must be 'train' or 'eval'"):
        load_prompt_dataset("builtin:reverse", split="test")


def test_a_local_spec_is_resolved_once_here_for_every_caller(tmp_path):
    """`async-grpo train` (and preflight, the follower ranks) read a local spec through load_prompt_dataset: `{date}`
    is today's UTC date there (no schedule), or the `when` given; a folder of data files gives its newest."""
    today = datetime.now(UTC).date().isoformat()
    (tmp_path / f"{today}.jsonl").write_text(json.dumps(STANDARD[0]) + "\n")
    (tmp_path / "2026-01-02.jsonl").write_text("".join(json.dumps(r) + "\n" for r in STANDARD))
    assert len(load_prompt_dataset(str(tmp_path / "{date}.jsonl"), split="train")) == 1
    given = RunDate(date(2026, 1, 2), CREATE_TIME)
    assert len(load_prompt_dataset(f"file://{tmp_path}/{{date}}.jsonl", split="train", when=given)) == 2
    with pytest.raises(FileNotFoundError, match=r"2026-01-03.jsonl' \(\{date\} = 2026-01-03, the run date from clock"):
        load_prompt_dataset(str(tmp_path / "{date}.jsonl"), split="train", when=RunDate(date(2026, 1, 3), CLOCK))
    os.utime(tmp_path / "2026-01-02.jsonl", (2**31, 2**31))  # the newest file of the folder
    assert len(load_prompt_dataset(str(tmp_path), split="train")) == 2


def test_empty_dataset_raises():
    with pytest.raises(ValueError, match="has no rows"):
        validate_prompt_dataset(datasets.Dataset.from_dict({"prompt": []}), "x")


def test_encode_standard_prompt(tokenizer):
    assert encode_prompt(tokenizer, "ab c\n") == [97, 98, 32, 99, 10]


def test_encode_conversational_prompt(tokenizer):
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_adds_bos_only_when_the_tokenizer_does():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    bos_tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    assert encode_prompt(bos_tok, "a b") == [0, 2, 3]


def test_encode_errors(tokenizer):
    with pytest.raises(ValueError, match="prompt is a int"):
        encode_prompt(tokenizer, 3)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    with pytest.raises(ValueError, match="no chat_template"):
        encode_prompt(plain, [{"role": "user", "content": "hi"}])


def test_prompt_columns():
    assert prompt_columns({"prompt": "p", "answer": "a", "id": 3}) == {"answer": "a", "id": 3}


# ------------------------------------------------------------------ PromptSampler
def _items(n: int):
    from async_grpo.data import PromptItem

    return [PromptItem(prompt=f"p{i}", prompt_ids=[i], columns={"i": i}) for i in range(n)]


def _take(sampler, n: int) -> list[int]:
    return [next(sampler).prompt_ids[0] for _ in range(n)]


def test_prompt_sampler_covers_every_item_once_per_epoch():
    from async_grpo.data import PromptSampler

    data = _items(7)
    sampler = PromptSampler(data, seed=3)
    seq = [next(sampler) for _ in range(7 * 4)]
    for epoch in range(4):
        chunk = seq[epoch * 7 : (epoch + 1) * 7]
        assert sorted(x.prompt_ids[0] for x in chunk) == list(range(7))
        assert all(x is data[x.prompt_ids[0]] for x in chunk)
    assert sampler.epoch == 3 and sampler.index == 7


def test_prompt_sampler_order_is_one_rng_shuffling_each_epoch():
    """The order a run trains on: random.Random(seed) shuffles range(n) at every epoch start (hand-derived)."""
    import random

    from async_grpo.data import PromptSampler

    rng = random.Random(5)
    expected = []
    for _ in range(3):
        order = list(range(6))
        rng.shuffle(order)
        expected += order
    assert _take(PromptSampler(_items(6), seed=5), 18) == expected
    assert _take(PromptSampler(_items(6), seed=5), 18) != _take(PromptSampler(_items(6), seed=6), 18)


def test_prompt_sampler_resumes_exactly_from_its_state():
    import pickle

    from async_grpo.data import PromptSampler

    original = PromptSampler(_items(5), seed=1)
    _take(original, 8)  # mid second epoch
    state = pickle.loads(pickle.dumps(original.state_dict()))
    resumed = PromptSampler(_items(5), seed=999)  # the seed is part of the saved RNG state
    resumed.load_state_dict(state)
    assert _take(resumed, 17) == _take(original, 17)  # across two more epoch boundaries


def test_prompt_sampler_refuses_a_state_of_another_dataset():
    from async_grpo.data import PromptSampler

    state = PromptSampler(_items(5), seed=0).state_dict()
    with pytest.raises(ValueError, match="5 prompts, this dataset has 4"):
        PromptSampler(_items(4), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="no prompts"):
        PromptSampler([], seed=0)
