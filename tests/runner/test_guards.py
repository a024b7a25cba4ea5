"""Guards found in the issue-10 audit: a tied-embedding model is flagged where its weight push is unverified, GSPO
with a token-summing loss warns as TRL does, and replayed groups stay out of the staleness metrics."""

from __future__ import annotations

import json
import logging

import pytest

from async_grpo.algorithms import LossSettings
from async_grpo.algorithms.objective import GRPOObjective
from async_grpo.config import GRPOConfig
from async_grpo.runner.builders import resolve_model_path
from async_grpo.runner.report import pipeline_metrics


def model_folder(tmp_path, tied: bool):
    folder = tmp_path / ("tied" if tied else "untied")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "tie_word_embeddings": tied}))
    return folder


def test_a_tied_model_is_flagged_only_where_its_push_is_unverified(tmp_path, caplog):
    tied = model_folder(tmp_path, tied=True)
    with caplog.at_level(logging.WARNING):  # gloo re-ties vLLM's LM head (tests/integration/test_weight_sync.py)
        assert resolve_model_path(GRPOConfig(model_name_or_path=str(tied), weight_sync_backend="gloo")) == tied
    assert "not verified" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert resolve_model_path(GRPOConfig(model_name_or_path=str(tied), weight_sync_backend="nccl")) == tied
    assert "not verified" in caplog.text
    untied = model_folder(tmp_path, tied=False)
    assert resolve_model_path(GRPOConfig(model_name_or_path=str(untied), weight_sync_backend="nccl")) == untied


@pytest.mark.parametrize(("loss_type", "warns"), [("dapo", True), ("bnpo", True), ("grpo", False)])
def test_gspo_with_a_token_summing_loss_warns_as_trl_does(loss_type, warns, caplog):
    with caplog.at_level(logging.WARNING):
        GRPOObjective(LossSettings(loss_type=loss_type, importance_sampling_level="sequence"))
    assert ("GSPO paper's setup" in caplog.text) is warns


def test_staleness_metrics_describe_the_groups_they_are_given():
    metrics = pipeline_metrics(
        [2, 0, 1], version=5, depth=1, waited_s=0.5, step_s=1.0, generation_rounds=3, world_size=1, drops={"stale": 2}
    )
    assert metrics["staleness/mean"] == 1.0 and metrics["staleness/max"] == 2.0
    assert metrics["dropped_groups/total"] == 2.0 and metrics["dropped_groups/stale"] == 2.0
    assert (
        pipeline_metrics([], version=5, depth=0, waited_s=0, step_s=0, generation_rounds=1, world_size=1, drops={})[
            "staleness/max"
        ]
        == 0.0
    )  # a step of replayed groups only
