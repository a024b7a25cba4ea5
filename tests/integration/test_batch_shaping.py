"""Batch shaping end to end: real vLLM, reward workers, trainer and MLflow store; each counter must move.

The prompts are reverse-task prompts in a jsonl file with a `gate` column: the reward is the builtin
`reverse_format` shaped score, except that every completion of a "zero"-gated prompt scores 0.0. So
"zero" prompts always give all-zero, zero-std groups, whatever the model generates, and "open" prompts
give varying rewards (random completions of an untrained model practically never tie); the dataset is half
and half. With one generation
request in flight, launches are scored in order, which makes each counter's movement certain:

- re-roll + zero-advantage skipping: some of the first 5 launches is a "zero" prompt (an epoch has only 4
  "open" ones); its group lands in a step's batch (one micro-batch, skipped) and the next launch is its
  re-roll, which lands in a batch by step 3.
- replay: over 6 steps (1.5 epochs) some batch after the first one holding an "open" group holds a "zero"
  group, which is swapped for a buffered one (the only launch orders without such a batch are ZZZZOOOO
  followed by OOOO, and the seed fixes the order).
- dynamic sampling: the 4 "zero" groups of the first epoch are all scored and dropped before step 3's
  batch is full, so some step needs more than one batch's worth of groups.
"""

from __future__ import annotations

import json

import mlflow
import pytest

from async_grpo.config import GRPOConfig
from async_grpo.launch.local import run_local

pytestmark = pytest.mark.integration

WORDS = ["abc", "hello", "world", "tiny", "model", "gate", "queue", "train"]
REWARDS_PY = '''
from async_grpo.tasks.reverse import reverse_format


def gated_reverse_format(prompts, completions, completion_ids=None, *, answer, gate, **kwargs):
    """reverse_format, but 0.0 for every completion of a prompt whose `gate` column is "zero"."""
    if gate[0] == "zero":
        return [0.0 for _ in completions]
    return reverse_format(prompts, completions, completion_ids, answer=answer)
'''


@pytest.fixture(scope="module")
def shaping_inputs(tmp_path_factory) -> dict:
    """Dataset, reward function file and one MLflow store shared by the runs of this module."""
    root = tmp_path_factory.mktemp("shaping")
    data = root / "gated.jsonl"
    rows = [
        {"prompt": f"reverse: {w}\n", "answer": w[::-1], "gate": "zero" if i % 2 else "open"}
        for i, w in enumerate(WORDS)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = root / "gated_rewards.py"
    rewards.write_text(REWARDS_PY)
    return {
        "root": root,
        "dataset": str(data),
        "reward": f"{rewards}:gated_reverse_format",
        "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
    }


def run(vllm_server, tiny_model_dir, inputs: dict, name: str, **overrides):
    config = GRPOConfig(**{
        "model_name_or_path": str(tiny_model_dir), "vllm_url": vllm_server.url, "dataset": inputs["dataset"],
        "reward_funcs": [inputs["reward"]], "reward_num_workers": 1, "output_dir": str(inputs["root"] / name),
        "mlflow_tracking_uri": inputs["tracking_uri"], "run_name": name, "num_generations": 4,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_completion_length": 8,
        "max_inflight_groups": 1, "torch_num_threads": 1, "learning_rate": 1e-4, "save_model": False,
        "log_completions_steps": 1000, "max_steps": 3, **overrides,
    })  # fmt: skip
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.tracking.MlflowClient()
    assert client.get_run(summary.run_id).info.status == "FINISHED"

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(summary.run_id, key), key=lambda m: m.step)]

    return summary, history


def test_reroll_and_zero_advantage_skipping_counters_move(vllm_server, tiny_model_dir, shaping_inputs):
    _, history = run(
        vllm_server,
        tiny_model_dir,
        shaping_inputs,
        "reroll_skip",
        reroll_start_fraction=0.0,
        reroll_max_groups=1,
        skip_zero_advantage_batches=True,
    )
    # dapo (the default) skips single completions (row skipping); whole micro-batches are never all zero here
    rerolled, skipped = history("rerolled_groups"), history("skipped_zero_adv_completions")
    assert len(rerolled) == 3 and len(skipped) == 3
    assert rerolled == sorted(rerolled) and rerolled[-1] >= 1, rerolled  # cumulative, and it moved
    assert skipped == sorted(skipped) and skipped[-1] >= 4, skipped  # at least one flat group of 4
    assert skipped[-1] >= rerolled[-1]  # a re-rolled "zero" prompt scores 0 again: its completions are skipped too
    assert history("skipped_zero_adv_microbatches") == [0.0, 0.0, 0.0]
    assert max(history("frac_reward_zero_std")) > 0


def test_replay_counter_moves(vllm_server, tiny_model_dir, shaping_inputs):
    # max_staleness=0: every fresh group is generated by the policy that trains on it, so a group older than
    # that can only be a replayed one, which the rollout queue must let through
    summary, history = run(
        vllm_server, tiny_model_dir, shaping_inputs, "replay", replay_buffer_size=4, max_steps=6, max_staleness=0
    )
    replayed = history("replayed_groups")
    assert len(replayed) == 6
    assert replayed == sorted(replayed) and replayed[-1] >= 1, replayed
    assert 1 <= history("replay_buffer/size")[-1] <= 4
    # staleness describes the freshly generated groups only (at most max_staleness=0); the replayed ones, from
    # earlier policy versions, were trained on (replayed_groups) and not dropped as stale
    assert max(history("staleness/max")) == 0
    assert "stale" not in summary.dropped_groups


def test_dynamic_sampling_counter_moves(vllm_server, tiny_model_dir, shaping_inputs):
    summary, history = run(vllm_server, tiny_model_dir, shaping_inputs, "dynamic", dynamic_sampling=True)
    gen_batches = history("dynamic_sampling/gen_batches")
    assert len(gen_batches) == 3 and min(gen_batches) >= 1
    assert max(gen_batches) >= 2, gen_batches  # some step needed more than one batch's worth of groups
    assert history("frac_reward_zero_std") == [0.0] * 3  # no zero-std group reached the trainer
    assert history("dropped_groups/zero_std")[-1] >= 4 and summary.dropped_groups["zero_std"] >= 4
