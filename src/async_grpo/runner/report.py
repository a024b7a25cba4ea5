"""What a run reports: per-step pipeline metrics, sample-completion rows and the final `RunSummary`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from async_grpo.orchestrator.rollout import completion_display
from async_grpo.tracking import TRACE_EPISODE_TAG, TRACE_STEP_TAG, EpisodeTrace
from async_grpo.transports.drops import NOT_LAUNCHED_DROPS, DropReason
from async_grpo.transports.messages import RolloutGroup


@dataclass
class RunSummary:
    """What a finished run reports (also printed by the CLI). Times are seconds; rates are per second.

    Attributes:
        run_id, tracking_uri: the MLflow run.
        output_dir: the run folder.
        eval_before, eval_after: held-out metrics (`eval/reward`, ...) at the first and last step ({} without
            a held-out set).
        steps: optimizer steps taken.
        wall_s: seconds from start to end, setup included.
        train_s: seconds of the step loop.
        steps_per_s: steps / train_s.
        generation_tokens_per_s: mean over steps of the tokens generated between two steps per second.
        weight_sync_s_mean, weight_syncs: mean seconds of one weight push, and how many.
        trainer_idle_fraction: share of train_s the trainer waited for rollouts.
        dropped_groups: dropped groups by reason (`transports.drops.DropReason`).
        model_dir: the saved final model folder, or None.
        prompts_lost: launched groups that were neither trained nor dropped with a reason (the prompt ledger,
            `prompts_lost`; 0 unless something is broken), None with a user data producer.
        summary_plot: the end-of-run figure (`<output_dir>/summary.png`, `runner.plots.summary_figure`), None when no
            step ran or it could not be written.
    """

    run_id: str
    tracking_uri: str
    output_dir: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    steps: int
    wall_s: float
    train_s: float
    steps_per_s: float
    generation_tokens_per_s: float
    weight_sync_s_mean: float
    weight_syncs: int
    trainer_idle_fraction: float
    dropped_groups: dict[DropReason, int] = field(default_factory=dict)
    model_dir: str | None = None
    prompts_lost: int | None = None
    summary_plot: str | None = None


def prompts_lost(launched: int, trained: int, drops: dict[DropReason, int]) -> int:
    """The prompt ledger: of `launched` groups (every launch of the orchestrator, re-rolls included), those neither
    in a trained step batch (`trained`: every group of every batch an optimizer step consumed; a replayed copy
    stands for the zero-std group it replaced) nor dropped under a reason (`drops`) nor still queued (drained and
    counted as `unconsumed_at_end` once the orchestrator stopped). 0 unless a group vanished unaccounted."""
    return launched - trained - sum(v for k, v in drops.items() if k not in NOT_LAUNCHED_DROPS)


def pipeline_metrics(
    staleness: list[int],
    *,
    version: int,
    depth: int,
    waited_s: float,
    step_s: float,
    generation_rounds: int,
    world_size: int,
    drops: dict[DropReason, int],
) -> dict[str, float]:
    """The async pipeline's per-step metrics.

    Args:
        staleness: per freshly generated group of the step (replayed ones excluded), the policy version it was
            trained at minus the oldest one that sampled it.
        version: the policy version after the step's weight push (if any).
        depth: step batches waiting in the rollout queue when the step began.
        waited_s: seconds the trainer waited for this step's rollouts.
        step_s: seconds of the optimizer step (and push).
        generation_rounds: generation rounds (`produce` calls; axolotl's rollouts, `max_rollouts`) trained so far.
        world_size: trainer ranks.
        drops: dropped groups by reason (`transports.drops.DropReason`), cumulative.

    Returns:
        `staleness/mean|max` (policy versions between sampling and training, per fresh group), `queue/depth`,
        `trainer/idle_seconds`, `trainer/step_seconds`, `policy_version`, `generation_rounds`, `trainer/ranks`,
        `dropped_groups/total` and `dropped_groups/<reason>`.
    """
    metrics = {
        "staleness/mean": sum(staleness) / max(len(staleness), 1),
        "staleness/max": float(max(staleness, default=0)),
        "queue/depth": float(depth), "trainer/idle_seconds": waited_s, "trainer/step_seconds": step_s,
        "policy_version": float(version), "generation_rounds": float(generation_rounds),
        "trainer/ranks": float(world_size), "dropped_groups/total": float(sum(drops.values())),
    }  # fmt: skip
    metrics.update({f"dropped_groups/{k}": float(v) for k, v in drops.items()})
    return metrics


def completion_rows(groups: list[RolloutGroup], decode: Callable[[list[int]], str], n: int) -> list[dict]:
    """Up to `n` rows (prompt, completion, reward, advantage, policy_version, then the columns reward functions
    logged with TRL's `log_extra`, None where a group has none) for a sample-completions table; a conversational
    completion shows the whole conversation (tool calls and results, `completion_display`)."""
    rows = []
    extra = sorted({col for grp in groups for col in grp.reward_extra})
    for grp in groups:
        for i, (text, reward, adv) in enumerate(zip(grp.completions, grp.rewards, grp.advantages, strict=True)):
            logged = {col: _nth(grp.reward_extra.get(col), i) for col in extra}
            rows.append(
                {
                    "prompt": decode(grp.prompt_ids),
                    "completion": completion_display(text),
                    "reward": reward,
                    "advantage": adv,
                    "policy_version": grp.policy_version,
                    **logged,
                }
            )
            if len(rows) >= n:
                return rows
    return rows


def episode_traces(
    groups: list[RolloutGroup],
    *,
    step: int,
    version: int,
    reward_names: Sequence[str],
    decode: Callable[[list[int]], str],
) -> list[EpisodeTrace]:
    """One `EpisodeTrace` per episode (completion) of `groups`, for the MLflow Traces view (issue 53).

    Args:
        groups: the step's groups to trace (a replayed group is traced too, marked `replayed`).
        step: the optimizer step that trained them (attribute `step`, tag `async_grpo.step`).
        version: the policy version after the step (staleness = version - the version that sampled the episode).
        reward_names: (F,) the reward functions' names, in `rewards_per_func` order.
        decode: prompt token ids -> text, for a prompt given as ids only.

    Returns:
        G traces per group, in order: inputs {"prompt"}, outputs {"completion", "reward", "advantage",
        "rewards" (name -> value, None where a function returned None)}, attributes (step, group, sample,
        policy_version, staleness, completion_tokens, truncated, replayed, rerolled), the tags `async_grpo.step` and
        `async_grpo.episode` ("<group>/<sample>"), and
        the episode's spans (`RolloutGroup.spans`; none when the rollout recorded none). The root span covers the
        spans (now, when there are none).
    """
    traces = []
    now = time.time_ns()
    for index, grp in enumerate(groups):
        prompt = grp.prompt if grp.prompt is not None else decode(grp.prompt_ids)
        for i, completion in enumerate(grp.completions):
            spans = tuple(grp.spans[i]) if grp.spans else ()
            rewards = grp.rewards_per_func[i] if grp.rewards_per_func else []
            sampled_at = min(grp.token_versions[i], default=grp.policy_version)
            traces.append(EpisodeTrace(
                inputs={"prompt": prompt},
                outputs={
                    "completion": completion, "reward": _finite(grp.rewards[i] if grp.rewards else None),
                    "advantage": _finite(grp.advantages[i] if grp.advantages else None),
                    "rewards": {name: _finite(v) for name, v in zip(reward_names, rewards, strict=False)},
                },
                attributes={
                    "step": step, "group": index, "sample": i, "policy_version": sampled_at,
                    "staleness": version - sampled_at, "completion_tokens": len(grp.completion_ids[i]),
                    "truncated": grp.truncated[i], "replayed": grp.replayed, "rerolled": grp.rerolled,
                },
                tags={TRACE_STEP_TAG: str(step), TRACE_EPISODE_TAG: f"{index}/{i}"},
                start_ns=min((s.start_ns for s in spans), default=now),
                end_ns=max((s.end_ns for s in spans), default=now),
                spans=spans,
            ))  # fmt: skip
    return traces


def _finite(value: float | None) -> float | None:
    """`value` as a float, or None when it is None or not finite (JSON has no NaN)."""
    return float(value) if value is not None and math.isfinite(value) else None


def step_tokens(groups: list[RolloutGroup]) -> int:
    """Prompt + completion tokens of a step's groups, each completion with its own copy of the prompt (TRL's
    `num_tokens` counts the attention mask of every prompt-completion pair)."""
    return sum(g.size * len(g.prompt_ids) + sum(len(ids) for ids in g.completion_ids) for g in groups)


def _nth(values: list | None, i: int):
    """values[i] as a table cell (str unless a number or None), or None when there is no such value."""
    if not values or i >= len(values):
        return None
    v = values[i]
    return v if v is None or isinstance(v, (int, float, str)) else str(v)


def reward_log_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """The step's means of what reward functions logged with TRL's `log_metric` (name -> mean of every value)."""
    values: dict[str, list[float]] = {}
    for grp in groups:
        for name, vals in grp.reward_metrics.items():
            values.setdefault(name, []).extend(vals)
    return {name: sum(vals) / len(vals) for name, vals in values.items() if vals}
