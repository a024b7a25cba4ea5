"""The whole pipeline on this machine, three times on one store, as scheduled retraining runs it: `async-grpo
pipeline run-local` with the real kfp.local runner, real vLLM servers, real reward workers and a real MLflow store
and registry, queried afterwards.

1. The first run starts from the base model and registers the first champion.
2. Two runs then start at once from that champion (`warm_start=champion`), with the same run_name: one trains, the
   other has `learning_rate: 0`. Each is scored head to head with the champion on the same held-out prompts and
   seeds (the champion's weights pushed into the challenger's evaluation server); the one that trains is promoted
   exactly when the lower bound of its interval is above 0, the frozen one (the champion's own weights) never, and
   neither run touches the other's folders.
"""

import argparse
import os
import subprocess
import sys

import mlflow
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from async_grpo import cli, cli_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow(seconds=400)]
SHORT = ("max_steps=20", "warmup_sft_steps=300", "eval_num_prompts=16", "eval_steps=10")  # ~2 min on 2 cores
RETRAIN = (
    "warm_start=champion",
    "max_steps=4",
    "eval_num_prompts=16",
    "num_generations_eval=4",
    "reward_num_workers=1",
    "log_completions_steps=100",
)
MODEL = "async-grpo-tiny"


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_scheduled_retraining_builds_on_the_champion_and_promotes_only_a_proven_challenger(
    child_pids, tmp_path, capsys
):
    parser = argparse.ArgumentParser(prog="async-grpo")
    cli_pipeline.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", "run-local", "--output-dir", str(tmp_path), "run_name=ci-short", *SHORT])
    before = child_pids()

    # ---- 1. the first run: base model, no champion yet
    assert args.func(args) == 0

    printed = capsys.readouterr().out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {uri}" in printed
    assert f"{MODEL} version 1 (models:/{MODEL}/1)" in printed
    assert child_pids() - before == set(), "processes left behind by the pipeline"
    (root,) = (tmp_path / "kfp-local").iterdir()
    (job,) = [p for p in root.iterdir() if p.is_dir()]
    assert {p.name for p in job.iterdir()} >= {"prepare-dataset", "train-grpo", "evaluate", "register-model", "cleanup"}
    (first,) = tmp_path.glob("ci-short-*")  # the run's name carries the run id
    assert not (first / "staging").exists()  # cleanup removed the staged dataset
    assert (first / "final-model" / "config.json").is_file()

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("async-grpo").experiment_id

    def runs_by_role():
        found = {}
        for r in client.search_runs([experiment]):
            found.setdefault(r.data.tags["async_grpo.role"], []).append(r)
        return found

    # one parent run per pipeline run, a nested run per step, the config as flat params on the parent
    roles = runs_by_role()
    assert {k: len(v) for k, v in roles.items()} == {"pipeline": 1, "train": 1, "evaluate": 1, "register": 1}
    (parent,), (run,) = roles["pipeline"], roles["train"]
    assert parent.info.run_name == first.name and run.info.run_name == "train"
    assert {r.data.tags["mlflow.parentRunId"] for k in ("train", "evaluate", "register") for r in roles[k]} == {
        parent.info.run_id
    }
    assert {r.info.status for rs in roles.values() for r in rs} == {"FINISHED"}
    assert parent.data.params["max_steps"] == "20" and parent.data.params["loss_type"] == "dapo"
    assert parent.data.tags["registered_model_version"] == f"{MODEL}/1" and parent.data.tags["promoted"] == "True"
    assert parent.data.metrics["final_eval/reward"] == run.data.metrics["final_eval/reward"]
    assert run.data.tags["kfp.run_name"] == first.name and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "20" and run.data.params["warmup_sft_steps"] == "300"
    assert run.data.tags["kfp.launch_backend"] == "local"
    assert run.data.tags["async_grpo.lifecycle.registry_start"].startswith("base builtin:tiny")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 21))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/reward")) == [0, 10, 20]
    final = run.data.metrics["final_eval/reward"]
    # the pipeline's evaluation re-serves the saved checkpoint with the same prompts and seeds as the
    # trainer's last in-run evaluation, so both scores agree
    assert final == pytest.approx(run.data.metrics["eval/reward"], abs=0.05)
    assert "no champion yet" in run.data.tags["final_eval.decision"]
    assert run.data.tags["final_eval.champion_version"] == ""

    v1 = client.get_model_version_by_alias(MODEL, "champion")
    assert str(v1.version) == "1" and v1.run_id == run.info.run_id and v1.status == "READY"
    assert float(v1.tags["eval_reward"]) == pytest.approx(final)
    # lineage: what made this model
    assert v1.tags["mlflow_run_id"] == run.info.run_id and v1.tags["kfp.run_id"]
    assert len(v1.tags["config_sha256"]) == 64 and v1.tags["async_grpo.version"]
    assert "parent_version" not in v1.tags  # started from the base model
    assert float(v1.tags["eval.eval_reward"]) == pytest.approx(final)
    assert "no champion yet" in v1.tags["eval.decision"] and v1.tags["promoted_by"].startswith("pipeline:")
    # the registered version is a transformers-flavour model: it loads and generates text
    mlflow.set_tracking_uri(uri)
    pipe = mlflow.transformers.load_model(f"models:/{MODEL}/1")
    prompt = "reverse: hello\n"  # the demo task's prompt format
    text = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt), text

    # ---- 2. two retraining runs at once from the champion, the same run_name: one trains, one is frozen
    def start(role, *extra):
        cmd = [sys.executable, "-m", "async_grpo.cli", "pipeline", "run-local", "--output-dir", str(tmp_path)]
        log = tmp_path / f"{role}.log"
        cmd += ["run_name=retrain", *RETRAIN, *extra]
        return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy()), log

    runs = {"trains": start("trains"), "frozen": start("frozen", "learning_rate=0")}
    codes = {k: p.wait(timeout=900) for k, (p, _) in runs.items()}
    assert codes == {"trains": 0, "frozen": 0}, "\n\n".join(log.read_text()[-3000:] for _, log in runs.values())
    assert child_pids() - before == set(), "processes left behind"
    for _, log in runs.values():  # the champion (same layout) was pushed into the challenger's evaluation server
        assert "the champion's weights are served by the challenger's server" in log.read_text()

    roles = runs_by_role()
    registered = sum("registered_model_version" in r.data.tags for r in roles["pipeline"])  # the register step ran
    assert {k: len(v) for k, v in roles.items()} == {"pipeline": 3, "train": 3, "evaluate": 3, "register": registered}
    retrained = [r for r in roles["train"] if r.data.tags["kfp.run_name"].startswith("retrain")]
    assert len(retrained) == 2 and {r.info.status for r in retrained} == {"FINISHED"}
    by_role = {("frozen" if r.data.params["learning_rate"] == "0.0" else "trains"): r for r in retrained}
    folders = {role: tmp_path / r.data.tags["kfp.run_name"] for role, r in by_role.items()}
    promoted_versions = {
        r.data.tags["registered_model_version"].rsplit("/", 1)[1]
        for r in by_role.values()
        if "registered_model_version" in r.data.tags
    }
    assert folders["trains"] != folders["frozen"]
    for role, r in by_role.items():
        folder = folders[role]
        assert (folder / "final-model" / "config.json").is_file() and not (folder / "staging").exists()
        assert r.data.tags["async_grpo.parent_version"] == f"{MODEL}/1"
        assert r.data.tags["async_grpo.lifecycle.registry_start"] == f"registry models:/{MODEL}/1"
        assert r.data.params["warmup_sft_steps"] == "0"  # the champion had its warm start
        # judged against version 1 (or, for a run that evaluated after the other was promoted, against that one)
        assert r.data.tags["final_eval.champion_version"] in {"1", *promoted_versions}
        h2h = {k.removeprefix("final_eval/head_to_head/"): v for k, v in r.data.metrics.items() if "head_to_head" in k}
        assert h2h["num_prompts"] == 16 and h2h["unpaired_prompts"] == 0
        assert h2h["ci_low"] <= h2h["mean_difference"] <= h2h["ci_high"]
        assert h2h["challenger_mean"] - h2h["champion_mean"] == pytest.approx(h2h["mean_difference"])
        assert r.data.metrics["final_eval/champion_reward"] == pytest.approx(h2h["champion_mean"])

    # the frozen run started from the champion's weights, kept them, tied with it and was not promoted
    champion_files = folders["frozen"] / "warm-start" / f"{MODEL}-v1"
    start_weights, end_weights = _weights(champion_files), _weights(folders["frozen"] / "final-model")
    assert start_weights.keys() == end_weights.keys()
    assert all(torch.equal(start_weights[k], end_weights[k]) for k in start_weights)
    assert all(torch.equal(start_weights[k], v) for k, v in _weights(first / "final-model").items())
    frozen = by_role["frozen"]
    assert frozen.data.metrics["final_eval/head_to_head/ci_low"] <= 0.0
    assert frozen.data.tags["final_eval.decision"].startswith("skip: not shown better")
    assert "registered_model_version" not in frozen.data.tags

    # the training run is promoted exactly when its interval's lower bound is above 0
    trains = by_role["trains"]
    promoted = trains.data.metrics["final_eval/head_to_head/ci_low"] > 0.0
    assert trains.data.tags["final_eval.decision"].startswith("register" if promoted else "skip")
    champion = client.get_model_version_by_alias(MODEL, "champion")
    if promoted:
        assert champion.run_id == trains.info.run_id and champion.tags["parent_version"] == f"{MODEL}/1"
        assert str(client.get_model_version_by_alias(MODEL, "previous-champion").version) == "1"
        assert cli.main(["model", "rollback", MODEL, "--tracking-uri", uri, "--reason", "ci"]) == 0
        assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
    else:
        assert str(champion.version) == "1"  # the alias stayed where it was
        assert "registered_model_version" not in trains.data.tags
    # promotion by hand refuses a version that does not exist
    assert cli.main(["model", "promote", MODEL, "99", "--tracking-uri", uri, "--reason", "ci"]) == 2
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
