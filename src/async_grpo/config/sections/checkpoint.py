"""The `checkpoint` section of `GRPOConfig`: what the run saves: the final model, periodic resumable checkpoints
(HF Trainer names: `save_steps`, `save_total_limit`, `resume_from_checkpoint`) and the checkpoint on a stop signal.
`runner.checkpoints` implements it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant, volume_path


class CheckpointConfig(Section):
    """What the run saves, when it writes resumable checkpoints, and where it resumes from."""

    save_model: bool = Field(
        True, description="Save the final HF checkpoint and log it to MLflow.", json_schema_extra=tenant()
    )
    save_steps: int | float = Field(
        0,
        ge=0,
        description="Write a resumable checkpoint `<output_dir>/checkpoint-<step>/` every this many "
        "optimizer steps (HF TrainingArguments `save_steps`); below 1 it is a fraction of max_steps (HF); 0 (or "
        "None) writes none. A checkpoint holds the policy (HF folder `model/`), optimizer and scheduler, RNGs, the "
        "prompt sampler's position, replay / re-roll state, counters and the MLflow run id.",
        json_schema_extra=tenant(),
    )
    save_total_limit: int | None = Field(
        None,
        ge=1,
        description="Keep only the newest this-many `checkpoint-<step>` folders (HF TrainingArguments "
        "`save_total_limit`); older ones are deleted only after the new one is complete. None keeps all.",
        json_schema_extra=tenant(),
    )
    resume_from_checkpoint: bool | str | None = Field(
        None,
        description="Resume a run (HF TrainingArguments `resume_from_checkpoint`): a checkpoint folder, or "
        "true for the newest complete `checkpoint-<step>` in output_dir. Unlike HF, true with no checkpoint there "
        "starts fresh (logged), so a restarted pod's first start works; a folder that does not exist is an error. "
        "The run continues the checkpoint's MLflow run, step, policy version and prompt order. None/false: fresh.",
        json_schema_extra=volume_path(),
    )
    checkpoint_on_signal: bool = Field(
        True,
        description="On SIGTERM or SIGINT (pod eviction, Ctrl-C, KFP cancel) let the current optimizer step "
        "end, write a checkpoint, then stop with the MLflow run KILLED (HF TrainingArguments "
        "`enable_jit_checkpoint` does this for the HF Trainer). The same checkpoint is written when the run fails "
        "because a dependency stayed down (reward_failure_timeout_s, max_inference_restarts). False: stop at once, "
        "no checkpoint.",
        json_schema_extra=tenant(),
    )
    checkpoint_signal_grace_s: float = Field(
        60.0,
        gt=0.0,
        description="Seconds a stop signal leaves for the checkpoint: the Kubernetes pod's "
        "terminationGracePeriodSeconds is this plus a margin. A step still running after half of it is abandoned "
        "(no checkpoint then: the newest periodic one stays the resume point).",
        json_schema_extra=tenant(),
    )

    on_collapse: Literal["warn", "stop", "rollback"] = Field(
        "warn",
        description="What the run does when its reward collapses (runner/collapse.py: the held-out reward, or the "
        "rolling training reward over collapse_window_steps, falls below best - collapse_reward_drop * max(|best|, "
        "best - first); or the rolling entropy below collapse_min_entropy): `warn` logs a warning naming the step and "
        "the metric collapse/detected; `stop` also ends the run there (the final model is the collapsed one: use the "
        "newest checkpoint); `rollback` restores the newest checkpoint written at or before the best held-out "
        "evaluation, pushes it to vLLM and goes on (at most collapse_max_rollbacks times, then stops; needs "
        "save_steps, and refuses full_determinism, whose schedule would replay the collapse).",
        json_schema_extra=tenant(),
    )
    collapse_reward_drop: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="How far below its best a reward must fall to count as a collapse, as a fraction of "
        "max(|best|, best - first) (runner/collapse.py `collapse_threshold`): 0.5 flags a held-out reward that fell "
        "from a best of 1.67 (first 1.33) below 0.84.",
        json_schema_extra=tenant(),
    )
    collapse_window_steps: int = Field(
        20,
        ge=1,
        description="Steps in the rolling training reward (and entropy) the collapse guard judges; the held-out "
        "reward is judged at every evaluation.",
        json_schema_extra=tenant(),
    )
    collapse_min_entropy: float | None = Field(
        None,
        ge=0.0,
        description="A mean policy entropy (nats per token, the `entropy` metric) over collapse_window_steps below "
        "this counts as a collapse. None: entropy is not watched.",
        json_schema_extra=tenant(),
    )
    collapse_max_rollbacks: int = Field(
        2,
        ge=1,
        description="on_collapse rollback: rollbacks a run may make; the next collapse stops it.",
        json_schema_extra=tenant(),
    )

    @field_validator("save_steps", mode="before")
    @classmethod
    def _none_is_off(cls, value: Any) -> Any:
        """HF writes `save_steps: null` for no periodic saves; ours is 0."""
        return 0 if value is None else value

    @field_validator("resume_from_checkpoint")
    @classmethod
    def _check_resume(cls, value: bool | str | None) -> bool | str | None:
        """`false` and "" mean a fresh run (None); a path must be non-blank."""
        if value is False or (isinstance(value, str) and not value.strip()):
            return None
        return value
