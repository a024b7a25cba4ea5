"""The `rewards` section: the reward functions that score completions (with DAPO's soft overlong penalty, used by
`builtin:soft_overlong_penalty`), where they run (a local process pool or a reward service) and their timeouts, and
how their scores become advantages (scaling, combining several functions)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, policy_list, tenant, volume_path

MAX_GUIDED_JUDGE_SCORE = 100  # `judge_guided_score` lists every integer score up to this in its regex
DEFAULT_JUDGE_RUBRIC = (
    "You grade an AI assistant's answer.\n\n"
    "[Question]\n{prompt}\n\n"
    "[Answer]\n{completion}\n\n"
    "Rate how correct, helpful and clear the answer is, from 0 (useless) to 10 (perfect). "
    "Reply with one line: Score: <number>"
)


class RewardsConfig(Section):
    """Reward functions, where they run, and how their scores become advantages."""

    # DAPO's soft overlong penalty (`builtin:soft_overlong_penalty`)
    overlong_buffer_len: int | None = Field(
        None,
        ge=1,
        description="DAPO soft overlong punishment (arXiv 2503.14476 eq. 13; verl `overlong_buffer.len`): "
        "with builtin:soft_overlong_penalty in reward_funcs, a completion longer than max_completion_length - "
        "overlong_buffer_len tokens gets -(excess / overlong_buffer_len) x overlong_penalty_factor, down to "
        "-overlong_penalty_factor at max_completion_length.",
        json_schema_extra=tenant(),
    )
    overlong_penalty_factor: float = Field(
        1.0,
        ge=0.0,
        description="Largest soft overlong penalty (verl "
        "`overlong_buffer.penalty_factor`; TRL's get_soft_overlong_punishment: 1).",
        json_schema_extra=tenant(),
    )
    # Reward functions, where they run, and advantage scaling
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["builtin:reverse_exact_match", "builtin:reverse_format"],
        min_length=1,
        description="Reward functions: `builtin:<name>`, `pkg.module:function`, or `path/to/file.py:function`, "
        "each with TRL's signature f(prompts, completions, completion_ids, **columns) -> list[float | None]; or a "
        "sequence-classification reward model (TRL): `model:<folder or org/name>` or a bare model folder, scored "
        "as its first logit on the reward workers (docs/rewards.md).",
        json_schema_extra=code(),
    )
    reward_model_batch_size: int = Field(
        16,
        ge=1,
        description="Texts per reward-model forward pass (TRL scores a whole batch at once and has no such "
        "field); lower it when a large reward model runs out of memory.",
        json_schema_extra=tenant(),
    )
    reward_model_device: Literal["auto", "cpu", "cuda"] = Field(
        "cpu",
        description="Where the reward workers run reward models: cpu (float32), cuda (the checkpoint's dtype; "
        "a GPU reward pod), or auto (cuda when the worker sees one).",
        json_schema_extra=tenant(),
    )
    reward_weights: list[float] | None = Field(
        None, description="One weight per reward function (TRL name); all 1.0 when None.", json_schema_extra=tenant()
    )
    reward_num_workers: int = Field(2, ge=1, description="Reward worker processes.", json_schema_extra=tenant())
    reward_timeout_s: float = Field(
        30.0, gt=0.0, description="Per-group reward call timeout (seconds).", json_schema_extra=tenant()
    )
    reward_failure_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="Fail the run (with a checkpoint, see checkpoint_on_signal) once every group has "
        "failed to score for this long (seconds; a dead reward service or broken reward workers), instead of "
        "dropping groups until rollout_timeout_s. Single failures are dropped and counted as before.",
        json_schema_extra=tenant(),
    )
    reward_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+",
        description="Base URL of a running reward service "
        "(`python -m async_grpo.rewards.server`, e.g. http://reward:8080): groups are scored there instead of in "
        "a local process pool. None: the env ASYNC_GRPO_REWARD_URL (set by the kubernetes launcher when "
        "reward_replicas > 0), else a local pool of reward_num_workers processes.",
        json_schema_extra=policy_list("reward_urls"),
    )
    # LLM judge (`builtin:llm_judge`, rewards/judge.py)
    judge_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+",
        description="OpenAI-compatible base URL of the LLM judge that `builtin:llm_judge` asks (e.g. a vLLM "
        "server: http://127.0.0.1:8001/v1, or http://judge:8000/v1 on Kubernetes). builtin:llm_judge needs this "
        "or judge_model_name_or_path. Its bearer token, if any, comes from the env ASYNC_GRPO_JUDGE_API_KEY.",
        json_schema_extra=policy_list("judge_urls"),
    )
    judge_model_name_or_path: str | None = Field(
        None,
        description="A model for the launcher to serve as the LLM judge on its own vLLM server (locally: a second "
        "vLLM process, started before the run and stopped after it; judge_url then points at it). Give this or "
        "judge_url, not both.",
        json_schema_extra=volume_path(),
    )
    judge_model: str | None = Field(
        None,
        description="The judge's served model id; None: the server's first model (GET /models).",
        json_schema_extra=tenant(),
    )
    judge_rubric: str = Field(
        DEFAULT_JUDGE_RUBRIC,
        description="The judge's instructions, with {prompt} and {completion} where the prompt and the completion "
        "go; the answer's last `Score: <number>` is the score.",
        json_schema_extra=tenant(),
    )
    judge_max_score: float = Field(
        10.0,
        gt=0.0,
        description="Top of the rubric's scale: the reward is the score divided by it (in [0, 1]).",
        json_schema_extra=tenant(),
    )
    judge_max_tokens: int = Field(
        32, ge=1, description="Tokens the judge may write per answer.", json_schema_extra=tenant()
    )
    judge_temperature: float = Field(
        0.0, ge=0.0, description="The judge's sampling temperature (0: greedy).", json_schema_extra=tenant()
    )
    judge_max_retries: int = Field(
        2,
        ge=0,
        description="Retries of a judge request after a connection error, timeout or 5xx (openai client).",
        json_schema_extra=tenant(),
    )
    judge_timeout_s: float = Field(
        60.0, gt=0.0, description="Timeout of one judge request (seconds).", json_schema_extra=tenant()
    )
    judge_max_concurrency: int = Field(
        16,
        ge=1,
        description="Judge requests in flight at once per reward worker (a group's completions at once).",
        json_schema_extra=tenant(),
    )
    judge_cache_size: int = Field(
        10_000,
        ge=0,
        description="Judge answers cached per reward worker, keyed by (model, rubric, prompt, completion, "
        "sampling); 0: no cache.",
        json_schema_extra=tenant(),
    )
    judge_guided_score: bool = Field(
        False,
        description="Constrain the judge's answer to `Score: <integer 0..judge_max_score>` with vLLM's structured "
        "outputs (no parse failures; vLLM judges only, judge_max_score an integer up to 100).",
        json_schema_extra=tenant(),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage scaling: divide by the group std, the batch std, or not at all (TRL).",
        json_schema_extra=tenant(),
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="How several reward functions combine into one advantage (TRL name).",
        json_schema_extra=tenant(),
    )
