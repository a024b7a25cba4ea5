"""Preflight of the `peft` section: LoRA target modules that match no module of the model.

Builds the model's module tree on the meta device from its config alone (no weights are read), so the check costs
an import of transformers and a second or so, not a model load.
"""

from __future__ import annotations

import re
from pathlib import Path

from async_grpo.config import GRPOConfig
from async_grpo.hub import looks_like_repo_id
from async_grpo.preflight.report import Problem

FIELD = "peft.lora_target_modules"


def check_lora_targets(config: GRPOConfig, local: bool = True) -> tuple[list[Problem], str | None]:
    """With use_peft and an explicit lora_target_modules (a list, or a regex string other than all-linear): a
    problem when no module name matches, as peft matches them (a list entry equals a module name or its last
    dotted parts; a string is a full-match regex). Returns (problems, a skip note when the model is not at hand:
    a hub id or a folder without config.json; or, off the local target, a model whose config is remote code,
    which is never run there)."""
    peft = config.peft
    targets = peft.lora_target_modules
    if not peft.use_peft or targets is None or targets == "all-linear":
        return [], None
    if config.trust_remote_code and not local:
        return [], "lora_targets: the model's config is remote code, which is never run on this machine"
    names = _module_names(config)
    if names is None:
        return [], f"lora_targets: {config.model_name_or_path!r} is read at launch"
    if isinstance(targets, str):
        matched = any(re.fullmatch(targets, name) for name in names)
    else:
        matched = any(name == t or name.endswith(f".{t}") for name in names for t in targets)
    if matched:
        return [], None
    linear = sorted({name.rsplit(".", 1)[-1] for name, kind in names.items() if kind == "Linear"})
    return [
        Problem(
            FIELD,
            f"{targets!r} matches no module of the model",
            f"pick some of its linear layers {linear}, use all-linear, or remove it for peft's default",
        )
    ], None


def _module_names(config: GRPOConfig) -> dict[str, str] | None:
    """{module name: class name} of the policy built on the meta device, or None when its config is not here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name = config.model_name_or_path
    if name == "builtin:tiny":  # the tiny model is a stock Qwen2: its module names do not depend on its sizes
        model_config = AutoConfig.for_model(
            "qwen2",
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=320,
        )
    elif looks_like_repo_id(name) or not (Path(name).expanduser() / "config.json").is_file():
        return None
    else:
        model_config = AutoConfig.from_pretrained(Path(name).expanduser(), trust_remote_code=config.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.trust_remote_code)
    return {n: type(m).__name__ for n, m in model.named_modules() if n}
