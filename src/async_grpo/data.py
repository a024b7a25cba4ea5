"""Prompt datasets in TRL's formats: load one from a file, a saved folder or a builtin task, validate it, tokenize prompts.

Validation happens once at load, row by row, so a malformed prompt fails before any process starts
with a message naming the row, the field and the fix. Every column other than `prompt` travels with
its row to the reward functions as a keyword argument, exactly as TRL passes them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from async_grpo import dataset_source, hub
from async_grpo.tasks import math_reasoning

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Keyword arguments the reward call itself fills; a dataset column with one of these names would clash.
RESERVED_COLUMNS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
    "env_reward", "env_state",  # what an environment rollout passes (orchestrator.env_rollout)
    "agent_reward",  # what an agent rollout passes (agents.rollout)
)  # fmt: skip
# Roles a prompt's messages may have (the chat-template roles TRL's conversational format uses).
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_SPLIT_NAMES = {"train": ("train",), "eval": ("eval", "validation", "test")}

Split = Literal["train", "eval"]


def load_prompt_dataset(
    spec: str,
    *,
    split: Split,
    seed: int = 0,
    config_name: str | None = None,
    split_name: str | None = None,
    system_prompt: str | None = None,
    when: dataset_source.RunDate | None = None,
) -> datasets.Dataset:
    """Load and validate a prompt dataset.

    Args:
        spec: a `.jsonl`, `.json` or `.parquet` file; a folder of such files (its newest is read); a
            `datasets.save_to_disk` folder (a `Dataset`, or a `DatasetDict` from which `split` picks `split_name`,
            else "train", or "eval"/"validation"/"test"); `builtin:<task>` (the task's training split for
            split="train", its held-out split for split="eval"); or a Hugging Face Hub dataset id `org/name`
            (`hub.snapshot`, then `datasets.load_dataset(folder, config_name, split=split_name)`; TRL's
            dataset_name). A local path may hold `{date}`, replaced by the run date (`dataset_source`).
        split: "train" or "eval". For files, which hold one split, it is ignored.
        seed: seeds the builtin task's training items; ignored otherwise.
        config_name: the hub dataset's configuration (TRL `dataset_config`).
        split_name: the split to read (TRL `dataset_train_split` / `dataset_test_split`); None: "train" for
            split="train", "test" for split="eval" on the hub.
        system_prompt: put before every prompt as a system message (`with_system_prompt`).
        when: the date `{date}` stands for; None: today's date in UTC (`dataset_source.run_date()`, the clock:
            `async-grpo train` has no scheduled time; the pipeline's prepare_dataset passes the KFP run's).

    Rows without a `prompt` column in GSM8K (question/answer) or MATH (problem/solution) layout become prompt +
    answer + solution (`tasks.math_reasoning.to_prompt_rows`).

    Returns:
        datasets.Dataset with a `prompt` column (each a string, or a list of {"role", "content"}
        message dicts) and any other columns for the reward functions.

    Raises:
        FileNotFoundError: the path does not exist (after `{date}`; the message gives the resolved path).
        ValueError: unsupported spec, unknown builtin task, a folder with no data file, missing or malformed
            `prompt` column, a reserved column name, or an empty dataset; the message names the field and the fix.
    """
    if split not in _SPLIT_NAMES:
        raise ValueError(f"split={split!r} must be 'train' or 'eval'.")
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"dataset spec {spec!r} must be a non-empty string. Fix: give a file, folder or builtin:<task>."
        )
    if spec.startswith(BUILTIN_PREFIX):
        ds = _load_builtin(spec[len(BUILTIN_PREFIX) :], split, seed)
    elif hub.looks_like_repo_id(spec):
        ds = _load_hub(spec, config_name, split_name or ("train" if split == "train" else "test"))
    else:
        source = dataset_source.resolve_local_path(spec, when or dataset_source.run_date())
        if source.path != source.spec:
            logger.info("dataset %s", source.describe())
        spec = source.path
        ds = _load_path(spec, split, split_name)
    if math_reasoning.row_format(ds.column_names):
        ds = math_reasoning.to_prompt_rows(ds)
    if system_prompt:
        ds = ds.map(lambda row: {"prompt": with_system_prompt(row["prompt"], system_prompt)})
    validate_prompt_dataset(ds, spec)
    return ds


def _load_hub(repo_id: str, config_name: str | None, split_name: str) -> datasets.Dataset:
    """A split of a hub dataset, read from its snapshot in the HF cache (downloaded when the hub is reachable).

    In a cluster pod (`hub.on_cluster`), whose files include the pod's ServiceAccount token and whose environment
    may hold HF_TOKEN, the dataset card is not followed: its `configs` may name any local path as data files (a
    workspace symlink to a secret) and reader options that turn any file into rows. There the data files are the
    ones this process picks in a private download (`hub.pinned_data_files`: the hub's standard layout, or its
    parquet export; links leaving the download refused), read with no reader option.

    Raises:
        hub.HubUnavailable: neither the hub nor the cache has it.
        hub.UnsafeSnapshotFile: in a pod, the download holds a link that leaves it.
        ValueError: the configuration or split does not exist (datasets' message, with the fix).
    """
    import datasets

    if hub.on_cluster():
        builder, files = hub.pinned_data_files(repo_id, config_name, split_name)
        logger.info("dataset %s (%s, %s): %d %s file(s) picked in the download", repo_id, config_name, split_name,
                    len(files), builder)  # fmt: skip
        try:
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        except Exception as err:  # the readers raise many types; name the dataset either way
            raise ValueError(
                f"dataset {repo_id!r} (config {config_name!r}, split {split_name!r}): could not read its {builder} "
                f"files: {err}. Fix: check the repository's data files."
            ) from err
    folder = hub.snapshot(repo_id, repo_type="dataset")
    try:
        return datasets.load_dataset(str(folder), name=config_name, split=split_name)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise ValueError(
            f"dataset {repo_id!r} (config {config_name!r}, split {split_name!r}): {err}. Fix: check "
            "dataset_config and dataset_train_split / dataset_test_split against the dataset card."
        ) from err


def with_system_prompt(prompt: Any, system_prompt: str) -> list[dict[str, str]]:
    """`prompt` with `system_prompt` first: a string becomes [system, user]; a message list without a system
    message gets one in front; one that has a system message is kept as is."""
    system = {"role": "system", "content": system_prompt}
    if isinstance(prompt, str):
        return [system, {"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]
    return messages if messages and messages[0].get("role") == "system" else [system, *messages]


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


def _load_path(spec: str, split: Split, split_name: str | None = None) -> datasets.Dataset:
    """An existing file or `save_to_disk` folder (`dataset_source.resolve_local_path` resolved it)."""
    import datasets

    path = Path(spec)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(
                f"dataset {spec!r} is a folder but not a datasets.save_to_disk folder ({err}). "
                f"Fix: save it with Dataset.save_to_disk, or point at a .jsonl/.json/.parquet file."
            ) from None
        return _pick_split(loaded, spec, split, split_name)
    loader = FILE_LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ValueError(
            f"dataset {spec!r}: unsupported file type {path.suffix!r}. "
            f"Fix: convert it to one of {sorted(FILE_LOADERS)}, or save it with Dataset.save_to_disk."
        )
    try:
        return datasets.load_dataset(loader, data_files=str(path), split="train")
    except Exception as err:  # the json/parquet readers raise many types; name the file either way
        cause = err.__cause__ or err.__context__  # datasets wraps the reader's own message (line, column)
        detail = f"{err} ({str(cause).strip()})" if cause is not None and str(cause).strip() else str(err)
        raise ValueError(
            f"dataset {spec!r}: could not read it as {loader}: {detail}. Fix: check the file's format."
        ) from err


def _pick_split(loaded: Any, spec: str, split: Split, split_name: str | None = None) -> datasets.Dataset:
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split_name in loaded:
        return loaded[split_name]
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
    string `role` (one of MESSAGE_ROLES) and `content` (conversational, as TRL).

    Raises:
        ValueError: the first problem found, naming the dataset, the row and the fix.
    """
    columns = list(ds.column_names)
    if "prompt" not in columns:
        raise ValueError(
            f"dataset {spec!r}: column 'prompt' missing; found columns {columns}. "
            f"Fix: rename your prompt column to 'prompt' (question/answer and problem/solution rows are converted)."
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
                f"of {{'role': ..., 'content': ...}} messages with string content and a role in {list(MESSAGE_ROLES)}."
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
        if msg["role"] not in MESSAGE_ROLES:
            return f"message {j} has role {msg['role']!r}, not one of {list(MESSAGE_ROLES)}"
    return None


def encode_prompt(
    tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """Token ids for one prompt, as the policy should see it before its completion.

    A string prompt is encoded without special tokens, except that a BOS token is prepended when the
    tokenizer adds one by default (Llama-style), matching what vLLM does for a text prompt. A
    conversational prompt goes through `apply_chat_template(add_generation_prompt=True, tokenize=True,
    **chat_template_kwargs)` (TRL `chat_template_kwargs`, e.g. enable_thinking=False).

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
        if (
            bos is not None
            and ids[:1] != [bos]
            and list(tokenizer.encode(prompt, add_special_tokens=True))[:1] == [bos]
        ):
            ids.insert(0, bos)
        return ids
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "encode_prompt: conversational prompt but the tokenizer has no chat_template. "
            "Fix: use a chat model's tokenizer, or give string prompts."
        )
    out = tokenizer.apply_chat_template(
        [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True, **dict(chat_template_kwargs or {})
    )
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]


def prompt_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """The non-prompt columns of one dataset row: the keyword arguments for the reward functions."""
    return {k: v for k, v in row.items() if k != "prompt"}


@dataclass
class PromptItem:
    """One dataset row, tokenized.

    Attributes:
        prompt: the row's `prompt` as given (a string, or a list of chat messages).
        prompt_ids: (P,) token ids exactly as sent to vLLM (`encode_prompt`).
        columns: the row's other fields (reward-function keyword arguments).
    """

    prompt: object
    prompt_ids: list[int]
    columns: dict


def load_prompt_items(
    tokenizer: Any,
    spec: str,
    split: Split,
    *,
    seed: int,
    max_prompt_length: int,
    limit: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    **dataset_options: Any,
) -> tuple[list[PromptItem], int]:
    """Load, validate and tokenize a prompt dataset (`load_prompt_dataset`), keeping prompts of at most
    `max_prompt_length` tokens.

    Args:
        tokenizer: the policy's tokenizer.
        spec, split, seed: as `load_prompt_dataset`.
        max_prompt_length: longest prompt kept (tokens).
        limit: keep only the first this-many rows (before the length filter); None keeps all.
        chat_template_kwargs: as `encode_prompt`.
        dataset_options: config_name, split_name, system_prompt of `load_prompt_dataset`.

    Returns:
        (items, dropped): the usable prompts in dataset order, and how many were longer than
        `max_prompt_length` (the caller counts them as `prompt_too_long`).

    Raises:
        FileNotFoundError / ValueError: as `load_prompt_dataset`; ValueError also when no prompt is short enough.
    """
    ds = load_prompt_dataset(spec, split=split, seed=seed, **dataset_options)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    items: list[PromptItem] = []
    dropped = 0
    for row in ds:
        ids = encode_prompt(tokenizer, row["prompt"], chat_template_kwargs)
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        items.append(PromptItem(row["prompt"], ids, prompt_columns(row)))
    if not items:
        raise ValueError(
            f"dataset {spec!r} ({split}): no prompt fits max_prompt_length={max_prompt_length} tokens. "
            "Fix: raise max_prompt_length, or shorten the prompts."
        )
    return items, dropped


class PromptSampler:
    """Endless, seeded, resumable order over `items`: every item once per epoch, reshuffled each epoch (in
    dataset order every epoch with `shuffle=False`, TRL `shuffle_dataset`).

    The order is that of one `random.Random(seed)` shuffling `range(len(items))` at the start of every epoch.
    `state_dict()` captures the position (epoch, index, the epoch's order and the RNG), so a sampler restored
    with `load_state_dict` continues with exactly the prompts the original would have produced next.

    Args:
        items: the prompts (not copied; must not change while sampling).
        seed: shuffling seed.
        shuffle: False keeps the dataset order.

    Raises:
        ValueError: `items` is empty.
    """

    def __init__(self, items: Sequence[PromptItem], seed: int, shuffle: bool = True):
        if not items:
            raise ValueError("PromptSampler: no prompts. Fix: check the dataset and max_prompt_length.")
        self.items = items
        self.shuffle = shuffle
        self._rng = random.Random(seed)
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            self._rng.shuffle(order)
        return order

    def __iter__(self) -> Iterator[PromptItem]:
        return self

    def __next__(self) -> PromptItem:
        if self.index == len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled()
        item = self.items[self._order[self.index]]
        self.index += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        """The position: `epoch`, `index` (items taken this epoch), `order` and the RNG state (picklable)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "order": list(self._order),
            "rng": self._rng.getstate(),
            "num_items": len(self.items),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` position.

        Raises:
            ValueError: the state was taken over a different number of items (another dataset).
        """
        if state["num_items"] != len(self.items):
            raise ValueError(
                f"PromptSampler: the saved position covers {state['num_items']} prompts, this dataset "
                f"has {len(self.items)}. Fix: resume with the dataset and max_prompt_length of the run."
            )
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), list(state["order"])
        self._rng.setstate(state["rng"])
