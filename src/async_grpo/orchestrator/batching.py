"""Advantages and rollout metrics over a step's groups: what turns scored groups into a `TrainBatch`.

Advantages come from `algorithms.compute_advantages` (TRL's group-mean baseline and scaling), computed over
exactly the groups handed in (a whole step, or one streamed chunk); metrics use TRL's names.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

import torch

from async_grpo.algorithms import compute_advantages
from async_grpo.transports.messages import RolloutGroup, TrainBatch

logger = logging.getLogger(__name__)


def rollout_metrics(
    groups: list[RolloutGroup],
    reward_names: list[str],
    reward_weights: list[float],
    scale_rewards: str,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> dict[str, float]:
    """The rollout metrics `make_train_batch` would attach to `groups`, without touching the groups."""
    return _advantages_and_metrics(
        groups, reward_names, reward_weights, scale_rewards, multi_objective_aggregation, assign=False
    )


def make_train_batch(
    groups: list[RolloutGroup],
    reward_names: list[str],
    reward_weights: list[float],
    scale_rewards: str,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> TrainBatch:
    """Compute advantages over `groups` (in place) and wrap them with rollout metrics.

    Metrics follow TRL's names: `reward`, `reward_std`, `frac_reward_zero_std`,
    `rewards/<func>/mean|std`, `rewards/<func>/seconds` and `rewards/seconds` (`reward_time_metrics`), `rewards/<a>/correlation/<b>` (`reward_correlations`), `completions/mean_length|max_length` (tokens the model generated: the loss mask's
    ones, tool output excluded, as TRL), `completions/clipped_ratio`, `tool_metrics` / `env_metrics` for multi-turn groups,
    and `teacher_metrics` (`distill/*`) when a teacher scored the groups.
    """
    metrics = _advantages_and_metrics(
        groups, reward_names, reward_weights, scale_rewards, multi_objective_aggregation, assign=True
    )
    return TrainBatch(groups=groups, metrics=metrics)


def _advantages_and_metrics(
    groups, reward_names, reward_weights, scale_rewards, multi_objective_aggregation, assign: bool
) -> dict[str, float]:
    # one reward row per episode: an agent episode of several rows (segments) counts once, and each of its rows
    # gets the episode's advantage (RolloutGroup.episode_index)
    firsts = [grp.episode_rows() for grp in groups]
    g = len(firsts[0])
    if any(len(f) != g for f in firsts):
        raise ValueError(
            f"every group of a batch must have the same number of episodes; got {[len(f) for f in firsts]}"
        )
    rewards_per_func = torch.tensor(
        [grp.rewards_per_func[i] for grp, rows in zip(groups, firsts, strict=True) for i in rows], dtype=torch.float32
    )  # (B * G, F)
    out = compute_advantages(
        rewards_per_func,
        torch.tensor(reward_weights, dtype=torch.float32),
        g,
        scale_rewards,
        multi_objective_aggregation,
    )
    if assign:
        adv = out.advantages.tolist()
        rewards = out.rewards.tolist()
        for i, grp in enumerate(groups):
            episodes = grp.episode_index or range(grp.size)
            grp.advantages = [adv[i * g + e] for e in episodes]
            grp.rewards = [rewards[i * g + e] for e in episodes]
    metrics: dict[str, float] = {}
    for key, value in out.metrics.items():
        for idx, name in enumerate(reward_names):  # rewards/<i>/... -> rewards/<func name>/...
            key = key.replace(f"rewards/{idx}/", f"rewards/{name}/")
        metrics[key] = float(value)
    metrics.update(reward_correlations(rewards_per_func, reward_names))
    lengths = [sum(mask) for grp in groups for mask in grp.loss_mask]  # the model's tokens: tool output excluded
    truncated = [t for grp in groups for t in grp.truncated]
    metrics["completions/mean_length"] = sum(lengths) / len(lengths)
    metrics["completions/max_length"] = float(max(lengths))
    metrics["completions/clipped_ratio"] = sum(truncated) / len(truncated)
    nonfinite = sum(grp.nonfinite_logprob_tokens for grp in groups)
    metrics["sampling/nonfinite_logprob_tokens"] = float(nonfinite)  # left out of the loss (RolloutGroup)
    if nonfinite and assign:
        logger.warning("%d sampled token(s) with a NaN/inf sampling logprob are left out of the loss", nonfinite)
    metrics.update(reward_time_metrics(groups))
    metrics.update(tool_metrics(groups))
    metrics.update(env_metrics(groups))
    metrics.update(agent_metrics(groups))
    metrics.update(teacher_metrics(groups))
    return {k: v for k, v in metrics.items() if not math.isnan(v)}


def agent_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Agent metrics over the episodes of `groups` that an agent rollout produced ({} when none did;
    `agents.rollout`), each episode counted once (its first row's `rollout_stats`):

    `agent/calls_per_episode/mean|max` (model calls served), `agent/segments_per_episode` (rows trained per
    episode), `agent/history_rewrites` (calls that started a new segment, per episode), `agent/seconds` (mean
    wall-clock seconds of an episode), `agent/truncated_frac` (episodes cut by the token budget),
    `agent/faults/<kind>` (episodes with that fault, per episode: exception, timeout, bad_return, no_call,
    max_turns), `agent/fault_frac` (episodes with any fault) and `agent/refused/<kind>` (calls the endpoint refused,
    per episode: unsupported, max_turns, budget, rejected_by_vllm).
    """
    stats = [(grp.rollout_stats, grp.episode_rows()) for grp in groups if "agent/calls" in grp.rollout_stats]
    if not stats:
        return {}

    def values(key: str) -> list[float]:
        return [st[key][i] for st, rows in stats for i in rows if key in st]

    calls = values("agent/calls")
    n = len(calls)
    out = {
        "agent/calls_per_episode/mean": sum(calls) / n,
        "agent/calls_per_episode/max": max(calls),
        "agent/segments_per_episode": sum(values("agent/segments")) / n,
        "agent/history_rewrites": sum(values("agent/history_rewrites")) / n,
        "agent/seconds": sum(values("agent/seconds")) / n,
        "agent/truncated_frac": sum(values("agent/truncated")) / n,
        "agent/fault_frac": sum(1 for v in values("agent/faults") if v > 0) / n,
    }
    for key in {k for st, _ in stats for k in st if k.startswith(("agent/faults/", "agent/refused/"))}:
        out[key] = sum(values(key)) / n
    return out


def teacher_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """On-policy distillation's rollout-side metrics over the groups the teacher scored (`teacher_logprobs`
    non-empty; {} when none was): `distill/teacher_seconds` (mean wall-clock seconds of one group's teacher request,
    retries included) and `distill/teacher_tokens_unscored` (trained tokens, loss mask 1, whose teacher logprob is NaN:
    the teacher returned none for them; a count over the step). `distill/reverse_kl` is the trainer's."""
    scored = [grp for grp in groups if grp.teacher_logprobs]
    if not scored:
        return {}
    unscored = sum(
        1
        for grp in scored
        for row, mask in zip(grp.teacher_logprobs, grp.loss_mask, strict=True)
        for lp, m in zip(row, mask, strict=True)
        if m and math.isnan(lp)
    )
    return {
        "distill/teacher_seconds": sum(grp.teacher_seconds for grp in scored) / len(scored),
        "distill/teacher_tokens_unscored": float(unscored),
    }


def reward_time_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """The step's reward-side time (issue 53's generation-side split): `rewards/<func>/seconds` (mean seconds of one
    group's call of that function) and `rewards/seconds` (mean seconds of one group's calls of all functions), over
    the groups whose scorer timed them (`RolloutGroup.reward_seconds`); {} when none did."""
    timed = [grp.reward_seconds for grp in groups if grp.reward_seconds]
    if not timed:
        return {}
    out = {"rewards/seconds": sum(sum(t.values()) for t in timed) / len(timed)}
    for name in sorted({name for t in timed for name in t}):
        values = [t[name] for t in timed if name in t]
        out[f"rewards/{name}/seconds"] = sum(values) / len(values)
    return out


def reward_correlations(rewards_per_func: torch.Tensor, reward_names: Sequence[str]) -> dict[str, float]:
    """Pearson correlation between every pair of reward functions, over the completions both scored.

    Args:
        rewards_per_func: `(completions, functions)` raw rewards; NaN where a function did not score a completion.
        reward_names: the functions' names, in `reward_funcs` order.

    Returns:
        `rewards/<a>/correlation/<b>` for each pair with `a` before `b` in `reward_funcs`. A pair with fewer than 3
        completions scored by both, or with a constant function over them, gets no entry (the correlation is
        undefined there). A learned reward (a reward model, a judge) that drifts away from a verifier shows as a
        falling correlation while its own mean keeps rising: reward over-optimization (Gao et al. 2023, "Scaling
        Laws for Reward Model Overoptimization").

    Raises:
        ValueError: `reward_names` does not have one name per column.
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[1] != len(reward_names):
        raise ValueError(
            f"reward_correlations: rewards_per_func has shape {tuple(rewards_per_func.shape)}, "
            f"expected (completions, {len(reward_names)})"
        )
    out: dict[str, float] = {}
    values = rewards_per_func.double()
    for a in range(len(reward_names)):
        for b in range(a + 1, len(reward_names)):
            both = ~(values[:, a].isnan() | values[:, b].isnan())
            if int(both.sum()) < 3:
                continue
            x = values[both, a] - values[both, a].mean()
            y = values[both, b] - values[both, b].mean()
            scale = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
            if scale <= 1e-12 * max(1.0, float(both.sum())):
                continue  # a constant function over these completions: no correlation
            out[f"rewards/{reward_names[a]}/correlation/{reward_names[b]}"] = float((x * y).sum()) / scale
    return out


def tool_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Tool-calling metrics over the completions of `groups` that a tool environment produced ({} when none did;
    `environments.tools.ToolEnvironment`, whose turns and template drift are the environment rollout's `env/*`).

    TRL's names and meanings where TRL has them: `tools/call_frequency` (tool calls per completion) and
    `tools/failure_frequency` (failed calls per call, 0 without calls). Also `tools/success_frequency` (calls that ran
    and returned, per completion), `tools/calls_per_rollout/mean|max` and `tools/turns_per_rollout/mean|max` (per
    completion: calls, and assistant turns generated), `tools/seconds` (mean wall-clock seconds per call that ran),
    `tools/failures/<kind>` (failed calls of that kind per call: malformed, unknown_tool, bad_arguments,
    exception, timeout, crashed), `tools/template_drift` (turns whose chat-template re-render differed from the held
    tokens, per completion) and `tools/loop_exhausted_frac` (completions stopped by max_tool_calling_iterations).
    """
    stats = [grp.rollout_stats for grp in groups if "tools/calls" in grp.rollout_stats]
    if not stats:
        return {}

    def values(key: str) -> list[float]:
        return [v for st in stats for v in st.get(key, [])]

    calls, failures, turns = values("tools/calls"), values("tools/failures"), values("env/turns")
    n, total, failed = len(calls), sum(calls), sum(failures)
    out = {
        "tools/call_frequency": total / n, "tools/failure_frequency": failed / total if total else 0.0,
        "tools/success_frequency": (total - failed) / n,
        "tools/calls_per_rollout/mean": total / n, "tools/calls_per_rollout/max": max(calls),
        "tools/turns_per_rollout/mean": sum(turns) / n, "tools/turns_per_rollout/max": max(turns),
        "tools/template_drift": sum(values("env/template_drift")) / n,
        "tools/loop_exhausted_frac": sum(values("tools/loop_exhausted")) / n,
    }  # fmt: skip
    ran = (
        total
        - sum(values("tools/failures/malformed"))
        - sum(values("tools/failures/unknown_tool"))
        - sum(values("tools/failures/bad_arguments"))
    )
    out["tools/seconds"] = sum(values("tools/seconds")) / ran if ran else 0.0
    for key in sorted({k for st in stats for k in st if k.startswith("tools/failures/")}):
        out[key] = sum(values(key)) / total if total else 0.0
    return out


def env_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Environment metrics over the completions of `groups` that an environment rollout produced ({} when none did;
    `orchestrator.env_rollout`), in the style of `tool_metrics`.

    `env/turns` (model turns per completion, mean; `env/turns_max` the most), `env/failures` (environment calls
    that failed, per completion) and `env/failures/<kind>` (per completion, each kind of
    `environments.FAILURE_KINDS`: reset_exception, reset_timeout, reset_mismatch, step_exception, step_timeout,
    bad_observation), `env/template_drift` (turns whose chat-template re-render of the conversation differed from
    the held token ids, per completion: the token mismatch that token-in/token-out avoids training on),
    `env/done_frac` (episodes the environment ended), `env/max_turns_frac` (episodes stopped by max_turns) and
    `env/reward` (the environment's reward per completion, 0 where it gave none) and `env/seconds` (seconds an
    episode spent in the environment's `step` calls, its tool calls included, per completion).
    """
    stats = [grp.rollout_stats for grp in groups if "env/turns" in grp.rollout_stats]
    if not stats:
        return {}

    def values(key: str) -> list[float]:
        return [v for st in stats for v in st.get(key, [])]

    turns = values("env/turns")
    n = len(turns)
    out = {
        "env/turns": sum(turns) / n, "env/turns_max": max(turns), "env/failures": sum(values("env/failures")) / n,
        "env/template_drift": sum(values("env/template_drift")) / n, "env/done_frac": sum(values("env/done")) / n,
        "env/max_turns_frac": sum(values("env/max_turns_reached")) / n, "env/reward": sum(values("env/reward")) / n,
        "env/seconds": sum(values("env/seconds")) / n,
    }  # fmt: skip
    for key in sorted({k for st in stats for k in st if k.startswith("env/failures/")}):
        out[key] = sum(values(key)) / n
    return out


class GenerationMeter:
    """Thread-safe count of generated tokens, read as tokens/s between two reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = 0
        self._last = (time.monotonic(), 0)

    def add(self, tokens: int) -> None:
        """Count `tokens` generated tokens."""
        with self._lock:
            self._tokens += tokens

    def rate(self) -> float:
        """Tokens per second since the previous call."""
        with self._lock:
            now, total = time.monotonic(), self._tokens
            t0, n0 = self._last
            self._last = (now, total)
        return (total - n0) / max(now - t0, 1e-9)
