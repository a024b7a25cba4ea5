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

    from async_grpo.launch.prepare_step import run_prepare_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run_prepare_step(
        dataset_uri=dataset_uri, output_path=dataset.path, eval_dataset_uri=eval_dataset_uri,
        eval_fraction=eval_fraction, model_name_or_path=model_name_or_path, max_prompt_length=max_prompt_length,
        seed=seed, dataset_config=dataset_config, system_prompt=system_prompt,
        dataset_train_split=dataset_train_split, dataset_test_split=dataset_test_split,
        schedule_time_utc=schedule_time_utc, create_time_utc=create_time_utc,
    )  # fmt: skip
    dataset.metadata.update(result.metadata)
    outputs = namedtuple("PrepareOutputs", ["train_rows", "eval_rows", "prompt_format", "resolved_uri", "train_digest"])
    return outputs(result.train_rows, result.eval_rows, result.prompt_format, result.resolved_uri, result.train_digest)
