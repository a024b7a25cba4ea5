"""weight_sync_overlap on a real run: every push lands, in order, checkpoints name the version vLLM serves, and the
server ends serving exactly the final model."""

from __future__ import annotations

import logging

import mlflow
import pytest
import torch
from transformers import AutoModelForCausalLM

from async_grpo.config import GRPOConfig
from async_grpo.inference.client import VLLMControlClient
from async_grpo.launch.local import run_local
from async_grpo.runner.state import load_checkpoint
from tests.integration.test_weight_sync import _max_gap, _sample

pytestmark = pytest.mark.integration


def test_a_run_with_overlapped_pushes_serves_the_final_model_and_checkpoints_the_served_version(
    child_pids, vllm_server, tiny_model_dir, tmp_path, caplog
):
    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir), dataset="builtin:reverse", output_dir=str(tmp_path / "run"),
        vllm_url=vllm_server.url, warmup_sft_steps=20, max_steps=6, vllm_sync_interval=1, save_steps=3,
        weight_sync_overlap=True, per_device_train_batch_size=16, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=8, eval_num_prompts=8, torch_num_threads=1, learning_rate=3e-3,
    )  # fmt: skip
    before = child_pids()
    with caplog.at_level(logging.INFO, logger="async_grpo.runner.recipe"):
        summary = run_local(config, progress=False)
    assert "weight_sync_overlap: each push runs beside the next optimizer step" in caplog.text
    assert child_pids() - before == set()

    assert summary.steps == 6 and summary.weight_syncs == 7  # version 0 (warm start) + one push per step
    control = VLLMControlClient(vllm_server.url)
    assert control.weight_version() == "6"  # the last push was settled before the final evaluation
    for step in (3, 6):  # a checkpoint waits for the push in flight: its version is the one vLLM serves
        assert load_checkpoint(tmp_path / "run" / f"checkpoint-{step}").policy_version == step

    final = AutoModelForCausalLM.from_pretrained(summary.model_dir, dtype=torch.float32)
    assert _max_gap(final, _sample(vllm_server.url, str(tiny_model_dir), seed=3)) < 1e-3

    client = mlflow.tracking.MlflowClient(summary.tracking_uri)
    synced = client.get_metric_history(summary.run_id, "weight_sync/seconds")
    assert len(synced) == 6 and all(m.value > 0 for m in synced)  # each push's seconds, logged once settled
    history = sorted(client.get_metric_history(summary.run_id, "policy_version"), key=lambda m: m.step)
    versions = [m.value for m in history]
    assert versions == sorted(versions) and versions[-1] >= 5  # in order; at most the push in flight behind
