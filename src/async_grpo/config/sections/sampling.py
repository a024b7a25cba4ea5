"""The `sampling` section: the vLLM sampling parameters of every rollout request (group size, completion length,
temperature, top_p, top_k, min_p, repetition penalty, extra `generation_kwargs`). The trainer scores with the same
temperature, and whatever truncates or reshapes the sampling distribution shows in the IS ratio.
`RESERVED_GENERATION_KEYS` lists the request keys the rollout sets itself, which `generation_kwargs` may not override.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import tenant

# Request fields the rollout sets itself; `generation_kwargs` may not override them (the named field, or the
# IS correction's logprobs / token ids, would silently stop meaning what they say).
RESERVED_GENERATION_KEYS = {
    "n": "num_generations",
    "max_tokens": "max_completion_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "logprobs": None,
    "prompt": None,
    "model": None,
    "stream": None,
    "echo": None,
    "return_token_ids": None,
    "skip_special_tokens": None,
    "prompt_logprobs": None,
}


class SamplingConfig(Section):
    """How rollouts are sampled from vLLM (the trainer scores with the same temperature)."""

    # min_p, repetition penalty and extra request parameters (TRL names)
    min_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Min-p sampling (TRL name): drop tokens below min_p x the top token's "
        "probability. Like top_p it truncates the distribution the trainer scores, so the IS ratio measures it.",
        json_schema_extra=tenant(),
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        description="vLLM repetition penalty (TRL name); 1.0 disables it. It changes the sampling "
        "distribution, so the IS ratio measures it too.",
        json_schema_extra=tenant(),
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extra vLLM sampling parameters added to every generation request (TRL name), e.g. "
        "{stop: ['</answer>'], presence_penalty: 0.5}. Keys with a field of their own (n, max_tokens, "
        "temperature, top_p, top_k, min_p, repetition_penalty, seed) or that the IS correction relies on "
        "(logprobs, return_token_ids, ...) are refused.",
        json_schema_extra=tenant(),
    )
    # Group size, completion length and the distribution sampled
    num_generations: int = Field(
        8,
        ge=2,
        description="Completions sampled per prompt, i.e. the group size G (TRL name).",
        json_schema_extra=tenant(),
    )
    max_completion_length: int = Field(
        16, ge=1, description="Max generated tokens per completion (TRL name).", json_schema_extra=tenant()
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Sampling temperature for rollouts (TRL name). The trainer "
        "divides its logits by it too (TRL), so its logprobs compare with vLLM's processed "
        "sampling logprobs in the IS ratio and OPSM.",
        json_schema_extra=tenant(),
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling threshold (TRL name). The trainer scores "
        "the untruncated distribution (as TRL does), so below 1 the vLLM IS ratio and OPSM also "
        "measure the truncation.",
        json_schema_extra=tenant(),
    )
    top_k: int = Field(
        -1,
        description="Top-k sampling; -1 (or 0) disables it (TRL name). Above 0 the vLLM IS ratio "
        "also measures the truncation, as for top_p.",
        json_schema_extra=tenant(),
    )

    @field_validator("generation_kwargs")
    @classmethod
    def _check_generation_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Refuse keys the rollout sets itself, naming the field to use instead."""
        for key in value or {}:
            if key in RESERVED_GENERATION_KEYS:
                field = RESERVED_GENERATION_KEYS[key]
                fix = f"set {field} instead" if field else "remove it (the rollout sets it for the IS correction)"
                raise ValueError(f"generation_kwargs.{key}: {fix}.")
        return value
