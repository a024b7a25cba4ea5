"""Shared test setup: GPU tests skip cleanly without CUDA; one tiny model folder per session (built locally, no
hub access) for the unit tests that train it."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A freshly built tiny byte-level Qwen2 model (seed 0)."""
    return build_tiny_model(tmp_path_factory.mktemp("trainer-tiny") / "model", seed=0)


@pytest.fixture
def tiny_model(tiny_model_path):
    """A fresh float32 copy of the tiny model for one test (tests may train it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: GPU tests cannot run either
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
