"""`prepare_dataset`: load the prompts once, validate them, split off held-out prompts, write one Dataset artifact.

Validating here, in a cheap step, means a bad column or a missing chat template fails the run before
any GPU or vLLM server is requested; the artifact (a `datasets.save_to_disk` DatasetDict with
`train` and `eval` splits) is what training and evaluation both read, so they see the same split.
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
) -> NamedTuple("PrepareOutputs", [("train_rows", int), ("eval_rows", int), ("prompt_format", str)]):
    """Load, validate and split the prompt dataset into a `train`/`eval` DatasetDict artifact.

    Args:
        dataset_uri: a Hugging Face Hub dataset id (`openai/gsm8k`; read through the HF cache, downloaded when the
            hub is reachable, with HF_TOKEN for gated ones), a `.jsonl`/`.json`/`.parquet` file, a
            `datasets.save_to_disk` folder (a `file://` URI is accepted), or `builtin:<task>`. On a cluster, put
            files on the workspace volume. GSM8K (question/answer) and MATH (problem/solution) rows become
            `prompt` + `answer` + `solution` (`async_grpo.tasks.math_reasoning`).
        dataset: output Dataset artifact; metadata records `source`, `eval_source`, row counts and
            `prompt_format`.
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

    Returns:
        train_rows, eval_rows, and prompt_format ("standard" or "conversational").

    Raises:
        FileNotFoundError: the dataset path does not exist.
        ValueError: also, in a cluster pod, a dataset path off the workspace volume (checked before reading it).
        ValueError: unsupported spec, bad `prompt` column, no chat template for conversational
            prompts, an impossible split, or every prompt too long; each message names the fix.
    """
    import logging
    from collections import namedtuple

    from async_grpo import hub
    from async_grpo.data import encode_prompt, load_prompt_dataset
    from async_grpo.launch.k8s_policy import in_cluster_pod, work_dir_problems

    log = logging.getLogger("prepare_dataset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def local_spec(uri: str) -> str:
        spec = uri[len("file://") :] if uri.startswith("file://") else uri
        local_path = not spec.startswith("builtin:") and not hub.looks_like_repo_id(spec)
        if local_path and in_cluster_pod() and work_dir_problems(spec):  # this pod holds HF_TOKEN: no other files
            raise ValueError(
                f"dataset {spec!r}: in a cluster pod a dataset file must be a normalized path on the "
                "workspace volume (/workspace/...). Fix: copy it there."
            )
        return spec

    source = local_spec(dataset_uri)
    options = {"config_name": dataset_config or None, "system_prompt": system_prompt or None}
    train = load_prompt_dataset(source, split="train", seed=seed, split_name=dataset_train_split, **options)
    held_out = None
    if eval_dataset_uri:
        eval_source = local_spec(eval_dataset_uri)
        held_out = load_prompt_dataset(eval_source, split="eval", seed=seed, system_prompt=system_prompt or None)
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
    dataset.metadata.update({
        "source": source, "eval_source": eval_source, "train_rows": len(train), "eval_rows": len(held_out),
        "prompt_format": prompt_format, "columns": list(train.column_names), "too_long_prompts": too_long,
    })  # fmt: skip
    log.info(
        "dataset %s: %d train / %d held-out prompts (%s) -> %s",
        source,
        len(train),
        len(held_out),
        prompt_format,
        dataset.path,
    )
    outputs = namedtuple("PrepareOutputs", ["train_rows", "eval_rows", "prompt_format"])
    return outputs(len(train), len(held_out), prompt_format)
