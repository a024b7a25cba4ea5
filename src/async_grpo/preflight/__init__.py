"""Preflight: every check that the config and the dataset alone allow, before vLLM, the reward pool or any
Kubernetes object exists.

`preflight(config, target=...)` runs the checks below and returns a `PreflightReport`; `report.raise_for_problems()`
raises `PreflightError` (a `ConfigError`: exit code 2 on the command line) with one line per problem, each naming
the field and the fix. `async-grpo validate` runs exactly this; `run_local` runs it first thing (target local),
`async-grpo render` and `async-grpo pipeline submit|schedule` and the pipeline's train step for the kubernetes
backend run it with target cluster.

- warm_start (all targets): warmup_sft_steps > 0 on a dataset that is no builtin task.
- vllm_extra_args (all): flags the launcher sets from validated fields (--max-model-len, --dtype, --port, --seed,
  --served-model-name, the weight-transfer flags), or given twice (also through their own field).
- lengths (all): max_prompt_length + max_completion_length > vllm_max_model_len.
- reward_funcs (all): specs that do not resolve, duplicate names. On a cluster a submitter's file is read, never run
  (`user_code.check_file_statically`: it exists, parses and defines the function), and modules are left to the image.
- data_producer (all; on a cluster files are read, never run): a spec that does not resolve.
- tools (all; on a cluster files are read, never run): a tool that does not resolve or has no JSON schema.
- environment (all; on a cluster files are read, never run): a spec that does not resolve, a factory that raises or
  returns no environment (`reset(row, state)`, `step(action, state)`), a reset that raises, hangs or returns no
  Observation on the dataset's first row (where the dataset was read here).
- agent (all; on a cluster files are read, never run, and a command's program is looked up in the image): an `agent`
  spec that does not resolve, or a function whose signature cannot take `(row, base_url=, api_key=)`; an
  `agent_command` whose program is no executable file or is not on PATH.
- dataset (local; on a cluster builtin tasks): a missing or unreadable file, no `prompt` column, malformed messages
  or unknown roles, reserved column names, no rows.
- prompt_lengths (where the dataset was read and the tokenizer is at hand): conversational prompts without a chat
  template, no prompt short enough for max_prompt_length.
- reward_models (all; hub ids when cached, paths when on this machine): a reward model in reward_funcs whose folder
  is missing, has no *ForSequenceClassification head, num_labels != 1, an unknown dtype, no weights, a tokenizer that
  does not load or has neither pad nor eos, or no chat template for a conversational dataset (`reward_models`).
- reward_probe (where the dataset was read): a reward function whose signature cannot take TRL's call, or that
  raises, hangs or returns something other than G numbers or None on one group from the first row.
- model (local): a model_name_or_path that is no local HF folder, no hub id and not builtin:tiny.
- lora_targets (with use_peft and explicit lora_target_modules, where the model's config is at hand): target
  modules that match no module of the model (`peft_check`).
- teacher (all; folders on this machine, hub ids when cached): a teacher_model_name_or_path that is no saved model,
  or whose tokenizer is not the student's (vocabulary and special tokens; `preflight.teacher`).
- teacher_url (local): a served teacher that does not answer GET /models within 5 s, does not serve teacher_model,
  holds fewer than vllm_max_model_len tokens, or tokenizes a probe otherwise than the student.
- output_dir (local): a folder this process cannot write.
- resume_checkpoint (local): a resume_from_checkpoint path that is no complete checkpoint folder, or one of another
  checkpoint format version (its meta.json).
- weight_sync_device (local): weight_sync_backend=nccl without CUDA.
- mlflow (local): an http(s) tracking server that does not answer within 5 s; an unwritable sqlite/file store.
- reward_url (local): a reward service at reward_url that does not answer within 5 s (ASYNC_GRPO_REWARD_URL, which
  the kubernetes launcher sets for a reward Deployment that may still be starting, is waited for at launch).

Local-only checks look at this machine; on a cluster the trainer runs in its own pod, on GPU nodes, with the
workspace volume mounted and in-cluster service names, so those would test the wrong machine. Hub ids (models,
datasets) are not fetched here: they are resolved at launch. Non-finite floats and an empty YAML file are refused
by the config itself (`async_grpo.config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from async_grpo.config import GRPOConfig
from async_grpo.preflight.report import PreflightError, PreflightReport, Problem

Target = Literal["local", "cluster"]
CHECKS = (
    "warm_start",
    "vllm_extra_args",
    "lengths",
    "reward_funcs",
    "data_producer",
    "tools",
    "dataset",
    "environment",
    "agent",
    "prompt_lengths",
    "reward_models",
    "reward_probe",
    "model",
    "lora_targets",
    "teacher",
    "teacher_url",
    "output_dir",
    "resume_checkpoint",
    "weight_sync_device",
    "vllm_replicas",
    "mlflow",
    "reward_url",
)
LOCAL_ONLY = ("model", "output_dir", "resume_checkpoint", "weight_sync_device", "mlflow", "reward_url", "teacher_url")


def preflight(config: GRPOConfig, *, target: Target = "local", skip: Iterable[str] = ()) -> PreflightReport:
    """Run every preflight check for `target` (module docstring) except those named in `skip`.

    Args:
        config: the validated run config.
        target: "local" (every role on this machine) or "cluster" (the kubernetes backend: the trainer runs
            elsewhere, so the checks of this machine are skipped).
        skip: names from CHECKS not to run (e.g. "weight_sync_device" to validate a GPU config on a laptop).

    Returns:
        The report; nothing is started or written (a temporary file is created and removed to test output_dir).

    Raises:
        ValueError: an unknown target or check name.
    """
    from async_grpo.preflight import inputs, services, static

    if target not in ("local", "cluster"):
        raise ValueError(f"target={target!r} must be 'local' or 'cluster'.")
    skip = set(skip)
    unknown = sorted(skip - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown preflight checks {unknown}. Fix: use names from {list(CHECKS)}.")
    local = target == "local"
    report = PreflightReport(target)

    def wanted(name: str) -> bool:
        if name in skip:
            report.skipped.append(f"{name}: skipped on request")
            return False
        if name in LOCAL_ONLY and not local:
            report.skipped.append(f"{name}: checked where the trainer runs, not on this machine")
            return False
        report.checked.append(name)
        return True

    def add(problems: list[Problem]) -> None:
        report.problems.extend(problems)

    for name, check in (
        ("warm_start", static.check_warm_start),
        ("vllm_extra_args", static.check_vllm_extra_args),
        ("lengths", static.check_lengths),
        ("output_dir", static.check_output_dir),
        ("resume_checkpoint", static.check_resume_checkpoint),
        ("weight_sync_device", static.check_weight_sync_device),
        ("vllm_replicas", static.check_vllm_replicas),
        ("mlflow", services.check_mlflow),
        ("reward_url", services.check_reward_url),
    ):
        if wanted(name):
            add(check(config))
    if wanted("model"):
        problems, note = static.check_model(config)
        add(problems)
        report.skipped += [note] if note else []
    if wanted("lora_targets") and not any(p.field.startswith("model") for p in report.problems):
        from async_grpo.preflight.peft_check import check_lora_targets

        problems, note = check_lora_targets(config, local)
        add(problems)
        report.skipped += [note] if note else []
    from async_grpo.preflight.teacher import check_teacher_model, check_teacher_url

    for name, teacher_check in (("teacher", check_teacher_model), ("teacher_url", check_teacher_url)):
        if not wanted(name) or not config.distillation.enabled:
            continue
        if any(p.field.startswith("model") for p in report.problems):
            report.skipped.append(f"{name}: the student's model is not usable, so its tokenizer is not compared")
            continue
        problems, notes = teacher_check(config, local)
        add(problems)
        report.skipped += notes
    if wanted("data_producer"):
        problems, notes = inputs.check_data_producer(config, local)
        add(problems)
        report.skipped += notes
    # with a reward service (a trainer pod, which holds credentials) the submitter's code is loaded where it runs
    remote_rewards = local and services.reward_service_url(config) is not None
    if remote_rewards and config.tools.tools:
        report.skipped.append("tools: the reward service loads them and serves their schemas (never imported here)")
    elif wanted("tools"):
        problems, notes = inputs.check_tools(config, local)
        add(problems)
        report.skipped += notes
    if (
        local
        and "reward_url" in report.checked
        and config.rewards.reward_url is None
        and services.reward_service_url(config) is not None
    ):
        report.skipped.append(
            "reward_url: ASYNC_GRPO_REWARD_URL (set by the kubernetes launcher) is waited for at launch"
        )
    funcs: dict = {}
    if remote_rewards:
        report.skipped.append("reward_funcs, reward_models, reward_probe: the reward service resolves and runs them")
    elif wanted("reward_funcs"):
        funcs, problems, notes = inputs.resolve_specs(config, local)
        add(problems)
        report.skipped += notes
    dataset = None
    if wanted("dataset"):
        dataset = _check_datasets(config, local, report)
    if wanted("environment"):
        problems, notes = inputs.check_environment(config, local, None if dataset is None else dict(dataset[0]))
        add(problems)
        report.skipped += notes
    if remote_rewards and (config.agents.agent is not None or config.agents.agent_command is not None):
        # the trainer pod holds credentials: the agent is imported (or its program looked up) where it runs
        report.skipped.append("agent: the reward service loads and runs it (its server refuses to start otherwise)")
    elif wanted("agent"):
        problems, notes = inputs.check_agent(config, local)
        add(problems)
        report.skipped += notes
    if (
        dataset is not None
        and wanted("prompt_lengths")
        and not any(p.field.startswith("model") for p in report.problems)
    ):
        tokenizer = inputs.load_tokenizer(config, local)
        if tokenizer is None:
            report.skipped.append("prompt_lengths: the tokenizer is not available here")
        else:
            add(inputs.check_prompt_lengths(config, dataset, tokenizer))
    if not remote_rewards and wanted("reward_models"):
        from async_grpo.preflight.reward_models import check_reward_models

        conversational = None if dataset is None else not isinstance(dataset[0]["prompt"], str)
        problems, notes = check_reward_models(config, local, conversational)
        add(problems)
        report.skipped += notes
    if not remote_rewards and wanted("reward_probe"):
        if dataset is None:
            report.skipped.append("reward_probe: the dataset was not read here")
        elif funcs and not any(p.field == "rewards.reward_funcs" for p in report.problems):
            add(inputs.probe_rewards(config, funcs, dataset[0]))
    return report


def _check_datasets(config: GRPOConfig, local: bool, report: PreflightReport):
    """Read the training and held-out datasets that can be read here; returns the training one (or None)."""
    from async_grpo.preflight import inputs

    data = config.data
    dataset = None
    for spec, field, split in (
        (data.dataset, "data.dataset", "train"),
        (data.eval_dataset, "data.eval_dataset", "eval"),
    ):
        if spec is None:
            continue
        if not inputs.is_checkable_dataset(spec, local):
            report.skipped.append(
                f"{field}: {spec!r} is read at launch ("
                + ("a hub id)" if not spec.startswith("/") and "/" in spec else "not here)")
            )
            continue
        loaded, problems = inputs.load_first_row(config, spec, field, split)
        report.problems.extend(problems)
        if split == "train":
            dataset = loaded
    return dataset


def check_config(config: GRPOConfig, *, target: Target = "local", skip: Iterable[str] = ()) -> PreflightReport:
    """`preflight`, raising its problems.

    Raises:
        PreflightError: at least one problem (the message has one `<field>: <message>. Fix: ...` line each).
    """
    report = preflight(config, target=target, skip=skip)
    report.raise_for_problems()
    return report


__all__ = [
    "CHECKS",
    "LOCAL_ONLY",
    "PreflightError",
    "PreflightReport",
    "Problem",
    "Target",
    "check_config",
    "preflight",
]
