"""Every benchmark runs to completion in a reduced size and prints the ratio it exists for (CI has no GPU and two
cores: the numbers are not checked, only that each script still measures what its docstring says)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, timeout_s: float = 600) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    if out.returncode != 0:  # the report's lines (not its JSON line) say which check failed
        report = "\n".join(line for line in out.stdout.splitlines() if not line.startswith("{"))
        pytest.fail(f"{script} exited {out.returncode}\nstdout:\n{report[-4000:]}\nstderr:\n{out.stderr[-3000:]}")
    return out.stdout


def test_chunked_logprobs_reduced():
    stdout = run("chunked_logprobs.py", "--n", "2", "--t", "64", "--h", "32", "--v", "4096", "--chunk", "16")
    assert "memory ratio full/chunked" in stdout


def test_reward_scaling_reduced():
    stdout = run("reward_scaling.py", "--groups", "4", "--generations", "2", "--busy-ms", "5", "--workers", "1", "2")
    assert "2 worker(s)" in stdout and "efficiency" in stdout


@pytest.mark.integration
def test_weight_sync_reduced():
    stdout = run(
        "weight_sync.py", "--shape", "demo", "--vllm-dtype", "bfloat16", "--pushes", "2", "--bucket-mb", "0.25"
    )
    assert "full push: " in stdout and "delta push: " in stdout and "x the raw gloo broadcast" in stdout
    assert '"buckets": ' in stdout and "of the dense bytes" in stdout


@pytest.mark.integration
@pytest.mark.slow(seconds=106)
def test_vs_trl_reduced():
    stdout = run("vs_trl.py", "--reduced", "--steps", "1")
    assert "x TRL's steps/s" in stdout and "async / on-policy" in stdout and "its trained tokens/s" in stdout
    assert "on-policy step / (its generation + its training)" in stdout and '"vllm_tokens_per_s"' in stdout
    # TRL's AsyncGRPOTrainer, on CPU through its seams: the stand-ins are named, and its weight pushes were real
    assert "x AsyncGRPOTrainer's trained tokens/s" in stdout and "trl_async_grpo_trainer: " in stdout
    assert '"attention": "sdpa stand-in for FA3 varlen"' in stdout and '"mfu": "stubbed: ' in stdout
    assert '"weight_pushes": 3' in stdout and '"server_weight_version": "3"' in stdout  # cold sync + 2 steps


def test_trl_async_sdpa_stand_in_matches_per_sample_attention(tmp_path):
    """vs_trl's stand-in for AsyncGRPOTrainer's FA3 tree attention: over TRL's own packing of samples that share a
    prompt and part of a completion, the packed forward gives each trained token the log-prob that a plain causal
    SDPA forward of its sample alone gives (grouped-query attention included), with finite gradients."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention

    from async_grpo.tiny_model import build_tiny_model

    spec = importlib.util.spec_from_file_location("trl_async_cpu", ROOT / "benchmarks" / "trl_async_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = build_tiny_model(tmp_path / "model", seed=0)  # 4 query heads, 2 KV heads
    register_tree_attention()
    AttentionInterface.register(TREE_ATTENTION, module.sdpa_tree_attention)
    tree = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=TREE_ATTENTION)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    row, samples = TreeRow(), []
    for group, prompt_len in enumerate((7, 9)):
        prompt = torch.randint(0, tree.config.vocab_size, (prompt_len,), generator=gen)
        for k in range(3):
            completion = torch.randint(0, tree.config.vocab_size, (5 + 2 * k,), generator=gen)
            if k == 1:  # shares its first 3 completion tokens with the previous sample: a branch inside a completion
                completion[:3] = samples[-1]["input_ids"][prompt_len : prompt_len + 3]
            mask = torch.cat([torch.zeros(prompt_len), torch.ones(len(completion))]).long()
            sample = {"input_ids": torch.cat([prompt, completion]), "completion_mask": mask, "group_id": group}
            sample.update(old_log_probs=torch.zeros(len(mask)), advantage=1.0)
            samples.append(sample)
            row.add(sample)
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(s["input_ids"]) for s in samples)  # prefixes are shared
    logits = tree(
        input_ids=packed["input_ids"][None],
        position_ids=packed["position_ids"][None],
        tree_kv_index=packed["tree_kv_index"],
        tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
        tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
        tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
    ).logits[0]
    index = packed["token_index"]
    got = torch.log_softmax(logits, -1)[index, packed["shift_labels"][index]]
    want = []
    for sample in samples:
        ids, positions = sample["input_ids"], sample["completion_mask"].nonzero()[:, 0]
        with torch.no_grad():
            want.append(torch.log_softmax(plain(input_ids=ids[None]).logits[0], -1)[positions - 1, ids[positions]])
    torch.testing.assert_close(got.detach(), torch.cat(want), atol=1e-5, rtol=0)
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in tree.parameters() if p.grad is not None)


@pytest.mark.integration
@pytest.mark.slow(seconds=51)
def test_gpu_sh_reduced_cpu_mode(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--reduced", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mode reduced-cpu" in out.stdout and "x the float32 steps/s" in out.stdout
    overlap = (tmp_path / "overlap.txt").read_text()  # gpu.sh's reduced mode is the CI run of overlap.py and
    assert "overlap efficiency (t_gen + t_train) / t_step" in overlap and "of ideal" in overlap  # trainer_precision.py
    assert '"t_gen_s"' in overlap and '"t_train_s"' in overlap and '"t_step_s"' in overlap
    precision = (tmp_path / "trainer_precision.txt").read_text()
    assert '"variant": "bf16"' in precision
    assert "float32+sorted+shared: " in precision  # share_prompt_prefix: 2 prompts x 4 completions


@pytest.mark.integration
@pytest.mark.slow(seconds=121)
def test_time_to_reward_reduced(tmp_path):
    """The add18m workload's plumbing at CI size (its config, a built model warm-started, every system on it)."""
    stdout = run("time_to_reward.py", "--workload", "add18m", "--reduced", "--out", str(tmp_path), timeout_s=500)
    assert "workload add18m: builtin:add" in stdout and "SFT steps" in stdout
    assert json.loads((tmp_path / "summary.json").read_text())["workload"] == "add18m"
    assert "warm start: " in stdout and "held-out reward of the warm start: " in stdout and "target " in stdout
    assert "ours_async: time to target median " in stdout and "trl_grpo: time to target median " in stdout
    assert "ratio our default / trl_grpo (median time to target): " in stdout and "checkpoint saving excluded" in stdout
    assert f"csv: {tmp_path / 'time_to_reward.csv'}" in stdout and f"png: {tmp_path / 'time_to_reward.png'}" in stdout
    rows = (tmp_path / "time_to_reward.csv").read_text().splitlines()
    assert rows[0] == "system,seed,wall_s,step,heldout_reward" and len(rows) > 3
    assert (tmp_path / "time_to_reward.png").stat().st_size > 0


@pytest.mark.integration
@pytest.mark.slow(seconds=180)
def test_distillation_reduced(tmp_path):
    """benchmarks/distillation.py --reduced: it builds a teacher, serves it once, runs GRPO alone and distillation +
    GRPO on the example, and prints and writes the comparison; the distilling run's teacher scored every group."""
    stdout = run("distillation.py", "--reduced", "--out", str(tmp_path), timeout_s=900)
    assert "teacher: tiny model trained 60 supervised steps" in stdout and "teacher server: http://" in stdout
    assert "grpo seed 0: 3 evaluations" in stdout and "topk_grpo seed 0: 3 evaluations" in stdout
    assert "drops {}" in stdout.split("topk_grpo seed 0:")[1].splitlines()[0]  # no teacher_error / teacher_timeout
    assert "system        | steps to target | seconds to target | final | gain over its start" in stdout
    assert "topk_grpo / the better of grpo and topk (steps to target): " in stdout
    rows = (tmp_path / "distillation.csv").read_text().splitlines()
    assert rows[0] == "system,seed,step,wall_s,heldout_reward" and len(rows) == 1 + 2 * 3
    assert (tmp_path / "distillation.png").stat().st_size > 0


@pytest.mark.integration
@pytest.mark.slow(seconds=63)
def test_memory_reduced():
    stdout = run("memory.py", "--steps", "15", "--warmup-sft-steps", "50")
    assert "MB per 1,000 steps" in stdout
    for role in ("trainer", "vllm", "workers"):
        assert f'"{role}": {{"mb_after_warmup": ' in stdout


@pytest.mark.integration
@pytest.mark.slow(seconds=210)
def test_chaos_reduced(tmp_path):
    """The chaos soak's CI form: six faults (vLLM, a reward worker and the trainer killed, the trainer stopped, MLflow
    down, the checkpoint disk full) in one run: each survived, no prompt, step metric or process lost."""
    import re

    stdout = run(
        "chaos.py", "--reduced", "--warmup-sft-steps", "50", "--no-baseline", "--out", str(tmp_path), timeout_s=1200
    )
    injected, survived = map(int, re.search(r"faults injected (\d+), survived (\d+)", stdout).groups())
    assert injected >= 5 and survived == injected, stdout[-4000:]  # disk_full needs bwrap's tmpfs
    assert "prompts lost 0 " in stdout and "steps without their metrics in MLflow: 0" in stdout, stdout[-4000:]
    assert "episode traces kept: " in stdout, stdout[-4000:]  # the demo config traces every 20 steps (issue 53)


@pytest.mark.integration
@pytest.mark.slow(seconds=90)
def test_tracing_reduced():
    stdout = run("tracing.py", "--reduced", timeout_s=900)
    assert "traces on : " in stdout and "traces off: " in stdout
    assert "48 traces kept" in stdout  # 6 steps x one group of 8 episodes, every one read back
    assert "ratio on/off: " in stdout


def _load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_robustness_reads_gain_and_collapse_from_the_run_store(tmp_path):
    """benchmarks/robustness.py judges a cell from the MLflow store the run wrote: held-out reward at the first and
    last step, the gain, and a collapse when the run ends below its start or its guard fired."""
    import mlflow

    robustness = _load_benchmark("robustness")

    def store(name: str, rewards: list[float], detected: list[float]) -> Path:
        db = tmp_path / name / "mlflow.db"
        db.parent.mkdir()
        client = mlflow.MlflowClient(f"sqlite:///{db}")
        run = client.create_run(client.create_experiment("async-grpo"))
        for step, value in enumerate(rewards):
            client.log_metric(run.info.run_id, "eval/reward", value, step=step * 10)
            client.log_metric(run.info.run_id, "eval/reward_se", 0.01, step=step * 10)
        for step, value in enumerate(detected):
            client.log_metric(run.info.run_id, "collapse/detected", value, step=step)
        return db

    learned = robustness.read_cell(robustness.Cell("x", 0, "busy", exit_code=0), store("a", [1.3, 1.7, 1.6], [0]))
    assert (learned.start, learned.final, learned.best, learned.steps) == (1.3, 1.6, 1.7, 20)
    assert learned.gain == pytest.approx(0.3) and learned.ok and not learned.collapsed
    fell = robustness.read_cell(robustness.Cell("x", 1, "busy", exit_code=0), store("b", [1.33, 1.67, 0.28], [0]))
    assert fell.collapsed and not fell.collapse_detected and not fell.ok  # issue 48's run: below its start
    flagged = robustness.read_cell(robustness.Cell("x", 2, "busy", exit_code=0), store("c", [1.3, 1.4], [0, 1, 0]))
    assert flagged.collapsed and flagged.collapse_detected and flagged.gain > 0  # the guard fired on the way
    failed = robustness.read_cell(robustness.Cell("x", 3, "quiet", exit_code=1), tmp_path / "none" / "mlflow.db")
    assert not failed.ok and failed.steps == 0
    assert "| x | 1 | busy | 1.330 | 0.280 +- 0.010 | -1.050 | 1.670 | yes |" in robustness.markdown([fell])
    args = robustness.parse_args(["--examples", "tiny_cpu", "--seeds", "4", "--conditions", "busy"])
    assert robustness.matrix(args) == [("tiny_cpu", 4, "busy")]
    assert (
        len(robustness.matrix(robustness.parse_args([]))) == 16
    )  # issue 48's matrix, and the agent example (issue 51)
    narrowed = robustness.matrix(robustness.parse_args(["--examples", "tiny_cpu", "lora_cpu"]))
    assert len(narrowed) == 7 and ("lora_cpu", 0, "busy") in narrowed  # each keeps its own seeds and conditions


def test_robustness_builds_an_examples_missing_prerequisite_once(tmp_path, monkeypatch):
    """The reward-model example reads a model the repo does not ship: robustness.py builds it before the example's
    first cell, skips the build when the path is there, and stops with the build's log when the build fails."""
    robustness = _load_benchmark("robustness")
    assert "reward_model_cpu" in robustness.PREREQUISITES and robustness.PREREQUISITES["reward_model_cpu"][1].is_file()
    builds = tmp_path / "builds.txt"
    good = tmp_path / "good.py"
    good.write_text(f"import pathlib, sys\npathlib.Path(sys.argv[1]).mkdir()\nopen({str(builds)!r}, 'a').write('x')\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('no room left on the device')\nsys.exit(3)\n")
    monkeypatch.setattr(robustness, "PREREQUISITES", {"made": (str(tmp_path / "model"), good),
                                                      "broken": (str(tmp_path / "other"), bad)})  # fmt: skip
    robustness.prepare("made", timeout_s=60)
    robustness.prepare("made", timeout_s=60)
    robustness.prepare("tiny_cpu", timeout_s=60)  # nothing to build
    assert (tmp_path / "model").is_dir() and builds.read_text() == "x"
    with pytest.raises(RuntimeError, match="exit code 3(.|\n)*no room left"):
        robustness.prepare("broken", timeout_s=60)


def test_time_to_reward_scores_the_grid_and_the_runs_end():
    """The checkpoints scored: the first at or after each grid mark up to the budget; a run whose last checkpoint
    (written at the stop signal) stamped just under the budget has that one scored as its end."""
    ttr = _load_benchmark("time_to_reward")

    def ckpts(*times: float):
        return [ttr.Checkpoint(step=i + 1, wall_s=t, path=f"c{i + 1}") for i, t in enumerate(times)]

    grid = ttr.on_grid(ckpts(20, 59, 61, 90, 119, 121, 130), every_s=60, budget_s=120)
    assert [c.wall_s for c in grid] == [61, 121]
    ended = ttr.on_grid(ckpts(30, 61, 100, 117.6), every_s=60, budget_s=120)
    assert [c.wall_s for c in ended] == [61, 117.6]
    assert ttr.on_grid([], every_s=60, budget_s=120) == []
    args = ttr.parse_args(["--workload", "add18m", "--set", "learning_rate=1e-4"])
    assert (args.budget_s, args.checkpoint_every_s, args.ours_save_steps) == (900.0, 60.0, 5)
    assert ttr.trl_spec("trl_grpo", 0, "m", args, ROOT)["learning_rate"] == 1e-4  # --set reaches TRL too


@pytest.mark.integration
def test_time_to_reward_stopped_by_sigterm_ends_its_runs(tmp_path):
    """A SIGTERM to the benchmark (a job's stop, `kill PID`) ends the run it is timing and every process that run
    started, as Ctrl-C does: nothing is left training on the machine."""
    import signal

    import psutil

    harness = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "time_to_reward.py"), "--systems", "trl_grpo", "--seeds", "0",
         "--budget-s", "300", "--warmup-sft-steps", "5", "--out", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        started: list[psutil.Process] = []
        deadline = time.monotonic() + 300
        while not started and time.monotonic() < deadline and harness.poll() is None:
            time.sleep(0.5)
            kids = psutil.Process(harness.pid).children(recursive=True)
            started = [p for p in kids if "--child-trl" in " ".join(p.cmdline())]
        assert started, "the benchmark never started its TRL run"
        time.sleep(2.0)
        assert all(p.is_running() for p in started)  # its budget is 300 s: the run is loading or training
        harness.send_signal(signal.SIGTERM)
        assert harness.wait(timeout=90) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], f"left running: {[p.pid for p in alive]}"
    finally:
        if harness.poll() is None:
            harness.kill()
