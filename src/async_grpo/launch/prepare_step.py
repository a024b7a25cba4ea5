"""The pipeline's dataset step: load the prompts once, validate them, split off held-out prompts, save one
`train`/`eval` DatasetDict; the body of `components/prepare_dataset` (whose docstrings tell the design), as a package
function.

The order is the step's security contract. This step holds HF_TOKEN (for gated hub datasets), so every path it will
read is decided first: in a cluster pod a dataset file and a tokenizer folder must lie on the workspace volume, checked
on the path as given, with `{date}` substituted, and as resolved (a folder's newest file); only then are the step's
Secrets loaded (`step_secrets.load_step_secrets`) and the data read.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import datasets

from async_grpo import dataset_source, hub, step_secrets
from async_grpo.data import encode_prompt, load_prompt_dataset
from async_grpo.launch.k8s_policy import in_cluster_pod, work_dir_problems

logger = logging.getLogger(__name__)


class PrepareStepResult(NamedTuple):
    """What the dataset step saved and what its Dataset artifact records.

    Attributes:
        train_rows, eval_rows: rows in the saved `train` and `eval` splits.
        prompt_format: "conversational" when any of the first 64 prompts of either split is a message list, else
            "standard" (TRL's dataset-format names).
        resolved_uri: the training data read (`{date}` substituted, a folder's newest file).
        train_digest: `dataset_source.rows_digest` of the saved `train` split, 64 hex characters.
        metadata: the Dataset artifact's metadata (`components/prepare_dataset` lists its keys).
    """

    train_rows: int
    eval_rows: int
    prompt_format: str
    resolved_uri: str
    train_digest: str
    metadata: dict[str, Any]


def _refuse_off_volume(spec: str, given: str) -> None:
    """In a cluster pod (which holds HF_TOKEN: no other files), refuse a dataset path off the workspace volume.

    Raises:
        ValueError: `spec` is not a normalized path under the workspace volume; the message names `given` and, when
            they differ, `spec`.
    """
    if in_cluster_pod() and work_dir_problems(spec):
        raise ValueError(
            f"dataset {given!r}"
            + (f" (resolved to {spec!r})" if spec != given else "")
            + ": in a cluster pod a dataset file must be a normalized path on the workspace volume "
            "(/workspace/...). Fix: copy it there."
        )


def resolve_dataset_path(uri: str, when: dataset_source.RunDate) -> str:
    """The file or saved folder `uri` names for this run, checked against the volume rule before anything is read.

    Args:
        uri: the step's `dataset_uri` or `eval_dataset_uri`; a `file://` prefix is dropped. Hub ids and `builtin:`
            tasks are returned unchanged.
        when: the run date that `{date}` stands for (`dataset_source.run_date`).

    Returns:
        The path read: `{date}` substituted, and for a folder of data files its newest file
        (`dataset_source.resolve_local_path`).

    Raises:
        ValueError: in a cluster pod, the path (with the date substituted, or as resolved) is off the workspace
            volume; checked before the folder is listed; or a folder holds no data file.
        FileNotFoundError: the path does not exist.
    """
    spec = uri.removeprefix("file://")
    if spec.startswith("builtin:") or hub.looks_like_repo_id(spec):
        return spec
    _refuse_off_volume(dataset_source.substitute_date(spec, when), spec)  # before listing or reading anything
    resolved = dataset_source.resolve_local_path(spec, when)
    _refuse_off_volume(resolved.path, spec)
    if resolved.path != spec:
        logger.info("dataset %s", resolved.describe())
    return resolved.path


def check_tokenizer_path(model_name_or_path: str) -> None:
    """In a cluster pod, a local tokenizer folder must lie on the workspace volume (`builtin:tiny` and hub ids pass).

    Raises:
        ValueError: naming `model_name_or_path` and the fix.
    """
    spec = model_name_or_path
    local = spec and not spec.startswith("builtin:") and not hub.looks_like_repo_id(spec)
    if in_cluster_pod() and local and work_dir_problems(spec):
        raise ValueError(
            f"model_name_or_path={spec!r}: in a cluster pod the tokenizer's folder must be a normalized path "
            "on the workspace volume (/workspace/...), builtin:tiny or a hub id. Fix: copy it there."
        )


def count_too_long_prompts(
    train: datasets.Dataset, *, source: str, model_name_or_path: str, conversational: bool, max_prompt_length: int
) -> int:
    """Check the prompts against the policy's tokenizer: a chat template for conversational prompts, and lengths.

    Args:
        train: the training split, with a `prompt` column.
        source: the dataset read, for messages.
        model_name_or_path: the policy model (`builtin:tiny`, a folder or a hub id); "" skips every check.
        conversational: whether the prompts are message lists.
        max_prompt_length: tokens; when > 0, prompts longer than this are counted (training drops them).

    Returns:
        The number of training prompts longer than `max_prompt_length` tokens (0 when unchecked).

    Raises:
        ValueError: conversational prompts and a tokenizer without `chat_template`, or every prompt too long; each
            names the fix.
    """
    if not model_name_or_path or not (conversational or max_prompt_length > 0):
        return 0
    if model_name_or_path == "builtin:tiny":
        from async_grpo.tiny_model import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    if conversational and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"dataset {source!r} has conversational prompts but the tokenizer of {model_name_or_path!r} has no "
            "chat_template. Fix: use a chat model, or give string prompts."
        )
    if max_prompt_length <= 0:
        return 0
    lengths = [len(encode_prompt(tokenizer, p)) for p in list(train["prompt"])]
    too_long = sum(n > max_prompt_length for n in lengths)
    if too_long == len(lengths):
        raise ValueError(
            f"every prompt of {source!r} is longer than max_prompt_length={max_prompt_length} tokens "
            f"(shortest: {min(lengths)}). Fix: raise max_prompt_length or shorten the prompts."
        )
    if too_long:
        logger.warning("%d of %d training prompts exceed %d tokens; training drops them", too_long, len(lengths),
                       max_prompt_length)  # fmt: skip
    return too_long


def run_prepare_step(
    *,
    dataset_uri: str,
    output_path: str,
    eval_dataset_uri: str = "",
    eval_fraction: float = 0.05,
    model_name_or_path: str = "",
    max_prompt_length: int = 0,
    seed: int = 0,
    dataset_config: str = "",
    system_prompt: str = "",
    dataset_train_split: str = "train",
    dataset_test_split: str = "test",
    schedule_time_utc: str = "",
    create_time_utc: str = "",
) -> PrepareStepResult:
    """Load, validate and split the prompt dataset; save it with its `digests.json` record under `output_path`.

    Args:
        dataset_uri, eval_dataset_uri, eval_fraction, model_name_or_path, max_prompt_length, seed, dataset_config,
            system_prompt, dataset_train_split, dataset_test_split, schedule_time_utc, create_time_utc: the
            component's parameters of the same names (`components/prepare_dataset`, whose docstring gives their
            meaning).
        output_path: the folder to save the DatasetDict (`datasets.save_to_disk`) and `digests.json` into.

    Returns:
        The saved splits' sizes, format, the data read, its digest, and the artifact's metadata.

    Raises:
        ValueError, FileNotFoundError: as `components/prepare_dataset` lists (paths off the volume in a pod, checked
            before the hub token is loaded; bad data, format, split or lengths).
    """
    when = dataset_source.run_date(schedule_time_utc, create_time_utc)
    logger.info("run date %s (from %s; {date} in a dataset path stands for it)", when.text, when.source)
    source = resolve_dataset_path(dataset_uri, when)  # what is read: `{date}` replaced, a folder's newest file
    eval_resolved = resolve_dataset_path(eval_dataset_uri, when) if eval_dataset_uri else source
    check_tokenizer_path(model_name_or_path)
    # Every path is decided: only now the hub token (HF_TOKEN, for gated hub datasets) enters this process.
    step_secrets.load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands
    options = {"config_name": dataset_config or None, "system_prompt": system_prompt or None, "when": when}
    train = load_prompt_dataset(source, split="train", seed=seed, split_name=dataset_train_split, **options)
    held_out = None
    if eval_dataset_uri:
        eval_source = eval_dataset_uri.removeprefix("file://")
        held_out = load_prompt_dataset(
            eval_resolved, split="eval", seed=seed, system_prompt=system_prompt or None, when=when
        )
    elif source.startswith("builtin:"):
        eval_source = source
        held_out = load_prompt_dataset(source, split="eval", seed=seed)
    elif hub.looks_like_repo_id(source):
        try:
            held_out = load_prompt_dataset(source, split="eval", seed=seed, split_name=dataset_test_split, **options)
            eval_source = f"{source} ({dataset_test_split})"
        except ValueError as err:  # no such split: hold out a fraction below
            logger.warning("dataset %s has no usable %r split (%s); holding out %g of the training rows", source,
                           dataset_test_split, str(err).splitlines()[0], eval_fraction)  # fmt: skip
    if held_out is None:
        if not 0.0 < eval_fraction <= 0.5:
            raise ValueError(
                f"eval_fraction={eval_fraction} must be in (0, 0.5] when no eval_dataset_uri is given. "
                "Fix: set eval_fraction (e.g. 0.05) or pass eval_dataset_uri."
            )
        if len(train) < 2:
            raise ValueError(f"dataset {source!r} has {len(train)} row(s); cannot hold any out. Fix: add prompts.")
        parts = train.train_test_split(test_size=eval_fraction, seed=seed, shuffle=True)
        train, held_out = parts["train"], parts["test"]
        eval_source = f"{source} (held-out {eval_fraction:g})"

    conversational = any(not isinstance(p, str) for p in train[:64]["prompt"] + held_out[:64]["prompt"])
    prompt_format = "conversational" if conversational else "standard"
    too_long = count_too_long_prompts(
        train, source=source, model_name_or_path=model_name_or_path, conversational=conversational,
        max_prompt_length=max_prompt_length,
    )  # fmt: skip

    datasets.DatasetDict({"train": train, "eval": held_out}).save_to_disk(output_path)
    record = dataset_source.DatasetRecord(
        resolved_uri=source, eval_resolved_uri=eval_resolved, run_date=when.text, date_source=when.source,
        train_digest=dataset_source.rows_digest(train), eval_digest=dataset_source.rows_digest(held_out),
    )  # fmt: skip
    record.write(output_path)  # the trainer reads the folder, not KFP metadata
    metadata = {
        "source": dataset_uri.removeprefix("file://"), "eval_source": eval_source, "train_rows": len(train),
        "eval_rows": len(held_out), "prompt_format": prompt_format, "columns": list(train.column_names),
        "too_long_prompts": too_long,
        "resolved_uri": record.resolved_uri, "eval_resolved_uri": record.eval_resolved_uri,
        "run_date": record.run_date, "date_source": record.date_source,
        "train_digest": record.train_digest, "eval_digest": record.eval_digest,
    }  # fmt: skip
    logger.info("dataset %s: %d train / %d held-out prompts (%s; train digest %s) -> %s", source, len(train),
                len(held_out), prompt_format, record.train_digest[:12], output_path)  # fmt: skip
    return PrepareStepResult(
        len(train), len(held_out), prompt_format, record.resolved_uri, record.train_digest, metadata
    )
