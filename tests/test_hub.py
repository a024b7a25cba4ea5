"""Hub ids for the model and the dataset resolve through the standard HF cache layout, offline (never the network);
without a cached copy the error says the hub is unreachable and how to fix it."""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import pytest

from async_grpo import hub
from async_grpo.config import GRPOConfig
from async_grpo.data import load_prompt_dataset
from async_grpo.runner import builders
from async_grpo.tiny_model import build_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF hub cache, with offline mode on (no request leaves the machine)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cached_repo(cache: Path, kind: str, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the cache layout huggingface_hub writes (refs/main -> snapshots/<sha>)."""
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


def test_a_hub_model_id_resolves_to_its_cached_snapshot(hf_cache, tmp_path):
    snap = cached_repo(hf_cache, "model", "acme/tiny-chat")
    for f in build_tiny_model(tmp_path / "built", seed=0).iterdir():
        shutil.copy(f, snap / f.name)
    config = GRPOConfig(model_name_or_path="acme/tiny-chat", output_dir=str(tmp_path / "run"))
    path = builders.resolve_model_path(config)
    assert path == snap and (path / "config.json").is_file()
    assert builders.follower_model_path(config) == snap
    model = builders.load_policy(config.model_copy(update={"gradient_checkpointing": True}), path)
    assert model.is_gradient_checkpointing


def test_a_hub_dataset_id_with_config_and_splits_loads_from_the_cache(hf_cache):
    snap = cached_repo(hf_cache, "dataset", "acme/gsm")
    (snap / "README.md").write_text(CARD)
    (snap / "main").mkdir()
    datasets.Dataset.from_list([{"question": "1+1?", "answer": "#### 2"}] * 3).to_parquet(
        snap / "main" / "train-00000-of-00001.parquet"
    )
    datasets.Dataset.from_list([{"question": "2+2?", "answer": "#### 4"}]).to_parquet(
        snap / "main" / "test-00000-of-00001.parquet"
    )
    train = load_prompt_dataset("acme/gsm", split="train", config_name="main", system_prompt="sys")
    assert len(train) == 3 and train[0]["answer"] == "2" and train[0]["prompt"][0]["role"] == "system"
    test = load_prompt_dataset("acme/gsm", split="eval", config_name="main")
    assert test["prompt"] == ["2+2?"] and test["answer"] == ["4"]
    config = GRPOConfig(dataset="acme/gsm", dataset_config="main")
    assert builders.eval_dataset_spec(config) == "acme/gsm"  # the test split is the held-out set
    assert builders.dataset_options(config, "eval")["split_name"] == "test"


def test_offline_without_a_cached_copy_is_a_clear_error(hf_cache, tmp_path):
    with pytest.raises(hub.HubUnavailable, match="hub cannot be reached.*offline mode.*no copy.*Fix"):
        builders.resolve_model_path(
            GRPOConfig(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", output_dir=str(tmp_path))
        )
    with pytest.raises(
        hub.HubUnavailable, match="dataset 'openai/gsm8k'.*hf download openai/gsm8k --repo-type dataset"
    ):
        load_prompt_dataset("openai/gsm8k", split="train", config_name="main")


def test_local_paths_are_never_taken_for_hub_ids(tmp_path):
    assert hub.looks_like_repo_id("openai/gsm8k") and not hub.looks_like_repo_id("gsm8k")
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert not hub.looks_like_repo_id(str(tmp_path / "a" / "b")) and not hub.looks_like_repo_id("data/train.jsonl")
