"""Held-out reward: greedy completions from vLLM, scored by the run's reward functions.

Greedy decoding (temperature 0, one sample per prompt) makes the number a property of the weights,
not of sampling noise, so before/after comparisons are meaningful on a few dozen prompts.
"""

from __future__ import annotations

import asyncio
import math

from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.orchestrator.orchestrator import PromptItem
from async_grpo.rewards.pool import RewardPool

EVAL_CONCURRENCY = 32


async def _generate_all(client: AsyncVLLMClient, items: list[PromptItem], max_tokens: int) -> list:
    sem = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def one(item: PromptItem):
        async with sem:
            return (await client.generate(item.prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0))[0]

    try:
        return await asyncio.gather(*(one(it) for it in items))
    finally:
        await client.aclose()


def evaluate_reward(
    client: AsyncVLLMClient,
    items: list[PromptItem],
    decode,
    reward_pool: RewardPool,
    *,
    max_tokens: int,
    timeout_s: float = 600.0,
) -> tuple[dict[str, float], list[dict]]:
    """Score greedy completions of `items`.

    Returns:
        (metrics, rows): metrics `eval/reward` (weighted sum, mean over prompts) and
        `eval/rewards/<func>/mean`; rows are (prompt, completion, reward) dicts for a sample table.

    Raises:
        RewardError: the reward functions failed on the eval set.
        httpx.HTTPError / GenerationError: vLLM failed.
    """
    completions = asyncio.run(_generate_all(client, items, max_tokens))
    texts = [decode(c.token_ids) for c in completions]
    columns: dict[str, list] = {}
    for it in items:
        for k, v in it.columns.items():
            columns.setdefault(k, []).append(v)
    per_func = reward_pool.submit([it.prompt for it in items], texts, [c.token_ids for c in completions],
                                  columns).result(timeout=timeout_s)  # (N, F)
    weights = reward_pool.weights
    totals = [sum(w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r)) for row in per_func]
    metrics = {"eval/reward": sum(totals) / len(totals)}
    for j, name in enumerate(reward_pool.names):
        vals = [row[j] for row in per_func if not math.isnan(row[j])]
        if vals:
            metrics[f"eval/rewards/{name}/mean"] = sum(vals) / len(vals)
    rows = [{"prompt": str(it.prompt), "completion": t, "reward": r} for it, t, r in zip(items, texts, totals, strict=True)]
    return metrics, rows
