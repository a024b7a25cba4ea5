"""The TRL user's example (examples/trl_qwen_gsm8k.yaml) with local paths instead of hub ids trains end to end on
the tiny model: GSM8K-layout rows become conversational prompts with the system prompt, TRL's own reward function
and the builtin math rewards score every conversational group (none dropped), eval/reward is logged every
eval_steps steps, and the final model is logged with MLflow's transformers flavour."""

from __future__ import annotations

from pathlib import Path

import datasets
import mlflow
import pytest

from async_grpo.config import load_config
from async_grpo.launch.local import run_local
from async_grpo.tracking import MODEL_URI_TAG

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_qwen_gsm8k.yaml"


def gsm8k_file(path: Path, n: int, offset: int = 0) -> Path:
    rows = [
        {"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
        for i in range(offset, offset + n)
    ]
    datasets.Dataset.from_list(rows).to_json(path)
    return path


def test_the_trl_example_trains_on_the_tiny_model_with_local_paths(child_pids, vllm_server, tiny_model_dir, tmp_path):
    pytest.importorskip("math_verify")
    overrides = [
        f"model_name_or_path={tiny_model_dir}", f"dataset_name={gsm8k_file(tmp_path / 'train.jsonl', 32)}",
        f"eval_dataset={gsm8k_file(tmp_path / 'test.jsonl', 8, offset=100)}", f"output_dir={tmp_path / 'run'}",
        f"vllm_server_base_url={vllm_server.url}", "vllm_max_model_length=512", "max_prompt_length=400",
        "reward_funcs=[builtin:math_accuracy, builtin:think_answer_format, trl.rewards:think_format_reward]",
        "reward_weights=[1.0, 0.1, 0.1]", "bf16=false", "vllm_dtype=float32", "max_steps=4", "eval_steps=2",
        "num_generations=4", "per_device_train_batch_size=8", "gradient_accumulation_steps=1",
        "max_completion_length=16", "eval_num_prompts=4", "num_generations_eval=2", "torch_num_threads=1",
        "log_completions_steps=2", "mlflow_tracking_uri=null",
    ]  # fmt: skip
    config = load_config(EXAMPLE, overrides)
    assert config.compute.gradient_checkpointing and config.optim.lr_scheduler_type == "cosine"
    before = child_pids()
    summary = run_local(config, progress=False)

    assert summary.steps == 4
    scoring_drops = {k: v for k, v in summary.dropped_groups.items() if k not in ("shutdown", "unconsumed_at_end")}
    assert not scoring_drops, summary.dropped_groups  # every conversational group was scored
    assert not (child_pids() - before)
    client = mlflow.MlflowClient(summary.tracking_uri)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED" and run.data.params["lr_scheduler_type"] == "cosine"
    assert sorted(m.step for m in client.get_metric_history(summary.run_id, "eval/reward")) == [0, 2, 4]
    for name in (
        "rewards/math_accuracy/mean",
        "rewards/think_format_reward/mean",
        "num_tokens",
        "num_tokens/step",
        "learning_rate",
    ):
        assert name in run.data.metrics, name
    tokens = [m.value for m in client.get_metric_history(summary.run_id, "num_tokens")]
    assert tokens == sorted(tokens) and tokens[0] > 0  # TRL's num_tokens: cumulative prompt + completion tokens
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name.endswith("train.jsonl")
    model_uri = run.data.tags[MODEL_URI_TAG]
    assert mlflow.models.get_model_info(model_uri).flavors["transformers"]["task"] == "text-generation"
