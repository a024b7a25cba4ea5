"""Regression (issue 14): seeded evaluation requests crashed the vLLM CPU engine when chunked prefill split a seeded
prompt (`RuntimeError: CPU Generator does not use offset` in `gpu_model_runner._bookkeeping_sync`: the CPU
`torch.Generator` has no offset to rewind for a discarded partial-prefill sample). Seen with a conversational dataset
of ~35-token prompts at the default evaluation settings (128 prompts x 4 samples, per-prompt seeds, 2,048 batched
tokens per engine step). `build_server_command` now never splits a prefill on the CPU build.

Runs the product's own evaluation (`evaluate_reward` with the run's single-turn rollout and a real reward pool)
against the session's real vLLM server, which was started with the product's flags."""

from __future__ import annotations

import json

import psutil
import pytest
import requests
from transformers import AutoTokenizer

from async_grpo.config import GRPOConfig
from async_grpo.data import load_prompt_items
from async_grpo.evaluation import evaluate_reward
from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.inference.server import is_cpu_build
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.rewards.remote import make_reward_pool

pytestmark = pytest.mark.integration

EVAL_NUM_PROMPTS, NUM_GENERATIONS_EVAL = 128, 4  # the settings of the run that crashed


def test_default_eval_of_35_token_conversational_prompts_keeps_the_cpu_engine_alive(
    vllm_server, tiny_model_dir, tmp_path
):
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i in range(EVAL_NUM_PROMPTS):
            words = f"please reverse the word number {i:03d}: abcdefg"
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}], "answer": "gfedcba"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    items, too_long = load_prompt_items(tokenizer, f"{data}", "eval", seed=0, max_prompt_length=256)
    assert too_long == 0 and len(items) == EVAL_NUM_PROMPTS
    lengths = [len(item.prompt_ids) for item in items]
    assert min(lengths) >= 30 and sum(lengths) > 2048  # one engine step cannot hold every prefill
    config = GRPOConfig(reward_funcs=["builtin:reverse_format"], reward_num_workers=1)
    scorer = make_reward_pool(config)
    try:
        metrics, rows = evaluate_reward(
            SingleTurnRollout(scorer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)),
            lambda: AsyncVLLMClient(vllm_server.url, str(tiny_model_dir), timeout_s=120.0), items,
            SamplingSettings(num_generations=NUM_GENERATIONS_EVAL, max_completion_length=8, temperature=1.0),
            reward_names=scorer.names, reward_weights=scorer.weights, seed=0,
        )  # fmt: skip
    finally:
        scorer.close()
    assert metrics["eval/dropped_groups"] == 0, metrics
    assert len(rows) == EVAL_NUM_PROMPTS * NUM_GENERATIONS_EVAL
    assert vllm_server.process.poll() is None and requests.get(f"{vllm_server.url}/health", timeout=10).ok
    if is_cpu_build():
        assert "--no-enable-chunked-prefill" in vllm_server.command
        # the in-process executor: no separate worker process whose answers the engine core would busy-poll
        names = [p.name() for p in psutil.Process(vllm_server.process.pid).children(recursive=True)]
        assert any("EngineCore" in n for n in names) and not any("Worker" in n for n in names), names
