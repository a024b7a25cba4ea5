"""A sequence-classification reward model used as a reward function, with TRL's semantics.

TRL's `GRPOTrainer` accepts a model id or path in `reward_funcs`: it loads it with
`AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)` and its own tokenizer (eos as pad when the
tokenizer has no pad token, copied into the model config so the head reads the last non-pad token), renders each
prompt+completion (standard: the two strings concatenated; conversational: the tokenizer's chat template over the
prompt messages plus the assistant completion), tokenizes with right padding and no added special tokens, and takes
`logits[:, 0]` as the reward. `RewardModelScorer` does the same in a reward worker process (never in the trainer),
in batches, truncated to the model's length, loading the model once per process on the first call.

Spec forms in `reward_funcs`: `model:<path or hub id>`, or a bare local folder holding a `config.json` (a bare
`org/name` is taken as a hub id, resolved through `async_grpo.hub`, from the HF cache when offline).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from async_grpo import hub

MODEL_PREFIX = "model:"
NAME_PREFIX = "reward_model/"
HEAD_SUFFIX = "ForSequenceClassification"
DEFAULT_BATCH_SIZE = 16
FALLBACK_MAX_LENGTH = 2048  # when neither the tokenizer nor the model config states a usable length


def is_reward_model_spec(spec: object) -> bool:
    """True for `model:<path or id>`, a bare local folder with a config.json, or a bare hub id (`org/name`); a bare
    string with no colon is no function spec, so this decides nothing that used to work. Does not import torch."""
    if not isinstance(spec, str) or not spec:
        return False
    if spec.startswith(MODEL_PREFIX):
        return True
    if ":" in spec:
        return False
    return (Path(spec).expanduser() / "config.json").is_file() or hub.looks_like_repo_id(spec)


def reward_model_location(spec: str) -> str:
    """The path or hub id a reward-model spec names (the `model:` prefix removed)."""
    return spec.removeprefix(MODEL_PREFIX).strip()


def is_hub_id(location: str) -> bool:
    """True when `location` is no existing local path and has the shape `org/name`."""
    return not Path(location).expanduser().exists() and hub.looks_like_repo_id(location)


def reward_model_name(spec: str) -> str:
    """The reward's name in metrics (`rewards/<name>/mean`): `reward_model/<folder or repo name>`."""
    location = reward_model_location(spec).rstrip("/")
    return NAME_PREFIX + (location.rsplit("/", 1)[-1] or location)


def absolute_reward_model_spec(spec: str) -> str:
    """`model:<absolute path>` for a local path (workers resolve it whatever their directory), `model:<id>` for a
    hub id."""
    location = reward_model_location(spec)
    if is_hub_id(location):
        return MODEL_PREFIX + location
    return MODEL_PREFIX + str(Path(location).expanduser().resolve())


def local_folder(location: str) -> Path:
    """The local folder of a path or hub id (`hub.snapshot`: downloaded into the HF cache, or read from it offline).

    Raises:
        hub.HubUnavailable: a hub id neither the hub nor the cache has.
    """
    if is_hub_id(location):
        return hub.snapshot(location)
    return Path(location).expanduser()


def read_model_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict (no torch, no transformers).

    Raises:
        OSError, ValueError: missing or not JSON.
    """
    config = json.loads((folder / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    return config


def num_labels(config: Mapping[str, Any]) -> int:
    """The head's output count as transformers reads it: len(id2label), else `num_labels`, else its default 2."""
    if isinstance(config.get("id2label"), Mapping):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def render_texts(
    tokenizer: Any, prompts: Sequence[Any], completions: Sequence[Any], chat_template_kwargs: Mapping | None = None
) -> list[str]:
    """The texts a reward model scores (TRL): prompt + completion for standard prompts; for conversational ones
    (message lists) the tokenizer's chat template over prompt messages + the completion's assistant message(s)."""
    if prompts and not isinstance(prompts[0], str):
        return [
            tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **dict(chat_template_kwargs or {}))
            for p, c in zip(prompts, completions, strict=True)
        ]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def max_length(tokenizer: Any, model_config: Any) -> int:
    """The longest input the model takes: the smaller of the tokenizer's `model_max_length` (when it is a real
    number, not transformers' 1e30 sentinel) and the config's `max_position_embeddings`."""
    candidates = [getattr(model_config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    lengths = [int(n) for n in candidates if isinstance(n, int) and 0 < n < 10**9]
    return min(lengths) if lengths else FALLBACK_MAX_LENGTH


def pick_device(device: str) -> str:
    """ "cpu", "cuda", or for "auto" cuda when available."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def load_reward_model(location: str, device: str = "cpu", trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load (model, tokenizer) once per process: the model in eval mode on `device`, float32 on CPU, the
    checkpoint's dtype on CUDA; the tokenizer with eos as pad when it has none (TRL), and that pad id in the model
    config (the head reads the last non-pad token).

    Raises:
        ValueError: the head does not have exactly one label (names the fix).
        hub.HubUnavailable: a hub id that cannot be resolved.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = local_folder(location)
    labels = num_labels(read_model_config(folder))
    if labels != 1:
        raise ValueError(
            f"reward model {location!r} has num_labels={labels}; the reward is its single logit. "
            "Fix: train/save it with num_labels=1, as TRL's RewardTrainer does."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.float32 if device == "cpu" else "auto"
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def score_texts(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE) -> list[float]:
    """`logits[:, 0]` of each text, `batch_size` texts per forward (right padding, no added special tokens,
    truncated to `max_length`)."""
    import torch

    limit = max_length(tokenizer, model.config)
    device = next(model.parameters()).device
    scores: list[float] = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            list(texts[start : start + batch_size]),
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
            truncation=True,
            max_length=limit,
        ).to(device)
        with torch.inference_mode():
            logits = model(**batch).logits  # (B, 1)
        scores += [float(x) for x in logits[:, 0].float().cpu()]
    return scores


class RewardModelScorer:
    """A reward model as a TRL reward function: `scorer(prompts=..., completions=..., **kwargs) -> list[float]`.

    Creating one loads nothing; the first call loads the model in the calling process (`load_reward_model`, cached
    per process), so the pool's parent only checks the spec and each reward worker loads its own copy once.
    `batch_size`, `device` and `chat_template_kwargs` may come per call (the run's config binds them,
    `contract.bound_kwargs`), else the constructor's.
    """

    def __init__(
        self,
        location: str,
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str = "cpu",
        chat_template_kwargs: Mapping | None = None,
        trust_remote_code: bool = False,
    ):
        self.location = location
        self.batch_size = batch_size
        self.device = device
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.trust_remote_code = trust_remote_code
        self.__name__ = reward_model_name(location)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Any = None,
        *,
        reward_model_batch_size: int | None = None,
        reward_model_device: str | None = None,
        chat_template_kwargs: Mapping | None = None,
        **columns: Any,
    ) -> list[float]:
        device = pick_device(reward_model_device or self.device)
        model, tokenizer = load_reward_model(self.location, device, self.trust_remote_code)
        kwargs = self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
        texts = render_texts(tokenizer, prompts, completions, kwargs)
        return score_texts(model, tokenizer, texts, reward_model_batch_size or self.batch_size)

    def __repr__(self) -> str:
        return f"RewardModelScorer({self.location!r})"
