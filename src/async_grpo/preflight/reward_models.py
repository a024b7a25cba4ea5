"""Preflight of the reward models in `reward_funcs` (`rewards.reward_model`): what would make every group fail once
the run is up, read from the model folder without loading its weights.

Per entry, the first problem found: the path exists and holds config.json; its architectures end in
ForSequenceClassification; num_labels is 1; its dtype is one torch knows; the tokenizer loads and has a pad token or an eos token to pad
with; for a conversational dataset it has a chat template; a weights file is there. Hub ids
are checked when the HF cache has them, else at launch; on a cluster a path that is not on this machine is checked
where it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.config import GRPOConfig
from async_grpo.preflight.report import Problem

FIELD = "rewards.reward_funcs"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _cached_folder(repo_id: str) -> Path | None:
    """The HF-cache snapshot folder of `repo_id` when its config.json is cached; None otherwise (nothing fetched)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def check_folder(spec: str, folder: Path, conversational: bool | None, trust_remote_code: bool) -> str | None:
    """The first problem of the reward model in `folder` as a "message. Fix: ..." string, or None."""
    from async_grpo.rewards.reward_model import HEAD_SUFFIX, num_labels, read_model_config

    entry = f"reward model {spec!r}"
    if not folder.is_dir():
        return f"{entry}: {str(folder)!r} does not exist. Fix: give the folder save_pretrained wrote, or org/name."
    try:
        config = read_model_config(folder)
    except (OSError, ValueError) as err:
        return f"{entry}: {str(folder)!r} has no readable config.json ({err}). Fix: give a Hugging Face model folder."
    architectures = config.get("architectures") or []
    if not any(str(a).endswith(HEAD_SUFFIX) for a in architectures):
        return (
            f"{entry}: architectures {architectures} has no *{HEAD_SUFFIX} head, so it gives no reward. Fix: use "
            "a sequence-classification reward model (AutoModelForSequenceClassification, as TRL's RewardTrainer saves)."
        )
    labels = num_labels(config)
    if labels != 1:
        return (
            f"{entry}: num_labels={labels}, but the reward is the single logit (TRL loads it with num_labels=1). "
            "Fix: train/save it with num_labels=1, as TRL's RewardTrainer does."
        )
    problem = _dtype_problem(entry, config.get("dtype", config.get("torch_dtype")))
    if problem:
        return problem
    problem = _tokenizer_problem(entry, folder, conversational, trust_remote_code)
    if problem is None and not any((folder / name).is_file() for name in WEIGHT_FILES):
        return (
            f"{entry}: {str(folder)!r} holds no weights ({' or '.join(WEIGHT_FILES[::2])}). Fix: save the model there."
        )
    return problem


def _dtype_problem(entry: str, dtype: Any) -> str | None:
    if dtype is None or dtype == "auto":
        return None
    import torch

    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        return f"{entry}: config.json dtype {dtype!r} is no torch dtype. Fix: set it to e.g. float32 or bfloat16."
    return None


def _tokenizer_problem(entry: str, folder: Path, conversational: bool | None, trust_remote_code: bool) -> str | None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a missing/broken tokenizer
        return (
            f"{entry}: its tokenizer does not load ({type(err).__name__}: {str(err)[:200]}). "
            "Fix: save the tokenizer into the model folder (tokenizer.save_pretrained)."
        )
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        return (
            f"{entry}: its tokenizer has neither a pad token nor an eos token to pad with. "
            "Fix: set pad_token (or eos_token) in its tokenizer_config.json."
        )
    if conversational and not getattr(tokenizer, "chat_template", None):
        return (
            f"{entry}: the dataset is conversational, but the reward model's tokenizer has no chat template to "
            "render prompt + completion with. Fix: save a chat_template with its tokenizer, or use standard prompts."
        )
    return None


def _hub_offline() -> bool:
    """huggingface_hub's offline mode (`HF_HUB_OFFLINE`, read as the hub library reads it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_reward_models(
    config: GRPOConfig, local: bool, conversational: bool | None
) -> tuple[list[Problem], list[str]]:
    """Check every reward-model entry of `reward_funcs` (module docstring). `conversational`: whether the training
    prompts are message lists (None: unknown, the chat-template check is skipped). Returns (problems, skip notes)."""
    from async_grpo.rewards.reward_model import is_hub_id, is_reward_model_spec, reward_model_location

    problems, notes = [], []
    for spec in config.rewards.reward_funcs:
        if not is_reward_model_spec(spec):
            continue
        location = reward_model_location(spec)
        if not location:
            problems.append(
                Problem(FIELD, f"reward model spec {spec!r} names no model", "write model:<folder or org/name>")
            )
            continue
        if is_hub_id(location):
            folder = _cached_folder(location)
            if folder is None and local and _hub_offline():  # the load at launch can only fail (HubUnavailable)
                problems.append(
                    Problem(
                        FIELD,
                        f"reward model {spec!r}: there is no folder {location!r} here, and as a hub id it is not in "
                        "the HF cache while HF_HUB_OFFLINE is set",
                        "build or download the reward model first (an example's header says how), or point the spec "
                        "at a local folder",
                    )
                )
                continue
            if folder is None:
                notes.append(f"reward_models: {spec!r} is a hub id not in the HF cache; it is read at launch")
                continue
        else:
            folder = Path(location).expanduser()
            if not local and not folder.exists():
                notes.append(f"reward_models: {spec!r} is not on this machine; it is checked where it runs")
                continue
        problem = check_folder(spec, folder, conversational, config.trust_remote_code and local)
        if problem:
            problems.append(Problem(FIELD, problem))
    return problems, notes
