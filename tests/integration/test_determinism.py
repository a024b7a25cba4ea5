"""`full_determinism` against a real vLLM CPU server (issue 28, item 1): the schedule, not timing, decides which
prompt each group is, the policy version that samples it, its sampling seed and its place in the step batches.

Two runs with the same seed, one with a single group in flight and one with eight (max_staleness 2, so up to three
batches are generated ahead), log the same value for every per-step metric that is not a clock reading: losses, IS
ratios, rewards, advantages, staleness, held-out reward. Without full_determinism the same pair differs (measured
in docs/reproducibility.md), which is what makes this test able to fail. A third run, stopped after 4 steps with a
checkpoint and resumed from it (item 2), logs the same values as the uninterrupted one at every step.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local

pytestmark = pytest.mark.integration

BASE = {
    "dataset": "builtin:reverse", "reward_funcs": ["builtin:reverse_exact_match", "builtin:reverse_format"],
    "reward_weights": [1.0, 0.5], "reward_num_workers": 1, "num_generations": 8, "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1, "max_completion_length": 12, "torch_num_threads": 1, "learning_rate": 3e-4,
    "loss_type": "dapo", "epsilon_high": 0.28, "vllm_importance_sampling_mode": "token_truncate",
    "max_staleness": 2, "save_model": False, "eval_num_prompts": 8, "num_generations_eval": 2,
    "eval_strategy": "steps", "eval_steps": 5, "warmup_sft_steps": 60, "warmup_sft_learning_rate": 3e-3,
    "max_steps": 10, "seed": 11, "full_determinism": True, "vllm_dtype": "float32",
}  # fmt: skip
CUT = 4  # the interrupted run's checkpoint step
# Clock readings and process sizes, which no schedule fixes.
CLOCKS = ("seconds", "tokens_per_s", "memory/", "idle", "wall_s", "steps_per_s", "queue/depth", "generating_s",
          "paused_for_training_s", "weight_sync_s_mean", "time/", "busy_fraction")  # fmt: skip


def logged_metrics(db: Path) -> dict[tuple[str, int], float]:
    """Every (metric, step) -> value of the one run in the sqlite store `db`, clock readings left out."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("select key, step, value from metrics").fetchall()
    return {(key, step): value for key, step, value in rows if not any(c in key for c in CLOCKS)}


@pytest.fixture
def restores_torch_determinism():
    """full_determinism switches torch's deterministic algorithms on for the process; later tests get it back."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_same_seed_runs_log_the_same_metrics_at_one_and_eight_groups_in_flight_and_across_a_resume(
    vllm_server, tiny_model_dir, tmp_path, restores_torch_determinism
):
    common = {**BASE, "model_name_or_path": str(tiny_model_dir), "vllm_url": vllm_server.url}
    runs = {}
    for depth in (8, 1):
        out = tmp_path / f"depth{depth}"
        # at eight in flight, a checkpoint every 3 steps too (save_steps): it waits for the groups still being scored
        # and changes nothing the run logs (issue 48: it failed at the first checkpoint)
        periodic = {"save_steps": 3} if depth == 8 else {}
        config = GRPOConfig(**common, max_inflight_groups=depth, output_dir=str(out), **periodic)
        summary = run_local(config, progress=False)
        assert summary.steps == BASE["max_steps"] and summary.prompts_lost == 0
        runs[depth] = logged_metrics(out / "mlflow.db")
        if periodic:
            assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    # at eight in flight again: 4 steps and a checkpoint (at a push, the schedule's groups sampled ahead in it), then
    # the same command resumed from it; the run continues in the same MLflow run
    out = tmp_path / "resumed"
    cut = GRPOConfig(**common, max_inflight_groups=8, output_dir=str(out), max_rollouts=CUT, save_steps=CUT)
    assert run_local(cut, progress=False).steps == CUT
    whole = GRPOConfig(**common, max_inflight_groups=8, output_dir=str(out), resume_from_checkpoint=True)
    summary = run_local(whole, progress=False)
    assert summary.steps == BASE["max_steps"] and summary.prompts_lost == 0
    resumed = logged_metrics(out / "mlflow.db")
    deep, shallow = runs[8], runs[1]
    assert ("loss", BASE["max_steps"]) in deep and ("eval/reward", BASE["max_steps"]) in deep
    assert max(deep[("staleness/max", s)] for s in range(1, BASE["max_steps"] + 1)) >= 1  # it ran ahead
    assert any(deep[("loss", s)] != 0 for s in range(1, BASE["max_steps"] + 1))  # there was something to learn
    differ = {k: (deep.get(k), shallow.get(k)) for k in deep.keys() | shallow.keys() if deep.get(k) != shallow.get(k)}
    assert not differ, sorted(differ.items())[:20]
    # the cut run's own end (its final evaluation and summary at step CUT, checkpoint timings) is extra
    differ = {
        k: (deep.get(k), resumed.get(k)) for k in deep if not k[0].startswith("summary/") and deep[k] != resumed.get(k)
    }
    assert not differ, sorted(differ.items())[:20]
