"""A short real run (real vLLM, real reward workers, real MLflow store), then the store is queried."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local

pytestmark = pytest.mark.integration

EXPECTED_METRICS = [
    # TRL names
    "reward", "reward_std", "rewards/reverse_exact_match/mean", "rewards/reverse_format/mean",
    "memory/rss_mb/trainer", "memory/rss_mb/vllm", "memory/rss_mb/workers",  # runner.memory, every logged step
    "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
    "loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max",
    # pipeline metrics
    "staleness/mean", "staleness/max", "queue/depth", "trainer/idle_seconds", "generation/tokens_per_s",
    "weight_sync/seconds", "weight_sync/bytes", "dropped_groups/total",
    # the generation side's reward time (issue 53), measured in the reward workers
    "rewards/seconds", "rewards/reverse_exact_match/seconds", "generation/vllm_busy_fraction",
    # held-out reward
    "eval/reward",
]  # fmt: skip


def test_short_run_logs_everything_to_mlflow(child_pids, vllm_server, tiny_model_dir, tmp_path):
    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir), dataset="builtin:reverse", output_dir=str(tmp_path / "run"),
        vllm_url=vllm_server.url, warmup_sft_steps=20, max_steps=4, vllm_sync_interval=2, beta=0.04,
        per_device_train_batch_size=16, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=8, eval_num_prompts=8, log_completions_steps=2, torch_num_threads=1,
        learning_rate=1e-4, log_plots_steps=2,
    )  # fmt: skip
    before = child_pids()  # the shared vLLM server and its engine
    summary = run_local(config, progress=False)

    assert summary.steps == 4
    assert summary.weight_syncs == 3  # version 0 (warm start) + steps 2 and 4
    leftover = child_pids() - before
    assert not leftover, f"processes left behind by the run: {leftover}"  # reward workers were ended

    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["loss_type"] == "dapo" and run.data.params["max_steps"] == "4"
    missing = [m for m in EXPECTED_METRICS if m not in run.data.metrics]
    assert not missing, f"metrics missing from MLflow: {missing}"
    eval_steps = sorted(m.step for m in client.get_metric_history(summary.run_id, "eval/reward"))
    assert eval_steps == [0, 4]
    assert [m.step for m in client.get_metric_history(summary.run_id, "loss")] == [1, 2, 3, 4]
    versions = [m.value for m in client.get_metric_history(summary.run_id, "policy_version")]
    assert versions == [0, 1, 1, 2]
    # every step reports its idle time, push steps included (a push step used to lose it to the determinism wait)
    assert [m.step for m in client.get_metric_history(summary.run_id, "trainer/idle_seconds")] == [1, 2, 3, 4]
    # the time split (issue 53): the named phases and `other` add up to each step's wall time, `other` stays small
    split = {
        key: {m.step: m.value for m in client.get_metric_history(summary.run_id, f"time/{key}_s")}
        for key in ("step", "wait", "compute", "push", "eval", "checkpoint", "log", "other")
    }
    for step in (1, 2, 3, 4):
        parts = sum(split[key][step] for key in split if key != "step")
        assert parts == pytest.approx(split["step"][step], rel=1e-6), step
        assert split["compute"][step] > 0 and split["log"][step] > 0, step
    assert split["push"][2] > 0 and split["push"][4] > 0  # vllm_sync_interval=2
    assert sum(split["other"].values()) <= 0.05 * sum(split["step"].values()), split

    artifacts = {a.path for a in client.list_artifacts(summary.run_id)}
    assert {"config.yaml", "completions"} <= artifacts
    model = mlflow.models.get_model_info(run.data.tags["async_grpo.model_uri"])  # the transformers flavour
    local = Path(mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path / "logged")))
    model_files = {p.name for p in (local / "model").iterdir()}
    assert "config.json" in model_files and "model.safetensors" in model_files
    tables = [a.path for a in client.list_artifacts(summary.run_id, "completions")]
    assert any(p.endswith("step_000002.json") for p in tables)
    # the figures (issue 53): a staleness histogram every log_plots_steps, the end-of-run summary here and in MLflow
    staleness_plots = {a.path for a in client.list_artifacts(summary.run_id, "plots/staleness")}
    assert staleness_plots == {"plots/staleness/step_000002.png", "plots/staleness/step_000004.png"}
    assert summary.summary_plot == str(tmp_path / "run" / "summary.png")
    assert Path(summary.summary_plot).read_bytes()[:4] == b"\x89PNG"
    assert "plots/summary.png" in {a.path for a in client.list_artifacts(summary.run_id, "plots")}
