"""Preflight checks that read only the config and this machine: no dataset, no network.

Each returns a list of `Problem`s (empty when fine).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from async_grpo import hub
from async_grpo.config import GRPOConfig
from async_grpo.preflight.report import Problem

# `vllm serve` flags the launcher sets itself (`inference.server.build_server_command`, `GRPOConfig.vllm_serve_args`):
# vllm_extra_args come last on the command line, so one of these would silently replace a validated value.
# flag -> the config field to set instead (None: the launcher owns it, with the reason).
OWNED_FLAGS: dict[str, tuple[str | None, str]] = {
    "--model": ("model_name_or_path", "the trainer and vLLM must load the same folder"),
    "--host": (None, "the launcher binds the server"),
    "--port": ("inference.vllm_port", "the launcher connects to this port"),
    "--dtype": ("inference.vllm_dtype", ""),
    "--max-model-len": ("inference.vllm_max_model_len", "it is checked against the prompt and completion lengths"),
    "--max-model-length": ("inference.vllm_max_model_len", ""),
    "--seed": ("seed", "one seed drives data order, model init and sampling"),
    "--served-model-name": (None, "the trainer addresses the model by its folder"),
    "--logprobs-mode": (None, "the importance-sampling ratio needs processed_logprobs"),
    "--weight-transfer-config": ("weight_sync.weight_sync_backend", "weight pushes use this backend"),
    "--worker-extension-cls": ("weight_sync.weight_sync_backend", "the gloo weight push installs its own extension"),
    "--enable-chunked-prefill": (
        None,
        "on the CPU build a split prefill of a seeded request crashes the engine, so "
        "the launcher turns it off there; elsewhere it is vLLM's default",
    ),
}
# Flags that a config field also sets: refused when that field is set too (two values for one knob).
FIELD_FLAGS: dict[str, str] = {
    "--gpu-memory-utilization": "inference.vllm_gpu_memory_utilization",
    "--tensor-parallel-size": "inference.vllm_tensor_parallel_size",
    "-tp": "inference.vllm_tensor_parallel_size",
    "--trust-remote-code": "trust_remote_code",
}


def _flag_name(arg: str) -> str | None:
    """`--max_model_len=512` -> `--max-model-len` (vLLM accepts underscores); None for a value."""
    if not arg.startswith("-") or arg.lstrip("-")[:1].isdigit():
        return None
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def check_vllm_extra_args(config: GRPOConfig) -> list[Problem]:
    """Refuse `vllm_extra_args` that override a flag the launcher sets from a validated field (`--max-model-len`,
    `--dtype`, `--port`, `--seed`, `--served-model-name`, the weight-transfer flags...), naming the field to use
    instead, and flags given both there and through their own field."""
    problems = []
    set_fields = {
        "inference.vllm_gpu_memory_utilization": config.inference.vllm_gpu_memory_utilization is not None,
        "inference.vllm_tensor_parallel_size": config.inference.vllm_tensor_parallel_size > 1,
        "trust_remote_code": config.trust_remote_code,
    }
    for arg in config.inference.vllm_extra_args:
        flag = _flag_name(arg)
        if flag in OWNED_FLAGS:
            target, why = OWNED_FLAGS[flag]
            reason = f" ({why})" if why else ""
            fix = (
                f"remove {flag} from vllm_extra_args and set {target} instead"
                if target
                else f"remove {flag} from vllm_extra_args; the launcher sets it"
            )
            problems.append(
                Problem(
                    "inference.vllm_extra_args",
                    f"{arg!r} overrides a flag the launcher sets from the validated config{reason}",
                    fix,
                )
            )
        elif flag in FIELD_FLAGS and set_fields[FIELD_FLAGS[flag]]:
            problems.append(
                Problem(
                    "inference.vllm_extra_args",
                    f"{arg!r} is also set by {FIELD_FLAGS[flag]}",
                    f"keep only {FIELD_FLAGS[flag]}",
                )
            )
        elif flag == "--trust-remote-code":
            problems.append(
                Problem(
                    "inference.vllm_extra_args",
                    "'--trust-remote-code' lets vLLM run the model's "
                    "code while the trainer does not (trust_remote_code is false)",
                    "remove it and set trust_remote_code: true",
                )
            )
    return problems


def check_warm_start(config: GRPOConfig) -> list[Problem]:
    """warmup_sft_steps > 0 needs a builtin task: the warm start trains on the task's reference answers."""
    data = config.data
    if data.warmup_sft_steps and not data.dataset.startswith("builtin:"):
        return [
            Problem(
                "data.warmup_sft_steps",
                f"warmup_sft_steps={data.warmup_sft_steps} needs a builtin dataset "
                f"(the warm start trains on a builtin task's reference answers), but dataset is "
                f"{data.dataset!r}",
                "set warmup_sft_steps: 0, or use dataset: builtin:<task>",
            )
        ]
    return []


def check_lengths(config: GRPOConfig) -> list[Problem]:
    """A kept prompt (up to max_prompt_length tokens) plus a full completion must fit in vllm_max_model_len, or
    vLLM refuses the request in the middle of the run."""
    prompt, completion = config.data.max_prompt_length, config.sampling.max_completion_length
    limit = config.inference.vllm_max_model_len
    if prompt + completion > limit:
        return [
            Problem(
                "inference.vllm_max_model_len",
                f"max_prompt_length={prompt} + max_completion_length="
                f"{completion} = {prompt + completion} tokens do not fit in vllm_max_model_len={limit}",
                f"raise vllm_max_model_len to at least {prompt + completion}, or lower max_prompt_length "
                f"to {max(1, limit - completion)}",
            )
        ]
    return []


def check_weight_sync_device(config: GRPOConfig) -> list[Problem]:
    """weight_sync_backend=nccl needs CUDA on this machine, and weight_sync_mode=delta needs the gloo data plane
    that `auto` picks without CUDA (local target only: on a cluster the trainer runs on the GPU nodes)."""
    import torch

    sync = config.weight_sync
    if sync.weight_sync_mode == "delta" and sync.weight_sync_backend == "auto" and torch.cuda.is_available():
        return [
            Problem(
                "weight_sync.weight_sync_mode",
                "delta needs the gloo data plane, and weight_sync_backend: auto picks nccl on this CUDA machine",
                "set weight_sync_backend: gloo, or weight_sync_mode: full",
            )
        ]
    if sync.weight_sync_backend != "nccl" or torch.cuda.is_available():
        return []
    return [
        Problem(
            "weight_sync.weight_sync_backend",
            "nccl needs a CUDA GPU, and this machine has none",
            "set weight_sync_backend: auto (gloo on CPU) or gloo, or run on a GPU machine",
        )
    ]


def check_vllm_replicas(config: GRPOConfig) -> list[Problem]:
    """A comma-separated `vllm_url` must list exactly `vllm_replicas` servers (one URL may instead be a host name
    that resolves to every replica, checked when the run starts: `inference.replicas.replica_urls`)."""
    inf = config.inference
    urls = [u for u in (inf.vllm_url or "").split(",") if u.strip()]
    if len(urls) > 1 and len(urls) != inf.vllm_replicas:
        return [
            Problem(
                "inference.vllm_url",
                f"lists {len(urls)} vLLM servers but vllm_replicas={inf.vllm_replicas}",
                f"set vllm_replicas: {len(urls)}, or list exactly {inf.vllm_replicas} URLs",
            )
        ]
    return []


def writable_folder_problem(path: str | Path, field: str) -> Problem | None:
    """None when `path` is a folder this process can create files in (or can be created as one); else the
    problem. Nothing is created: a temporary file in the nearest existing folder is opened and removed."""
    p = Path(path).expanduser().absolute()
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is" if existing == p else f"would be inside {str(existing)!r}, which is"
        return Problem(field, f"{str(p)!r} {where} a file, not a folder", "point it at a folder you can write to")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return Problem(
            field,
            f"{str(p)!r} is not writable ({err.strerror or err})",
            "point it at a folder you can write to, or fix its permissions",
        )
    return None


def check_output_dir(config: GRPOConfig) -> list[Problem]:
    """output_dir must be (or become) a folder this process can write: the run writes its config, logs, model and
    (by default) its MLflow store there."""
    problem = writable_folder_problem(config.output_dir, "output_dir")
    return [problem] if problem else []


def check_resume_checkpoint(config: GRPOConfig) -> list[Problem]:
    """A `resume_from_checkpoint` path must be a complete checkpoint folder (`checkpoint_layout.resolve_resume`, the
    rule the run applies when it starts) of this version's checkpoint format (`checkpoint_layout.format_mismatch`,
    from its meta.json); `true` with no checkpoint yet starts fresh, as at launch."""
    from async_grpo.checkpoint_layout import format_mismatch, resolve_resume

    try:
        path = resolve_resume(config.checkpoint.resume_from_checkpoint, config.output_dir)
    except FileNotFoundError as err:  # its message names the field and ends with the fix
        return [Problem("checkpoint.resume_from_checkpoint", str(err))]
    mismatch = None if path is None else format_mismatch(path)
    return [Problem("checkpoint.resume_from_checkpoint", mismatch)] if mismatch else []


def check_model(config: GRPOConfig) -> tuple[list[Problem], str | None]:
    """model_name_or_path must be `builtin:tiny`, a local Hugging Face folder (with config.json), a hub id
    (`org/name`, resolved at launch; not checked here) or an MLflow registry URI (`models:/<name>@<alias>`,
    `models:/<name>/<version>`: its syntax is checked here, the version at launch). Returns (problems, a skip note for a hub id)."""
    name = config.model_name_or_path
    if name == "builtin:tiny":
        return [], None
    if name.startswith(
        "models:/"
    ):  # the MLflow registry: resolved by `registry_start.resolve_registry_start` at launch
        from async_grpo.lifecycle.registry import RegistryError, parse_model_uri

        try:
            parse_model_uri(name)
        except RegistryError as err:
            return [Problem("model_name_or_path", str(err))], None  # its message ends with the fix
        return [], f"model: {name!r} is an MLflow registry URI, downloaded at launch"
    if name.startswith("builtin:"):
        return [
            Problem(
                "model_name_or_path",
                f"{name!r} is no builtin model",
                "use builtin:tiny, a local model folder or a hub id (org/name)",
            )
        ], None
    if hub.looks_like_repo_id(name):
        return [], f"model: {name!r} is a hub id, resolved through the HF cache at launch"
    path = Path(name).expanduser()
    if not path.exists():
        return [
            Problem(
                "model_name_or_path",
                f"{name!r} does not exist and is not a hub id (org/name)",
                "point it at a saved Hugging Face model folder, give a hub id, or use builtin:tiny",
            )
        ], None
    if not (path / "config.json").is_file():
        return [
            Problem(
                "model_name_or_path",
                f"{name!r} is not a Hugging Face model folder (no config.json)",
                "point it at a folder saved with save_pretrained, or use builtin:tiny",
            )
        ], None
    return [], None
