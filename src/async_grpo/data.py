"""Prompt datasets in TRL's formats: load one from a file, a saved folder or a builtin task, validate it, tokenize prompts.

Validation happens once at load, row by row, so a malformed prompt fails before any process starts
with a message naming the row, the field and the fix. Every column other than `prompt` travels with
its row to the reward functions as a keyword argument, exactly as TRL passes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import datasets

BUILTIN_PREFIX = "builtin:"
FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Keyword arguments the reward call itself fills; a dataset column with one of these names would clash.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")
_SPLIT_NAMES = {"train": ("train",), "eval": ("eval", "validation", "test")}

Split = Literal["train", "eval"]


def load_prompt_dataset(spec: str, *, split: Split, seed: int = 0) -> datasets.Dataset:
    """Load and validate a prompt dataset.

    Args:
        spec: a `.jsonl`, `.json` or `.parquet` file; a `datasets.save_to_disk` folder (a `Dataset`,
            or a `DatasetDict` from which `split` picks "train", or "eval"/"validation"/"test"); or
            `builtin:<task>` (the task's training split for split="train", its held-out split for
            split="eval").
        split: "train" or "eval". For files, which hold one split, it is ignored.
        seed: seeds the builtin task's training items; ignored otherwise.

    Returns:
        datasets.Dataset with a `prompt` column (each a string, or a list of {"role", "content"}
        message dicts) and any other columns for the reward functions.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported spec, unknown builtin task, missing or malformed `prompt` column, a
            reserved column name, or an empty dataset; the message names the field and the fix.
    """
    if split not in _SPLIT_NAMES:
        raise ValueError(f"split={split!r} must be 'train' or 'eval'.")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"dataset spec {spec!r} must be a non-empty string. Fix: give a file, folder or builtin:<task>.")
    if spec.startswith(BUILTIN_PREFIX):
        ds = _load_builtin(spec[len(BUILTIN_PREFIX):], split, seed)
    else:
        ds = _load_path(spec, split)
    validate_prompt_dataset(ds, spec)
    return ds


def _load_builtin(name: str, split: Split, seed: int) -> datasets.Dataset:
    from async_grpo.tasks import TASKS, get_task

    try:
        task = get_task(name)
    except KeyError:
        raise ValueError(
            f"dataset 'builtin:{name}': unknown builtin task. Fix: use one of "
            f"{[BUILTIN_PREFIX + t for t in sorted(TASKS)]}."
        ) from None
    return task.train_dataset(seed) if split == "train" else task.eval_dataset()


def _load_path(spec: str, split: Split) -> datasets.Dataset:
    import datasets

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {spec!r} does not exist. Fix: give an existing .jsonl/.json/.parquet file, a "
            f"datasets.save_to_disk folder, or builtin:<task>."
        )
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(
                f"dataset {spec!r} is a folder but not a datasets.save_to_disk folder ({err}). "
                f"Fix: save it with Dataset.save_to_disk, or point at a .jsonl/.json/.parquet file."
            ) from None
        return _pick_split(loaded, spec, split)
    loader = FILE_LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ValueError(
            f"dataset {spec!r}: unsupported file type {path.suffix!r}. "
            f"Fix: convert it to one of {sorted(FILE_LOADERS)}, or save it with Dataset.save_to_disk."
        )
    try:
        return datasets.load_dataset(loader, data_files=str(path), split="train")
    except Exception as err:  # the json/parquet readers raise many types; name the file either way
        raise ValueError(f"dataset {spec!r}: could not read it as {loader}: {err}. Fix: check the file's format.") from err


def _pick_split(loaded: Any, spec: str, split: Split) -> datasets.Dataset:
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    names = list(loaded.keys())
    if len(names) == 1:
        return loaded[names[0]]
    for name in _SPLIT_NAMES[split]:
        if name in loaded:
            return loaded[name]
    raise ValueError(
        f"dataset {spec!r} is a DatasetDict with splits {names}; none is a {split} split "
        f"(looked for {list(_SPLIT_NAMES[split])}). Fix: rename the split, or save the one split you want."
    )


def validate_prompt_dataset(ds: datasets.Dataset, spec: str = "<dataset>") -> None:
    """Check that `ds` has a usable `prompt` column and no reserved column names.

    Every prompt must be a non-empty string (standard) or a non-empty list of message dicts, each with
    string `role` and `content` (conversational, as TRL).

    Raises:
        ValueError: the first problem found, naming the dataset, the row and the fix.
    """
    columns = list(ds.column_names)
    if "prompt" not in columns:
        raise ValueError(
            f"dataset {spec!r}: column 'prompt' missing; found columns {columns}. "
            f"Fix: rename your prompt column to 'prompt'."
        )
    clashes = [c for c in columns if c in RESERVED_COLUMNS]
    if clashes:
        raise ValueError(
            f"dataset {spec!r}: column(s) {clashes} clash with reward-function arguments {list(RESERVED_COLUMNS)}. "
            f"Fix: rename those columns."
        )
    if len(ds) == 0:
        raise ValueError(f"dataset {spec!r} has no rows. Fix: point at a dataset with prompts.")
    for i, prompt in enumerate(ds["prompt"]):
        problem = _prompt_problem(prompt)
        if problem:
            raise ValueError(
                f"dataset {spec!r}: row {i} field 'prompt' {problem}. Fix: make each prompt a string, or a list "
                f"of {{'role': ..., 'content': ...}} messages with string role and content."
            )


def _prompt_problem(prompt: Any) -> str | None:
    """None when `prompt` is valid, else a short description of what is wrong."""
    if isinstance(prompt, str):
        return None if prompt else "is an empty string"
    if not isinstance(prompt, list):
        return f"is a {type(prompt).__name__}, not a string or a list of messages"
    if not prompt:
        return "is an empty message list"
    for j, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            return f"message {j} is a {type(msg).__name__}, not a dict"
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = "missing" if msg.get(key) is None else f"a {type(msg.get(key)).__name__}"
                return f"message {j} key {key!r} is {got} (must be a string)"
    return None


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids for one prompt, as the policy should see it before its completion.

    A string prompt is encoded without special tokens, except that a BOS token is prepended when the
    tokenizer adds one by default (Llama-style), matching what vLLM does for a text prompt. A
    conversational prompt goes through `apply_chat_template(add_generation_prompt=True, tokenize=True)`.

    Returns:
        list[int] of token ids.

    Raises:
        ValueError: malformed prompt, or a conversational prompt with a tokenizer that has no chat
            template; the message names the fix.
    """
    problem = _prompt_problem(prompt if not isinstance(prompt, tuple) else list(prompt))
    if problem:
        raise ValueError(f"encode_prompt: prompt {problem}. Fix: pass a string or a list of role/content messages.")
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and ids[:1] != [bos] and list(tokenizer.encode(prompt, add_special_tokens=True))[:1] == [bos]:
            ids.insert(0, bos)
        return ids
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "encode_prompt: conversational prompt but the tokenizer has no chat_template. "
            "Fix: use a chat model's tokenizer, or give string prompts."
        )
    out = tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]


def prompt_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """The non-prompt columns of one dataset row: the keyword arguments for the reward functions."""
    return {k: v for k, v in row.items() if k != "prompt"}

