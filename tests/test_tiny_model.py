"""The locally built tiny model: loads with transformers' Auto classes, generates, and its tokenizer round-trips."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_grpo.tasks import TASKS
from async_grpo.tiny_model import build_tiny_model, ensure_tiny_model, is_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_files_and_config(tiny_dir):
    assert is_tiny_model_dir(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is False  # vLLM CPU weight reload does not refresh a tied lm_head
    assert config["vocab_size"] % 64 == 0
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    assert all(t.dtype == torch.float32 for t in load_file(tiny_dir / "model.safetensors").values())
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [256, 258]  # <|endoftext|> and <|im_end|>


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert tokenizer.encode("ab") == [97, 98]  # one token per byte, nothing added


@pytest.mark.parametrize(
    "text",
    [
        "reverse: abcd\n",
        "  two  spaces, tabs\tand\nnewlines\n\n",
        "<answer>dcba</answer> x=1+2*3? yes!",
        "naïve café 日本",
    ],
)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_round_trip_task_strings(tokenizer):
    for task in TASKS.values():
        for row in task.eval_dataset().select(range(20)):
            prompt = row["prompt"][0]["content"] if task.chat else row["prompt"]
            for text in (prompt, row["answer"], prompt + row["answer"]):
                assert tokenizer.decode(tokenizer.encode(text)) == text


def test_eos_decodes_and_is_skippable(tokenizer):
    ids = tokenizer.encode("dcba") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids) == "dcba<|endoftext|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "dcba"


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "reverse: abc"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nreverse: abc<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(text)[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_model_loads_and_generates(tiny_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    inputs = tokenizer("reverse: abcd\n", return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[0] == 1 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(out[0]), str)


def test_ensure_is_idempotent_and_seeded(tiny_dir, tmp_path):
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir, seed=123) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    same = load_file(build_tiny_model(tmp_path / "again", seed=0) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    original = load_file(tiny_dir / "model.safetensors")
    assert all(torch.equal(original[k], same[k]) for k in original)
    assert not all(torch.equal(original[k], other[k]) for k in original)


def test_incomplete_or_outdated_dir_is_not_a_model(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_tiny_model_dir(tmp_path)
    assert not is_tiny_model_dir(tmp_path / "missing")
    stale = tmp_path / "stale"
    shutil.copytree(tiny_dir, stale)
    (stale / "tiny_model.json").write_text('{"build_version": 1}')
    assert not is_tiny_model_dir(stale)
    ensure_tiny_model(stale)  # rebuilt in place
    assert is_tiny_model_dir(stale)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="head dim 32"):
        build_tiny_model("/nonexistent/never-written", hidden_size=100)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        build_tiny_model("/nonexistent/never-written", num_kv_heads=3)
