"""Feature combinations that touch the schedule or the run's state, each cut by a checkpoint and resumed (issue 48,
item 4), against the session's vLLM server.

Each combination is proven the same way: a run stopped after `CUT` steps with a checkpoint there (`max_rollouts`,
`save_steps`), then the same config with `resume_from_checkpoint=true`, which must go on from that checkpoint to
`STEPS` in the same MLflow run, with every step's `loss` logged once, no prompt lost, nothing left running, and the
feature's own counter or log line there (a combination whose feature silently did nothing would pass otherwise). A combination
that cannot work must be refused when the config is built, naming its fields, never fail mid-run:
`test_combinations_that_cannot_work_are_refused_before_anything_starts` lists them.

`full_determinism` x `save_steps` x async depth (1 and 8) x resume is `tests/integration/test_determinism.py`, which
also asserts that the resumed run logs what the uninterrupted one does.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from pydantic import ValidationError

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local
from async_grpo.runner.checkpoints import complete_checkpoints, read_meta

CUT, STEPS = 2, 4
BASE = {
    "dataset": "builtin:reverse", "reward_funcs": ["builtin:reverse_exact_match", "builtin:reverse_format"],
    "reward_weights": [1.0, 0.5], "reward_num_workers": 1, "num_generations": 4, "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1, "max_completion_length": 8, "torch_num_threads": 1, "learning_rate": 1e-3,
    "save_model": False, "eval_strategy": "no", "warmup_sft_steps": 0, "max_staleness": 2, "seed": 3,
    "vllm_dtype": "float32",
}  # fmt: skip
TOOLS = {"dataset": "builtin:calc", "tools": ["builtin:calculator"], "max_tool_calling_iterations": 2,
         "reward_funcs": ["builtin:calc_exact_match", "builtin:calc_format"], "reward_weights": [1.0, 0.5],
         "max_completion_length": 16, "tool_num_workers": 1}  # fmt: skip
# name -> (the combination's settings, what shows that its feature ran: a logged metric or a line of the run's log)
COMBINATIONS = {
    "replay-buffer": ({"replay_buffer_size": 8, "max_inflight_groups": 8}, "replayed_groups"),
    "deferred-reroll": ({"reroll_start_fraction": 0.0, "max_inflight_groups": 8}, "rerolled_groups"),
    "dynamic-sampling": ({"dynamic_sampling": True, "max_inflight_groups": 8}, "dynamic_sampling/gen_batches"),
    "lora-overlapped-push": (
        {"use_peft": True, "lora_r": 4, "weight_sync_overlap": True, "max_inflight_groups": 8},
        "weight_sync_overlap: each push runs beside the next optimizer step",
    ),
    "tools-one-in-flight": ({**TOOLS, "max_inflight_groups": 1}, "tools/call_frequency"),
    "tools-eight-in-flight": ({**TOOLS, "max_inflight_groups": 8}, "tools/call_frequency"),
}


def loss_steps(db: Path) -> list[int]:
    """The steps of every `loss` row in the run folder's sqlite store, in order, repeats kept."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return [s for (s,) in con.execute("select step from metrics where key = 'loss' order by step")]


def logged_keys(db: Path) -> set[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return {k for (k,) in con.execute("select distinct key from metrics")}


@pytest.mark.integration
@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_a_combination_is_cut_by_a_checkpoint_and_resumed_to_the_end(
    name, vllm_server, tiny_model_dir, tmp_path, child_pids, caplog
):
    settings, evidence = COMBINATIONS[name]
    caplog.set_level(logging.INFO, logger="async_grpo")
    common = {**BASE, **settings, "model_name_or_path": str(tiny_model_dir), "vllm_url": vllm_server.url}
    out = tmp_path / "run"
    before = child_pids()
    first = run_local(
        GRPOConfig(**common, output_dir=str(out), max_steps=STEPS, max_rollouts=CUT, save_steps=CUT), progress=False
    )
    assert first.steps == CUT
    ((step, checkpoint),) = complete_checkpoints(out)
    assert step == CUT and read_meta(checkpoint)["mlflow_run_id"] == first.run_id
    resumed = run_local(
        GRPOConfig(**common, output_dir=str(out), max_steps=STEPS, save_steps=CUT, resume_from_checkpoint=True),
        progress=False,
    )
    assert resumed.run_id == first.run_id and resumed.steps == STEPS
    assert resumed.prompts_lost == 0, resumed.dropped_groups
    assert loss_steps(out / "mlflow.db") == list(range(1, STEPS + 1))  # from the checkpoint on, each step once
    assert evidence in logged_keys(out / "mlflow.db") or evidence in caplog.text, name
    assert [s for s, _ in complete_checkpoints(out)][-1] == STEPS
    assert not child_pids() - before, "processes left behind by the runs"


# (settings, words the refusal must contain): each combination cannot work, and says so when the config is built
REFUSED = {
    "full_determinism with dynamic_sampling": (
        {"full_determinism": True, "dynamic_sampling": True},
        ("full_determinism", "dynamic_sampling"),
    ),
    "full_determinism with deferred re-roll": (
        {"full_determinism": True, "reroll_start_fraction": 0.5},
        ("full_determinism", "reroll_start_fraction"),
    ),
    "full_determinism with rollback": (
        {"full_determinism": True, "on_collapse": "rollback", "save_steps": 5},
        ("full_determinism", "rollback"),
    ),
    "replay buffer with dynamic_sampling": (
        {"replay_buffer_size": 8, "dynamic_sampling": True},
        ("replay_buffer_size", "dynamic_sampling"),
    ),
    "rollback without checkpoints": ({"on_collapse": "rollback"}, ("rollback", "save_steps")),
    "adapter-only sync without LoRA": ({"vllm_lora_sync": True}, ("vllm_lora_sync", "use_peft")),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_combinations_that_cannot_work_are_refused_before_anything_starts(name, tmp_path):
    settings, words = REFUSED[name]
    with pytest.raises(ValidationError) as refused:
        GRPOConfig(**BASE, **settings, output_dir=str(tmp_path / "run"))
    message = str(refused.value)
    assert all(word in message for word in words), message
