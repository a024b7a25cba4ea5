"""The whole pipeline on this machine: `async-grpo pipeline run-local` with the real kfp.local runner, real vLLM,
real reward workers and a real MLflow store; the store is queried afterwards."""

import argparse
import os
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from async_grpo import cli_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SHORT = ("max_steps=20", "warmup_sft_steps=300", "eval_num_prompts=16", "eval_steps=10")  # ~2 min on 2 cores


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
    (root,) = (tmp_path / "kfp-local").iterdir()
    (job,) = [p for p in root.iterdir() if p.is_dir()]
    assert {p.name for p in job.iterdir()} >= {"prepare-dataset", "train-grpo", "evaluate", "register-model", "cleanup"}
    (folder,) = tmp_path.glob("ci-short-*")  # the run's name carries the run id
    assert not (folder / "staging").exists()  # cleanup removed the staged dataset
    assert (folder / "final-model" / "config.json").is_file()

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])
    run_id = run.info.run_id
    assert run.info.run_name == folder.name and run.info.status == "FINISHED"
    assert f"pipeline run {folder.name!r} finished" in printed
    assert run.data.params["max_steps"] == "20" and run.data.params["warmup_sft_steps"] == "300"
    assert run.data.tags["kfp.launch_backend"] == "local"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 21))
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/reward")) == [0, 10, 20]  # eval_steps
    final = run.data.metrics["final_eval/reward"]
    assert [m.step for m in client.get_metric_history(run_id, "final_eval/reward")] == [20]
    # the pipeline's evaluation re-serves the saved checkpoint with the same prompts and seeds as the
    # trainer's last in-run evaluation, so both scores agree
    assert final == pytest.approx(run.data.metrics["eval/reward"], abs=0.05)
    assert run.data.tags["final_eval.decision"].startswith("register")

    champion = client.get_model_version_by_alias("async-grpo-tiny", "champion")
    assert str(champion.version) == "1" and champion.run_id == run_id and champion.status == "READY"
    assert float(champion.tags["eval_reward"]) == pytest.approx(final)
    # the registered version is a transformers-flavour model: it loads and generates text
    import mlflow

    mlflow.set_tracking_uri(uri)
    pipe = mlflow.transformers.load_model("models:/async-grpo-tiny/1")
    prompt = "reverse: hello\n"  # the demo task's prompt format
    text = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt), text
    assert [a.path for a in client.list_artifacts(run_id, "final_eval")] == ["final_eval/completions.json"]


TINY = (
    "max_steps=2",
    "warmup_sft_steps=0",
    "eval_num_prompts=4",
    "num_generations_eval=2",
    "num_generations=4",
    "per_device_train_batch_size=8",
    "gradient_accumulation_steps=1",
    "max_completion_length=6",
    "reward_num_workers=1",
    "max_inflight_groups=2",
    "log_completions_steps=100",
)


def test_two_concurrent_runs_with_the_same_name_keep_to_their_own(child_pids, tmp_path):
    """Same output folder, same MLflow store, same run_name, at the same time: both finish, each has its own
    folder, staging, MLflow run and kfp.local root, and neither's cleanup removed the other's files."""
    cmd = [
        sys.executable,
        "-m",
        "async_grpo.cli",
        "pipeline",
        "run-local",
        "--output-dir",
        str(tmp_path),
        "run_name=twin",
        *TINY,
    ]
    before = child_pids()
    logs = [tmp_path / f"run-{i}.log" for i in (1, 2)]
    procs = [
        subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy()) for log in logs
    ]
    codes = [p.wait(timeout=900) for p in procs]
    assert codes == [0, 0], "\n\n".join(log.read_text()[-3000:] for log in logs)
    assert child_pids() - before == set(), "processes left behind"

    folders = sorted(tmp_path.glob("twin-*"))
    assert len(folders) == 2, folders
    for folder in folders:
        assert (folder / "final-model" / "config.json").is_file() and not (folder / "staging").exists()
        assert sum(f"pipeline run {folder.name!r} finished" in log.read_text() for log in logs) == 1
    assert len(list((tmp_path / "kfp-local").iterdir())) == 2

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f.name for f in folders]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all("final_eval/reward" in r.data.metrics for r in runs)
