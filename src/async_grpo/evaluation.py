"""Held-out reward: the run's own `Rollout` on held-out prompts, group by group.

Evaluation produces groups exactly as training does (the same rollout, the same reward functions, each group
scored on its own under `reward_timeout_s`), only with its own sampling settings: by default the training
temperature and `num_generations_eval` samples per prompt, because that is the policy GRPO optimizes;
`temperature=0` gives greedy accuracy instead. Each prompt gets a fixed per-request seed, so a before/after
comparison reuses the same random streams and differs only by the weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from async_grpo.data import PromptItem
from async_grpo.inference.client import GenerationClient
from async_grpo.orchestrator.batching import agent_metrics, env_metrics, reward_correlations, tool_metrics
from async_grpo.orchestrator.rollout import Rollout, SamplingSettings, aclose_rollout, completion_display
from async_grpo.transports.messages import RolloutGroup

logger = logging.getLogger(__name__)

EVAL_CONCURRENCY = 32  # groups in flight at once


class EvaluationError(RuntimeError):
    """No held-out group could be generated and scored (the first failure is chained)."""


async def _run_groups(
    rollout: Rollout,
    client_factory: Callable[[], GenerationClient],
    items: Sequence[PromptItem],
    sampling: SamplingSettings,
    seed: int,
    version: int,
) -> list[RolloutGroup | BaseException]:
    client = client_factory()
    sem = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def one(i: int, item: PromptItem) -> RolloutGroup:
        async with sem:
            return await rollout(client, item, sampling, version=lambda: version, seed=seed + i)

    try:
        return await asyncio.gather(*(one(i, it) for i, it in enumerate(items)), return_exceptions=True)
    finally:
        await client.aclose()
        await aclose_rollout(rollout)  # what the rollout built on this loop (an agent rollout's endpoint)


@dataclass
class HeldOutScores:
    """One held-out evaluation.

    Attributes:
        metrics: `eval/reward` (the weighted reward nansum, mean over every scored completion), `eval/reward_se`
            (its noise: the standard error of the mean over the scored prompts' group means, with two or more),
            `eval/rewards/<func>/mean`, `eval/rewards/<a>/correlation/<b>` (`orchestrator.batching.reward_correlations`),
            `eval/dropped_groups` (groups that failed, counted and logged) and, for a multi-turn rollout, `eval/tools/*` (`orchestrator.batching.tool_metrics`) or `eval/env/*` (`env_metrics`), and for an agent rollout `eval/agent/*` (`agent_metrics`); an agent episode of several rows counts once.
        rows: (prompt, completion, reward) dicts, one per scored completion.
        per_prompt: (N,) mean weighted reward of each prompt's group, in the order of the items; NaN where the
            group failed. Two models scored with the same items, sampling and seed pair up prompt by prompt
            (`promotion.paired_bootstrap`).
    """

    metrics: dict[str, float]
    rows: list[dict]
    per_prompt: list[float]


def score_held_out(
    rollout: Rollout,
    client_factory: Callable[[], GenerationClient],
    items: Sequence[PromptItem],
    sampling: SamplingSettings,
    *,
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
    seed: int = 0,
    version: int = 0,
) -> HeldOutScores:
    """Score `sampling.num_generations` completions of each of `items` (N prompts), one group per prompt.

    Args:
        rollout: the run's rollout (the same one the orchestrator trains on).
        client_factory: builds an inference client inside this call's event loop.
        items: held-out prompts.
        sampling: evaluation sampling settings (G = num_generations_eval, the eval temperature).
        reward_names, reward_weights: (F,) the reward functions' names and weights.
        seed: prompt i is sampled with seed + i.
        version: the policy version being evaluated (stamped on the groups).

    Returns:
        HeldOutScores.

    Raises:
        EvaluationError: every group failed (the first failure is chained).
    """
    results = asyncio.run(_run_groups(rollout, client_factory, items, sampling, seed, version))
    groups = [r for r in results if isinstance(r, RolloutGroup)]
    failures = [r for r in results if not isinstance(r, RolloutGroup)]
    for err in failures[:3]:
        logger.warning("held-out group failed and is left out of eval/reward: %r", err)
    if not groups:
        raise EvaluationError(f"all {len(items)} held-out groups failed; first error: {failures[0]!r}") from failures[0]
    totals: list[float] = []
    per_func: list[list[float]] = [[] for _ in reward_names]
    per_prompt: list[float] = []
    rows = []
    for grp in results:
        if not isinstance(grp, RolloutGroup):
            per_prompt.append(math.nan)
            continue
        group_totals = []
        for i in grp.episode_rows():  # an agent episode of several rows (segments) counts once
            text, scores = grp.completions[i], grp.rewards_per_func[i]
            total = sum(w * r for w, r in zip(reward_weights, scores, strict=True) if not math.isnan(r))
            group_totals.append(total)
            for j, r in enumerate(scores):
                if not math.isnan(r):
                    per_func[j].append(r)
            rows.append({"prompt": str(grp.prompt), "completion": completion_display(text), "reward": total})
        totals.extend(group_totals)
        per_prompt.append(sum(group_totals) / len(group_totals) if group_totals else math.nan)
    metrics = {"eval/reward": sum(totals) / len(totals), "eval/dropped_groups": float(len(failures))}
    scored = [p for p in per_prompt if not math.isnan(p)]
    if len(scored) > 1:  # the noise of eval/reward: standard error of the mean over prompts (groups are equal-sized)
        metrics["eval/reward_se"] = statistics.stdev(scored) / math.sqrt(len(scored))
    metrics.update({f"eval/{k}": v for k, v in tool_metrics(groups).items()})
    metrics.update({f"eval/{k}": v for k, v in env_metrics(groups).items()})
    metrics.update({f"eval/{k}": v for k, v in agent_metrics(groups).items()})
    for name, vals in zip(reward_names, per_func, strict=True):
        if vals:
            metrics[f"eval/rewards/{name}/mean"] = sum(vals) / len(vals)
    scored_rows = [grp.rewards_per_func[i] for grp in groups for i in grp.episode_rows()]
    if scored_rows:
        matrix = torch.tensor(scored_rows, dtype=torch.float64)  # (completions, functions)
        metrics.update({f"eval/{k}": v for k, v in reward_correlations(matrix, list(reward_names)).items()})
    return HeldOutScores(metrics, rows, per_prompt)


def evaluate_reward(
    rollout: Rollout,
    client_factory: Callable[[], GenerationClient],
    items: Sequence[PromptItem],
    sampling: SamplingSettings,
    *,
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
    seed: int = 0,
    version: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """`score_held_out`'s (metrics, rows), for callers that need no per-prompt rewards (the in-run evaluation).

    Raises:
        EvaluationError: every group failed (the first failure is chained).
    """
    scores = score_held_out(
        rollout, client_factory, items, sampling, reward_names=reward_names, reward_weights=reward_weights,
        seed=seed, version=version,
    )  # fmt: skip
    return scores.metrics, scores.rows
