"""The whole pipeline on this machine: `async-grpo pipeline run-local` with the real kfp.local runner, real vLLM,
real reward workers and a real MLflow store; the store is queried afterwards."""

import argparse
from pathlib import Path

import pytest
from mlflow import MlflowClient

from async_grpo import cli_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SHORT = ("max_steps=20", "warmup_sft_steps=300", "eval_num_prompts=16")  # about 2 minutes on 2 cores


def test_run_local_ends_with_a_registered_model(child_pids, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_pipeline.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", "run-local", "--output-dir", str(tmp_path), "run_name=ci-short", *SHORT])
    before = child_pids()

    assert args.func(args) == 0

    printed = capsys.readouterr().out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {uri}" in printed
    assert "async-grpo-tiny version 1 (models:/async-grpo-tiny/1)" in printed
    assert child_pids() - before == set(), "processes left behind by the pipeline"

    # every task ran through kfp.local, the exit handler included
    (job,) = (tmp_path / "kfp-local").iterdir()
    assert {p.name for p in job.iterdir()} >= {"prepare-dataset", "train-grpo", "evaluate", "register-model", "cleanup"}
    assert not (tmp_path / "ci-short" / "staging").exists()  # cleanup removed the staged dataset
    assert (tmp_path / "ci-short" / "final-model" / "config.json").is_file()

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])
    run_id = run.info.run_id
    assert run.info.run_name == "ci-short" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "20" and run.data.params["warmup_sft_steps"] == "300"
    assert run.data.tags["kfp.launch_backend"] == "local"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 21))
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/reward")) == [0, 20]
    final = run.data.metrics["final_eval/reward"]
    assert [m.step for m in client.get_metric_history(run_id, "final_eval/reward")] == [20]
    # the pipeline's evaluation re-serves the saved checkpoint with the same prompts and seeds as the
    # trainer's last in-run evaluation, so both scores agree
    assert final == pytest.approx(run.data.metrics["eval/reward"], abs=0.05)
    assert run.data.tags["final_eval.decision"].startswith("register")

    champion = client.get_model_version_by_alias("async-grpo-tiny", "champion")
    assert str(champion.version) == "1" and champion.run_id == run_id and champion.status == "READY"
    assert float(champion.tags["eval_reward"]) == pytest.approx(final)
    model_files = {Path(a.path).name for a in client.list_artifacts(run_id, "model")}
    assert {"config.json", "model.safetensors"} <= model_files
    assert [a.path for a in client.list_artifacts(run_id, "final_eval")] == ["final_eval/completions.json"]
