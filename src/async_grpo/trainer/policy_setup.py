"""The policy's memory savers and TRL's model options, applied to a freshly loaded policy: `gradient_checkpointing`
(transformers' own) and `disable_dropout`."""

from __future__ import annotations

from typing import Any

import torch


def prepare_policy(
    model: torch.nn.Module,
    *,
    gradient_checkpointing: bool = False,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    disable_dropout: bool = False,
) -> torch.nn.Module:
    """Apply TRL's model options to a loaded policy, in place; returns it.

    Args:
        model: a transformers causal LM.
        gradient_checkpointing: recompute decoder-layer activations in backward
            (`model.gradient_checkpointing_enable`, non-reentrant by default; the KV cache is turned off, as
            transformers requires). Gradients are those of the plain model; only memory and time change.
        gradient_checkpointing_kwargs: its arguments (default {"use_reentrant": False}).
        disable_dropout: set every `torch.nn.Dropout`'s p to 0 (TRL `disable_dropout_in_model`).

    Raises:
        ValueError: gradient checkpointing on a model that does not support it.
    """
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"gradient_checkpointing: {type(model).__name__} does not support it. Fix: set "
                "gradient_checkpointing=false."
            )
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs or {"use_reentrant": False}
        )
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model
