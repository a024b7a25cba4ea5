"""Held-out reward: completions of held-out prompts from vLLM, scored by the run's reward functions.

By default it samples like training does (the training temperature, `num_generations_eval` samples
per prompt), because that is the policy GRPO optimizes; `temperature=0` gives greedy accuracy
instead. Each prompt gets a fixed per-request seed, so a before/after comparison reuses the same
random streams and differs only by the weights.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.orchestrator.orchestrator import PromptItem
from async_grpo.rewards.pool import RewardPool

if TYPE_CHECKING:
    from async_grpo.rewards.remote import RemoteRewardPool

EVAL_CONCURRENCY = 32


async def _generate_all(client: AsyncVLLMClient, items: list[PromptItem], *, n: int, max_tokens: int,
                         temperature: float, seed: int) -> list[list]:
    sem = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def one(i: int, item: PromptItem):
        async with sem:
            return await client.generate(item.prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature,
                                         seed=seed + i)

    try:
        return await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    finally:
        await client.aclose()


def evaluate_reward(
    client: AsyncVLLMClient,
    items: list[PromptItem],
    decode,
    reward_pool: RewardPool | RemoteRewardPool,
    *,
    max_tokens: int,
    num_generations: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> tuple[dict[str, float], list[dict]]:
    """Score `num_generations` completions of each of `items` (N prompts).

    Returns:
        (metrics, rows): metrics `eval/reward` (weighted reward sum, mean over all N x num_generations
        completions) and `eval/rewards/<func>/mean`; rows are (prompt, completion, reward) dicts.

    Raises:
        RewardError: the reward functions failed on the eval set.
        httpx.HTTPError / GenerationError: vLLM failed.
    """
    groups = asyncio.run(_generate_all(client, items, n=num_generations, max_tokens=max_tokens,
                                       temperature=temperature, seed=seed))
    flat = [(it, c) for it, group in zip(items, groups, strict=True) for c in group]  # N x num_generations
    texts = [decode(c.token_ids) for _, c in flat]
    columns: dict[str, list] = {}
    for it, _ in flat:
        for k, v in it.columns.items():
            columns.setdefault(k, []).append(v)
    per_func = reward_pool.submit([it.prompt for it, _ in flat], texts, [c.token_ids for _, c in flat],
                                  columns).result(timeout=timeout_s)  # (N x num_generations, F)
    weights = reward_pool.weights
    totals = [sum(w * r for w, r in zip(weights, row, strict=True) if not math.isnan(r)) for row in per_func]
    metrics = {"eval/reward": sum(totals) / len(totals)}
    for j, name in enumerate(reward_pool.names):
        vals = [row[j] for row in per_func if not math.isnan(row[j])]
        if vals:
            metrics[f"eval/rewards/{name}/mean"] = sum(vals) / len(vals)
    rows = [{"prompt": str(it.prompt), "completion": t, "reward": r}
            for (it, _), t, r in zip(flat, texts, totals, strict=True)]
    return metrics, rows
