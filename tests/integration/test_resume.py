"""Checkpoints and exact resume against a real vLLM CPU server: a run resumed from its checkpoint continues the
same MLflow run at the next step with the prompts an uninterrupted run trains on; SIGTERM to `async-grpo train`
writes a checkpoint, stops cleanly, and the same command with resume_from_checkpoint=true continues it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import torch
import yaml

from async_grpo.config import GRPOConfig
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.launch.local import run_local
from async_grpo.runner.checkpoints import complete_checkpoints, read_meta
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.runner.state import load_checkpoint
from async_grpo.trainer.distributed import DistInfo

from .test_faults import _loss_steps

pytestmark = pytest.mark.integration

# One group in flight: groups reach batches in launch order, so a step's prompts are a function of the seed.
BASE = {
    "dataset": "builtin:reverse", "reward_funcs": ["builtin:reverse_format"], "reward_num_workers": 1,
    "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
    "max_completion_length": 8, "torch_num_threads": 1, "learning_rate": 1e-4, "save_model": False,
    "eval_num_prompts": 4, "num_generations_eval": 2, "max_inflight_groups": 1, "warmup_sft_steps": 0,
    "log_completions": True, "log_completions_steps": 1, "num_completions_to_print": 8, "seed": 7,
}  # fmt: skip
STEPS = 8


def step_prompts(tracking_uri: str, run_id: str, steps) -> dict[int, list[str]]:
    """The prompts each step trained on, from the run's completions tables (one row per completion)."""
    client = mlflow.tracking.MlflowClient(tracking_uri)
    out = {}
    for step in steps:
        path = client.download_artifacts(run_id, f"completions/step_{step:06d}.json")
        table = json.loads(Path(path).read_text())
        col = table["columns"].index("prompt")
        out[step] = sorted({row[col] for row in table["data"]})
    return out


def metric_steps(tracking_uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in mlflow.tracking.MlflowClient(tracking_uri).get_metric_history(run_id, key))


def test_resume_continues_the_run_with_the_uninterrupted_prompts(vllm_server, tiny_model_dir, tmp_path):
    common = {**BASE, "model_name_or_path": str(tiny_model_dir), "vllm_url": vllm_server.url, "max_steps": STEPS}
    whole = run_local(GRPOConfig(**common, output_dir=str(tmp_path / "whole")), progress=False)
    # the same run, stopped after 3 steps (max_rollouts) with a checkpoint at step 3, then resumed
    out = tmp_path / "cut"
    t0 = time.perf_counter()
    first = run_local(
        GRPOConfig(**common, output_dir=str(out), max_rollouts=3, save_steps=3, save_total_limit=1), progress=False
    )
    first_s = time.perf_counter() - t0
    ((step, ckpt),) = complete_checkpoints(out)
    assert step == 3 and read_meta(ckpt)["mlflow_run_id"] == first.run_id
    saved = load_checkpoint(ckpt)
    assert (saved.step, saved.policy_version, saved.generation_rounds) == (3, 3, 3)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "model")  # the HF folder loads

    config = GRPOConfig(**common, output_dir=str(out), resume_from_checkpoint=True)
    recipe = GRPORecipe(config, DistInfo(), progress=False)
    status = "FAILED"
    try:
        t0 = time.perf_counter()
        recipe.setup(lambda model_path: InferenceEndpoint(vllm_server.url))
        resume_s = time.perf_counter() - t0
        restored = recipe.state()
        assert (
            restored.step,
            restored.policy_version,
            restored.generation_rounds,
            restored.num_tokens,
            restored.drops,
        ) == (
            saved.step,
            saved.policy_version,
            saved.generation_rounds,
            saved.num_tokens,
            saved.drops,
        )
        assert restored.mlflow_run_id == first.run_id and restored.sampler == saved.sampler
        for name, tensor in saved.learner["model"].items():
            assert torch.equal(restored.learner["model"][name], tensor), name
        for key, per_param in saved.learner["optimizer"]["state"].items():
            for name, value in per_param.items():
                assert torch.equal(
                    torch.as_tensor(restored.learner["optimizer"]["state"][key][name]), torch.as_tensor(value)
                ), (key, name)
        assert restored.learner["lr_scheduler"] == saved.learner["lr_scheduler"]
        recipe.train()
        resumed = recipe.finish()
        status = "FINISHED"
    finally:
        recipe.cleanup(status)
    assert resumed.run_id == first.run_id and resumed.steps == STEPS
    assert resumed.prompts_lost == first.prompts_lost == 0  # the ledger balances across the resume
    uri = resumed.tracking_uri
    assert metric_steps(uri, first.run_id, "num_tokens") == list(range(1, STEPS + 1))  # each step once
    assert mlflow.tracking.MlflowClient(uri).get_run(first.run_id).info.status == "FINISHED"
    later = range(4, STEPS + 1)  # the 5 steps after the checkpoint
    assert step_prompts(uri, first.run_id, later) == step_prompts(whole.tracking_uri, whole.run_id, later)
    print(f"\nfirst part {first_s:.1f} s; resume setup (checkpoint load + push) {resume_s:.1f} s")


def test_sigterm_checkpoints_and_the_same_command_resumes(vllm_server, tiny_model_dir, tmp_path):
    """The trainer pod's case: its process gets SIGTERM (the kubelet's), checkpoints its step and exits 130 leaving
    no process; the restarted pod runs the same command and resumes. As on Kubernetes, vLLM is a server of its own
    that the trainer attaches to (`vllm_url`, here the session's): it outlives the trainer. (A launched server's
    end on a signal: tests/integration/test_interrupt.py.)"""
    out = tmp_path / "run"
    cfg = {
        **BASE,
        "model_name_or_path": str(tiny_model_dir),
        "vllm_url": vllm_server.url,
        "output_dir": str(out),
        "max_steps": 100000,
        "resume_from_checkpoint": True,
        "checkpoint_signal_grace_s": 30,
        "log_completions": False,
        "vllm_startup_timeout_s": 400,
        "mlflow_tracking_uri": f"sqlite:///{out / 'mlflow.db'}",
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "async_grpo.cli", "train", str(path)]
    # run from tmp_path: with an explicit sqlite URI, MLflow puts artifacts in ./mlruns of the working directory
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.log", "wb"))
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 400
        # steps read through read-only sqlite: an MlflowClient here would run MLflow's schema set-up against the
        # store the trainer is creating, and the two migrations racing killed the trainer ("expected to match one
        # row when updating ... 0 found")
        while _loss_steps(out / "mlflow.db") < 2:  # vLLM is up and training has taken a couple of steps
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "run did not start in time"
            _record(proc.pid, seen)
            time.sleep(1.0)
        _record(proc.pid, seen)
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends the trainer pod's process
        code = proc.wait(timeout=cfg["checkpoint_signal_grace_s"] + 30)
        stop_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "stderr.log").read_text()
    assert code == 130, log[-3000:]
    checkpoints = complete_checkpoints(out)
    assert checkpoints, log[-3000:]
    step, ckpt = checkpoints[-1]
    assert step >= 1 and stop_s < cfg["checkpoint_signal_grace_s"]
    deadline = time.monotonic() + 10
    while (survivors := [p for p in seen.values() if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors, f"left running after SIGTERM: {[(p.pid, p.name()) for p in survivors]}"
    run_id = read_meta(ckpt)["mlflow_run_id"]
    uri = f"sqlite:///{out / 'mlflow.db'}"
    assert mlflow.tracking.MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    # the same command again (as a restarted pod runs it), now to step + 2
    cmd += [f"max_steps={step + 2}"]
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(uri)
    assert [r.info.run_id for e in client.search_experiments() for r in client.search_runs(e.experiment_id)] == [run_id]
    assert metric_steps(uri, run_id, "num_tokens")[-3:] == [step, step + 1, step + 2]
    assert client.get_run(run_id).info.status == "FINISHED"
    print(f"\nSIGTERM at step ~{step}: exited in {stop_s:.1f} s")


def _record(pid: int, seen: dict[int, psutil.Process]) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen.setdefault(child.pid, child)
    except psutil.NoSuchProcess:
        pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
