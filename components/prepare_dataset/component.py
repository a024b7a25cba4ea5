"""`prepare_dataset`: load the prompts once, validate them, split off held-out prompts, write one Dataset artifact.

Validating here, in a cheap step, means a bad column or a missing chat template fails the run before
any GPU or vLLM server is requested; the artifact (a `datasets.save_to_disk` DatasetDict with
`train` and `eval` splits) is what training and evaluation both read, so they see the same split.
This step also decides which data a recurring run reads (`{date}` paths, newest-file folders:
`async_grpo.dataset_source`) and records it with a content digest per split.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Output

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def prepare_dataset(
    dataset_uri: str,
    dataset: Output[Dataset],
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
) -> NamedTuple(
    "PrepareOutputs",
    [("train_rows", int), ("eval_rows", int), ("prompt_format", str), ("resolved_uri", str), ("train_digest", str)],
):
    """Load, validate and split the prompt dataset into a `train`/`eval` DatasetDict artifact.

    Args:
        dataset_uri: a Hugging Face Hub dataset id (`openai/gsm8k`; read through the HF cache, downloaded when the
            hub is reachable, with HF_TOKEN for gated ones), a `.jsonl`/`.json`/`.parquet` file, a
            `datasets.save_to_disk` folder (a `file://` URI is accepted), a folder of data files (the newest by
            modification time is read, ties to the greater name; names starting with `.` are skipped), or
            `builtin:<task>`. A path may hold `{date}`: the run date, YYYY-MM-DD, in UTC (see
            `schedule_time_utc`). On a cluster, put files on the workspace volume (checked on the path as given and
            as resolved); a hub dataset is downloaded into a folder of this step's own and read from the data files
            the step picks there by the hub's standard layout, never from what its card's `configs` name. GSM8K
            (question/answer) and MATH (problem/solution) rows become `prompt` + `answer` + `solution`
            (`async_grpo.tasks.math_reasoning`).
        dataset: output Dataset artifact; metadata records `source`, `eval_source`, row counts, `prompt_format`,
            `resolved_uri` / `eval_resolved_uri` (the data read), `run_date`, `date_source`, and `train_digest` /
            `eval_digest` (`dataset_source.rows_digest` of each saved split); the folder holds `digests.json` with
            the same record (`dataset_source.DatasetRecord`), which the trainer logs to MLflow.
        eval_dataset_uri: held-out prompts in the same formats. Empty: a builtin task's own held-out
            split, a hub dataset's `dataset_test_split` when it has one, or else `eval_fraction` of the training
            rows (seeded).
        eval_fraction: share of training rows held out when no eval set is given, in (0, 0.5].
        model_name_or_path: the policy model (a folder, a hub id, or `builtin:tiny`); its tokenizer must
            have a chat template when prompts are conversational. Empty skips tokenizer checks.
        max_prompt_length: when > 0, count prompts longer than this many tokens (training drops them)
            and fail if none is short enough.
        seed: seeds a builtin task's training rows and the held-out split.
        dataset_config: the hub dataset's configuration (TRL `dataset_config`, e.g. `main`); empty: none.
        system_prompt: a system message put before every prompt (string prompts become conversational); empty:
            none.
        dataset_train_split, dataset_test_split: the hub dataset's splits (TRL ScriptArguments names).
        schedule_time_utc: the KFP run's scheduled time (the pipeline passes
            `dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER`); its UTC date is what `{date}` stands for.
        create_time_utc: the KFP run's creation time (`dsl.PIPELINE_JOB_CREATE_TIME_UTC_PLACEHOLDER`), used when
            there is no scheduled time; without either (empty, or a placeholder the backend left unsubstituted)
            the clock's UTC date is used. The log and `date_source` say which (`dataset_source.run_date`).

    Returns:
        train_rows, eval_rows, prompt_format ("standard" or "conversational"), resolved_uri (the training data
        read) and train_digest (64 hex characters).

    Raises:
        FileNotFoundError: the dataset path does not exist (with `{date}`: the message gives the resolved path and
            where the date came from).
        ValueError: also, in a cluster pod, a dataset path or a tokenizer folder (`model_name_or_path`) off the
            workspace volume, checked before reading it and before the hub token is loaded; a hub dataset's
            snapshot holding a link that leaves it (`hub.UnsafeSnapshotFile`), or one without data files for the
            config and split in the hub's standard layout (in a pod the card's `configs` are ignored:
            `hub.pinned_data_files`).
        ValueError: a folder with no data file, or a schedule/create time that is not an ISO 8601 timestamp.
        ValueError: unsupported spec, bad `prompt` column, no chat template for conversational
            prompts, an impossible split, or every prompt too long; each message names the fix.
    """
    import logging
    from collections import namedtuple

    from async_grpo import dataset_source, hub
    from async_grpo.data import encode_prompt, load_prompt_dataset
    from async_grpo.launch.k8s_policy import in_cluster_pod, work_dir_problems
    from async_grpo.step_secrets import load_step_secrets

    log = logging.getLogger("prepare_dataset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    when = dataset_source.run_date(schedule_time_utc, create_time_utc)
    log.info("run date %s (from %s; {date} in a dataset path stands for it)", when.text, when.source)

    def on_volume(spec: str, given: str) -> None:
        if in_cluster_pod() and work_dir_problems(spec):  # this pod holds HF_TOKEN: no other files
            raise ValueError(
                f"dataset {given!r}"
                + (f" (resolved to {spec!r})" if spec != given else "")
                + ": in a cluster pod a dataset file must be a normalized path on the workspace volume "
                "(/workspace/...). Fix: copy it there."
            )

    def local_spec(uri: str) -> str:
        """The file or saved folder `uri` names for this run (hub ids and builtin tasks unchanged), on the volume."""
        spec = uri.removeprefix("file://")
        if spec.startswith("builtin:") or hub.looks_like_repo_id(spec):
            return spec
        on_volume(dataset_source.substitute_date(spec, when), spec)  # before listing or reading anything
        resolved = dataset_source.resolve_local_path(spec, when)
        on_volume(resolved.path, spec)
        if resolved.path != spec:
            log.info("dataset %s", resolved.describe())
        return resolved.path

    source = local_spec(dataset_uri)  # what is read: `{date}` replaced, a folder's newest file
    eval_resolved = local_spec(eval_dataset_uri) if eval_dataset_uri else source
    model_spec = model_name_or_path
    local_model = model_spec and not model_spec.startswith("builtin:") and not hub.looks_like_repo_id(model_spec)
    if in_cluster_pod() and local_model and work_dir_problems(model_spec):  # the tokenizer's files: on the volume
        raise ValueError(
            f"model_name_or_path={model_spec!r}: in a cluster pod the tokenizer's folder must be a normalized path "
            "on the workspace volume (/workspace/...), builtin:tiny or a hub id. Fix: copy it there."
        )
    # Every path is decided: only now the hub token (HF_TOKEN, for gated hub datasets) enters this process.
    load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands
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
            log.warning(
                "dataset %s has no usable %r split (%s); holding out %g of the training rows",
                source,
                dataset_test_split,
                str(err).splitlines()[0],
                eval_fraction,
            )
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
    too_long = 0
    if model_name_or_path and (conversational or max_prompt_length > 0):
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
        lengths = [len(encode_prompt(tokenizer, p)) for p in list(train["prompt"])]
        if max_prompt_length > 0:
            too_long = sum(n > max_prompt_length for n in lengths)
            if too_long == len(lengths):
                raise ValueError(
                    f"every prompt of {source!r} is longer than max_prompt_length={max_prompt_length} tokens "
                    f"(shortest: {min(lengths)}). Fix: raise max_prompt_length or shorten the prompts."
                )
            if too_long:
                log.warning(
                    "%d of %d training prompts exceed %d tokens; training drops them",
                    too_long,
                    len(lengths),
                    max_prompt_length,
                )

    import datasets

    datasets.DatasetDict({"train": train, "eval": held_out}).save_to_disk(dataset.path)
    record = dataset_source.DatasetRecord(
        resolved_uri=source, eval_resolved_uri=eval_resolved, run_date=when.text, date_source=when.source,
        train_digest=dataset_source.rows_digest(train), eval_digest=dataset_source.rows_digest(held_out),
    )  # fmt: skip
    record.write(dataset.path)  # the trainer reads the folder, not KFP metadata
    dataset.metadata.update({
        "source": dataset_uri.removeprefix("file://"), "eval_source": eval_source, "train_rows": len(train),
        "eval_rows": len(held_out), "prompt_format": prompt_format, "columns": list(train.column_names),
        "too_long_prompts": too_long,
        "resolved_uri": record.resolved_uri, "eval_resolved_uri": record.eval_resolved_uri,
        "run_date": record.run_date, "date_source": record.date_source,
        "train_digest": record.train_digest, "eval_digest": record.eval_digest,
    })  # fmt: skip
    log.info(
        "dataset %s: %d train / %d held-out prompts (%s; train digest %s) -> %s",
        source,
        len(train),
        len(held_out),
        prompt_format,
        record.train_digest[:12],
        dataset.path,
    )
    outputs = namedtuple("PrepareOutputs", ["train_rows", "eval_rows", "prompt_format", "resolved_uri", "train_digest"])
    return outputs(len(train), len(held_out), prompt_format, record.resolved_uri, record.train_digest)
