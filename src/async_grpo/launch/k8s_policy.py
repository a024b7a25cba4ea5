"""The platform's allow-list: what a run submitter may choose on the cluster, set by the platform engineer.

A submitter controls the run config and `ClusterSettings` (the pipeline's `kubernetes_options`); the
platform engineer controls the policy (`platform_policy.PlatformPolicy`), in ConfigMap `async-grpo-policy`
(manifests/base/policy.yaml), which the pipeline mounts into its steps. This module checks runs against it. `check_run` is the one gate: `render`, `pipeline submit`,
the kubernetes backend and the evaluate step all call it, so a run that passes one passes all.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from async_grpo.config import GRPOConfig
from async_grpo.config.sections import SECTIONS, RunFields
from async_grpo.config.sections.agents import AGENT_ENDPOINT_PORT_COUNT
from async_grpo.config.sections.tools import PYTHON_TOOL
from async_grpo.config.trust import Trust, TrustClass, trust_markdown, trust_table
from async_grpo.launch.image_refs import BadImageReference, parse_image_ref, prefix_covers
from async_grpo.launch.k8s_judge import serves_judge
from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH, ClusterSettings
from async_grpo.launch.k8s_teacher import serves_teacher
from async_grpo.launch.platform_policy import POLICY_CONFIG_MAP, PlatformPolicy, load_policy
from async_grpo.launch.uris import UnsafeURI, parse_http_uri, uri_allowed
from async_grpo.user_code import is_file_spec, split_adapter

logger = logging.getLogger(__name__)

PLACEHOLDER_DIGEST = "sha256:" + "0" * 64  # marks "set your image's digest here" in the manifests
FIX = f"Fix: change it, or ask your platform engineer to allow it in ConfigMap {POLICY_CONFIG_MAP}"
# model_init_kwargs a cluster run may pass to from_pretrained: none of them loads code. Left out on purpose: keys that
# point at files or caches the submitter controls (cache_dir, gguf_file, ...) and hub kernels (an attn_implementation
# naming a repository, which transformers loads through the `kernels` package as a compiled library).
SAFE_INIT_KWARGS = (
    "attn_implementation",
    "revision",
    "dtype",
    "torch_dtype",
    "use_cache",
    "low_cpu_mem_usage",
    "use_safetensors",
    "variant",
    "subfolder",
)
BUILTIN_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention")


class PolicyViolation(ValueError):
    """A run asks for something the platform policy does not allow; the message names each field and the fix."""


# ------------------------------------------------------------------------------------------------ checks
def image_roles(settings: ClusterSettings) -> dict[str, str]:
    """Settings field -> the image name that role runs (cpu clusters run the cpu image for trainer and vLLM)."""
    cpu = settings.device == "cpu"
    return {
        "trainer_image": "cpu" if cpu else "trainer",
        "vllm_image": "cpu" if cpu else "vllm",
        "reward_image": "reward",
    }


def resolve_images(settings: ClusterSettings, policy: PlatformPolicy) -> ClusterSettings:
    """`settings` with the policy's `platform_settings` in the platform-only fields the run left at their defaults,
    and each image the run does not choose (no override, no image_registry/image_tag) set to the policy's default
    image for that role, where the policy has one."""
    platform = {k: v for k, v in policy.platform_settings.items() if getattr(settings, k) == _default(k)}
    if platform:  # the platform's values of platform-only fields the run left at their defaults
        settings = settings.model_copy(update=platform)
    if settings.image_registry is not None or settings.image_tag is not None:
        return settings
    update = {
        f: policy.default_images[name]
        for f, name in image_roles(settings).items()
        if getattr(settings, f) is None and name in policy.default_images
    }
    return settings.model_copy(update=update) if update else settings


def _default(name: str) -> Any:
    return ClusterSettings.model_fields[name].get_default(call_default_factory=True)


def _image_problems(field: str, ref: str, policy: PlatformPolicy, allow_placeholders: bool) -> list[str]:
    """An image must parse as the registry parses it (`image_refs.parse_image_ref`), be an allowed reference or lie
    under an allowed prefix by registry and whole path segments, and carry a digest when the policy requires one."""
    try:
        parsed = parse_image_ref(ref)
    except BadImageReference as err:
        return [f"{field}: {err}"]
    problems = []
    exact = any(_parsed_or_none(entry) == parsed for entry in policy.images)
    if not exact and not any(prefix_covers(p, parsed) for p in policy.image_prefixes):
        problems.append(
            f"{field}={ref!r} is not an allowed image (allowed prefixes {policy.image_prefixes}, "
            f"references {policy.images}). {FIX} (image_prefixes or images)."
        )
    if policy.require_digest and not parsed.pinned:
        problems.append(
            f"{field}={ref!r} is not pinned by digest and the platform requires it. Fix: use "
            f"{ref.split('@')[0]}@sha256:<digest of the pushed image>."
        )
    if parsed.digest == PLACEHOLDER_DIGEST and not allow_placeholders:
        problems.append(
            f"{field}={ref!r} carries the placeholder digest. Fix: put the digest of the image you "
            f"pushed into default_images of ConfigMap {POLICY_CONFIG_MAP} (or the image override)."
        )
    return problems


# ------------------------------------------------------------------------------------------- the derived gate
# Each field of the run config and of the cluster settings declares its trust class (`config.trust`); `check_run`
# walks them all and applies the class's checker below. A `policy` field names the PlatformPolicy key that decides,
# and POLICY_CHECKS maps every such key to its checker (tests/test_trust.py fails a key without one).


@dataclass(frozen=True)
class FieldValue:
    """One submitter-controlled field as the gate sees it.

    Attributes:
        owner: "config" (GRPOConfig) or "settings" (ClusterSettings).
        name: the field's name (flat, as the submitter writes it).
        value: the submitter's value.
        default: the field's default (what an unset field holds).
        trust: the field's declared class.
    """

    owner: str
    name: str
    value: Any
    default: Any
    trust: TrustClass


@dataclass(frozen=True)
class RunContext:
    """What a checker may read besides the field: the whole run, its settings and the policy."""

    config: GRPOConfig
    settings: ClusterSettings
    policy: PlatformPolicy
    allow_placeholders: bool


def declared_fields(config: GRPOConfig, settings: ClusterSettings) -> list[FieldValue]:
    """Every field of `config` (top-level and each section's) and of `settings`, with its declared class.

    Raises:
        ValueError: a field declares no trust class (`config.trust`); the message names it and the fix. A field
            nobody classified is refused on a cluster rather than let through.
    """
    models: list[tuple[str, type[BaseModel], BaseModel]] = [("config", RunFields, config)]
    models += [("config", model, getattr(config, section)) for section, model in SECTIONS.items()]
    models.append(("settings", ClusterSettings, settings))
    fields = []
    for owner, model, instance in models:
        for name, trust in trust_table(model):
            if trust is None:
                raise ValueError(
                    f"{model.__name__}.{name} declares no trust class, so the platform policy cannot tell who may "
                    "set it. Fix: give its Field json_schema_extra=tenant(), volume_path(), code(), "
                    "policy_list(<PlatformPolicy field>) or platform_only() (async_grpo.config.trust)."
                )
            default = model.model_fields[name].get_default(call_default_factory=True)
            fields.append(FieldValue(owner, name, getattr(instance, name), default, trust))
    return fields


def on_volume(path: str, settings: ClusterSettings) -> bool:
    """True when `path` is a normalized absolute path under the workspace mount: no `..` or `.` segment, no `//`
    (`posixpath.normpath` leaves it unchanged but for a trailing slash), no NUL, inside `data_mount_path` by
    segment."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return False
    trimmed = path.rstrip("/") or "/"
    return posixpath.normpath(trimmed) == trimmed and trimmed.startswith(settings.data_mount_path + "/")


def _volume_fix(settings: ClusterSettings) -> str:
    return (
        f"Fix: copy it onto PVC {settings.pvc_name!r} and name it as {settings.data_mount_path}/<path>, without "
        "'..' or '//'"
    )


# What each volume_path field names, in its refusal.
VOLUME_PATH_WHAT = {
    "model_name_or_path": "the model folder",
    "dataset": "the dataset",
    "eval_dataset": "the dataset",
    "resume_from_checkpoint": "the checkpoint",
    "output_dir": "the run folder",
    "judge_model_name_or_path": "the judge's model folder",
    "teacher_model_name_or_path": "the teacher's model folder",
}
SERVED_MODEL_PATHS = ("judge_model_name_or_path", "teacher_model_name_or_path")  # a vLLM pod of the run loads them


def volume_path_problems(field: FieldValue, ctx: RunContext) -> list[str]:
    """A `volume_path` field: its default, a `builtin:` value, for the model a `models:/` registry URI (the train
    step downloads it into a step-private folder before any pod starts), or a normalized path on the workspace
    volume (`on_volume`). The judge and teacher models are paths only when the run serves them (else they are a
    remote server's model name), and never builtins (a plain vLLM pod loads them from the volume). A checkpoint to
    resume from may be `true` (the run's own newest)."""
    value = field.value
    if field.name == "judge_model_name_or_path" and not serves_judge(ctx.config):
        return []
    if field.name == "teacher_model_name_or_path" and not serves_teacher(ctx.config):
        return []
    if value is None or isinstance(value, bool) or value == field.default:
        return []
    if isinstance(value, str) and value.startswith("builtin:") and field.name not in SERVED_MODEL_PATHS:
        return []
    if field.name == "model_name_or_path" and isinstance(value, str) and value.startswith("models:/"):
        return []
    if field.name == "output_dir" and not on_volume(value, ctx.settings):
        return []  # the launcher puts the run in its own folder on the volume instead (`k8s_objects.run_output_dir`)
    if on_volume(value, ctx.settings):
        return []
    what = VOLUME_PATH_WHAT.get(field.name, "it")
    return [
        f"{field.name}={value!r}: on Kubernetes {what} must be a builtin, a normalized path on the shared volume (run "
        f"pods reach no hub) or, for the model, an MLflow registry URI (models:/...). {_volume_fix(ctx.settings)}."
    ]


def path_problems(config: GRPOConfig, settings: ClusterSettings) -> list[str]:
    """The `volume_path` fields of the run and the files and reward-model folders its `code` fields name, each
    checked against the workspace volume (`volume_path_problems`, `code_file_problems`); one problem per path off
    it, naming the field and the fix."""
    ctx = RunContext(config, settings, PlatformPolicy(), allow_placeholders=True)
    problems = []
    for field in declared_fields(config, settings):
        if field.trust.trust is Trust.VOLUME_PATH:
            problems += volume_path_problems(field, ctx)
        elif field.trust.trust is Trust.CODE:
            problems += code_file_problems(field, ctx)
    return problems


# How each `code` field is placed, by name (`code_problems`). A `code` field named in none of these is refused on a
# cluster unless the policy allows `user_code_with_credentials`: a field added without a placement fails closed.
SCORED_CODE_FIELDS = ("reward_funcs", "tools")  # lists of specs run in the reward pods (or the trainer, with none)
TRAINER_CODE_FIELDS = ("data_producer", "environment")  # one spec each, run in the trainer pod
# The agent (a function spec, or a command's argv): with reward_replicas >= 1 its episodes run in the reward pods (a
# function in the reward server's process, a command in its bwrap sandbox: `rewards.agent_routes`), else in the
# trainer pod, where a function is judged as TRAINER_CODE_FIELDS are and a command runs only beside credentials.
AGENT_CODE_FIELDS = ("agent", "agent_command")
FLAG_CODE_FIELDS = ("trust_remote_code", "model_init_kwargs")  # load the model's own code, in the trainer pod
# Why a `code` field without a placement runs only beside credentials, in its refusal (`unplaced_code_problems`);
# none today: a field added later gets the generic reason, or its own here.
UNPLACED_CODE_REASONS: dict[str, str] = {}


def _code_specs(field: FieldValue) -> list[str]:
    """The code specs a `code` field holds (strings naming code; empty for the flags and commands)."""
    if field.name in SCORED_CODE_FIELDS:
        return list(field.value)
    if field.name in (*TRAINER_CODE_FIELDS, "agent"):
        return [field.value] if field.value else []
    return []


# The image's system directories, which the agent command's sandbox shows read-only (`tools.sandbox.SYSTEM_DIRS`,
# which launch may not import; tests/agents/test_sandbox.py holds them equal)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")


def _system_path(path: str) -> bool:
    """A normalized absolute path under the image's system directories (SYSTEM_DIRS: /usr, /bin, /lib, ...), which
    the agent command's sandbox shows read-only (a program such as /usr/bin/python3)."""
    return posixpath.normpath(path) == path and any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def _reward_model_location(spec: str) -> str | None:
    """The folder or hub id a reward-model spec names (`model:<x>`, or a bare spec with no colon), else None."""
    if spec.startswith("model:"):
        return spec.removeprefix("model:").strip()
    return spec if ":" not in spec else None


def code_file_problems(field: FieldValue, ctx: RunContext) -> list[str]:
    """Each submitter file (`path/file.py:name`, an adapter's file included) and reward-model folder (`model:<path>`)
    a `code` field names must lie on the workspace volume: run pods read nothing else and reach no hub."""
    problems = []
    for spec in _code_specs(field):
        inner = split_adapter(spec)[1] if field.name == "environment" else spec
        location = None
        if is_file_spec(inner):
            location = str(inner).rsplit(":", 1)[0]
        elif field.name == "reward_funcs":
            location = _reward_model_location(spec)
        if location is not None and not on_volume(location, ctx.settings):
            problems.append(
                f"{field.name}={location!r}: on Kubernetes the file or model folder of {spec!r} must be a normalized "
                f"path on the shared volume (run pods reach no hub). {_volume_fix(ctx.settings)}."
            )
    if field.name == "agent_command":
        for arg in field.value or []:
            if arg.startswith("/") and not _system_path(arg) and not on_volume(arg, ctx.settings):
                problems.append(
                    f"agent_command={arg!r}: on Kubernetes each path the agent's command names must be a normalized "
                    "path on the shared volume (its sandbox sees only those, read-only, and the image's system "
                    f"directories {list(SYSTEM_DIRS)}). {_volume_fix(ctx.settings)}."
                )
    return problems


def _scored_in_trainer(ctx: RunContext) -> bool:
    """True when reward functions and tool calls would run in the trainer pod (no reward pods, no external
    service), which holds the MLflow credentials."""
    return not (ctx.settings.reward_replicas or ctx.config.rewards.reward_url)


def _module_allowed(module: str, policy: PlatformPolicy) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in policy.code_modules)


def code_problems(field: FieldValue, ctx: RunContext) -> list[str]:
    """A `code` field: the files it names lie on the volume (`code_file_problems`), and code runs only where no
    credential is: in the reward pods (reward functions, tools and the agent, `agent` or `agent_command`, with
    reward_replicas >= 1; the agent's command in their bwrap sandbox, and its endpoint ports clear of the trainer's
    other listeners, `agent_port_problems`), or in the trainer pod only when it is image code the policy lists
    (`code_modules`) or the policy allows `user_code_with_credentials`. Model-written code (`builtin:python`) always
    needs the reward pods and the bwrap sandbox. A `code` field with no placement here (one added later) is refused
    unless `user_code_with_credentials` (`unplaced_code_problems`)."""
    problems = code_file_problems(field, ctx)
    config, settings, policy = ctx.config, ctx.settings, ctx.policy
    if field.name == "tools" and PYTHON_TOOL in field.value:
        if not settings.reward_replicas:
            problems.append(
                f"tools: {PYTHON_TOOL} runs code the model writes; with reward_replicas=0 it would run in the trainer "
                "pod, which holds the MLflow credentials. Fix: set reward_replicas >= 1 (the code then runs in the "
                "reward pods' bwrap sandbox, without credentials)."
            )
        if config.tools.python_tool_sandbox != "bwrap":
            problems.append(
                f"python_tool_sandbox={config.tools.python_tool_sandbox!r}: on Kubernetes {PYTHON_TOOL} runs only in "
                "the bwrap sandbox. Fix: drop python_tool_sandbox."
            )
    if field.name in AGENT_CODE_FIELDS and field.value is not None and settings.reward_replicas:
        return problems + agent_port_problems(ctx)  # placed: the episodes run in the reward pods
    if policy.user_code_with_credentials:
        return problems
    where = "in the trainer pod, which holds the MLflow credentials"
    if field.name in SCORED_CODE_FIELDS and _scored_in_trainer(ctx):
        files = [s for s in field.value if is_file_spec(s)]
        if files:
            problems.append(
                f"{field.name} {files} are files and reward_replicas=0 would run them {where}. Fix: set "
                "reward_replicas >= 1 (they then run in reward pods without credentials)."
            )
        modules = [
            s
            for s in field.value
            if not is_file_spec(s) and ":" in s and not s.startswith(("builtin:", "model:"))
            if not _module_allowed(s.rsplit(":", 1)[0], policy)
        ]
        if modules:
            problems.append(
                f"{field.name} {modules} name modules the policy does not list (code_modules: {policy.code_modules}) "
                f"and reward_replicas=0 would run them {where}. Fix: set reward_replicas >= 1. {FIX} (code_modules)."
            )
    if field.name in (*TRAINER_CODE_FIELDS, "agent") and field.value:
        adapter, inner = split_adapter(field.value)
        if isinstance(inner, str) and inner.startswith("builtin:") and adapter is None:
            return problems
        if is_file_spec(inner):
            fix = "install it in the trainer image and name it as pkg.module:factory"
            if field.name == "agent":
                fix = (
                    "set reward_replicas >= 1 (it then runs in the reward pods, without credentials), or install it "
                    "in the trainer image and name it as pkg.module:function"
                )
            problems.append(
                f"{field.name}={field.value!r} is a file: it would run {where}. Fix: {fix}, or ask your platform "
                "engineer to set user_code_with_credentials."
            )
        else:  # a module (or a verifiers taskset id, which names the module to import) runs in the trainer pod
            module = str(inner).rsplit(":", 1)[0] if ":" in str(inner) else str(inner).split("+", 1)[0]
            if not _module_allowed(module, policy):
                problems.append(
                    f"{field.name}={field.value!r} imports module {module!r} {where}, and the policy does not list "
                    f"it (code_modules: {policy.code_modules}). {FIX} (code_modules)."
                )
    if field.name == "agent_command" and field.value is not None:
        problems.append(
            f"agent_command={field.value!r} with reward_replicas=0 would run {where}. Fix: set reward_replicas >= 1 "
            "(it then runs in the reward pods' bwrap sandbox, without credentials), or ask your platform engineer to "
            "set user_code_with_credentials."
        )
    if field.name == "trust_remote_code" and field.value:
        problems.append(
            f"trust_remote_code=true would run the model folder's Python code {where}. Fix: use a model that "
            "transformers supports natively, or ask your platform engineer to set user_code_with_credentials."
        )
    if field.name == "model_init_kwargs":
        init = field.value or {}
        odd = sorted(set(init) - set(SAFE_INIT_KWARGS))
        attention = init.get("attn_implementation")
        if odd or (attention is not None and attention not in BUILTIN_ATTENTION):
            problems.append(
                f"model_init_kwargs {odd or {'attn_implementation': attention}} may load files or compiled kernels "
                f"{where}. Fix: use only {list(SAFE_INIT_KWARGS)}, with attn_implementation one of "
                f"{list(BUILTIN_ATTENTION)}."
            )
    return problems + unplaced_code_problems(field)


def unplaced_code_problems(field: FieldValue) -> list[str]:
    """A `code` field that none of SCORED_CODE_FIELDS, TRAINER_CODE_FIELDS, AGENT_CODE_FIELDS and FLAG_CODE_FIELDS
    places, set to anything but its default: its code would run in the trainer pod, beside the credentials, so it is
    refused (the caller lets it through when the policy allows `user_code_with_credentials`). The reason given is
    UNPLACED_CODE_REASONS' entry for the field, else a generic one."""
    placed = (*SCORED_CODE_FIELDS, *TRAINER_CODE_FIELDS, *AGENT_CODE_FIELDS, *FLAG_CODE_FIELDS)
    if field.name in placed or field.value is None or field.value == field.default:
        return []
    reason = UNPLACED_CODE_REASONS.get(
        field.name, "it names code that would run in the trainer pod, which holds the MLflow credentials"
    )
    return [
        f"{field.name}={field.value!r} is refused on Kubernetes: {reason}. Fix: unset {field.name}, or ask your "
        "platform engineer to set user_code_with_credentials."
    ]


def agent_port_problems(ctx: RunContext) -> list[str]:
    """The agent endpoint's ports (`agent_endpoint_port` .. + AGENT_ENDPOINT_PORT_COUNT - 1), which the NetworkPolicies
    open from the reward pods (tenant code) into the trainer pods, must not hold another listener of those pods: they
    may not overlap `weight_transfer_ports` (the weight-transfer rendezvous and NCCL sockets, which trust their peers,
    and the pods' ephemeral range), `vllm_port` or `reward_port`."""
    a, s = ctx.config.agents, ctx.settings
    lo, hi = a.agent_endpoint_port, a.agent_endpoint_port + AGENT_ENDPOINT_PORT_COUNT - 1
    taken = {
        "weight_transfer_ports": s.weight_transfer_ports,
        "vllm_port": (s.vllm_port, s.vllm_port),
        "reward_port": (s.reward_port, s.reward_port),
    }
    clashes = [name for name, (b_lo, b_hi) in taken.items() if b_lo <= hi and lo <= b_hi]
    if not clashes:
        return []
    return [
        f"agent_endpoint_port: the agent endpoint's ports {lo}-{hi}, which the reward pods may reach in the trainer "
        f"pods, overlap {', '.join(clashes)}. Fix: move {' and '.join(clashes)} off {lo}-{hi} (kubernetes_options)."
    ]


def platform_problems(field: FieldValue, ctx: RunContext) -> list[str]:
    """A `platform` field: unset (its default) or the platform's own value (`platform_settings`); anything else is
    refused, naming the field."""
    allowed = ctx.policy.platform_settings.get(field.name, field.default) if field.owner == "settings" else None
    if field.value == allowed or field.value == field.default:
        return []
    shown = "the image's own" if allowed is None else repr(allowed)
    return [
        f"{field.name}={field.value!r} is set by the platform only (this cluster uses {shown}): it names a "
        "program, host, sandbox or identity that runs with the platform's rights. Fix: drop it from your "
        f"{'run config' if field.owner == 'config' else 'kubernetes_options'}."
    ]


def _images(field: FieldValue, ctx: RunContext) -> list[str]:
    """The image each role runs (the override, or the registry/tag it is made of, or the policy's default)."""
    if field.name in ("image_registry", "image_tag"):
        return []  # checked through the role images they make (trainer_image, vllm_image, reward_image)
    ref = ctx.settings.image(_role(field.name))
    return _image_problems(field.name, ref, ctx.policy, ctx.allow_placeholders)


def _in_list(key: str, what: str) -> Any:
    def check(field: FieldValue, ctx: RunContext) -> list[str]:
        allowed = getattr(ctx.policy, key)
        if field.value is None or field.value in allowed:
            return []
        return [f"{field.name}={field.value!r} is not {what} (allowed: {allowed}). {FIX} ({key})."]

    check.__doc__ = f"The value is None or listed in PlatformPolicy.{key} (else: is not {what})."
    return check


def _mlflow_uri(field: FieldValue, ctx: RunContext) -> list[str]:
    """The MLflow server the run logs to (the config's, else the settings'): it receives the run's credentials."""
    uri = field.value
    if field.owner == "config" and not uri:
        return []
    if field.owner == "settings" and ctx.config.tracking.mlflow_tracking_uri:
        return []  # the config's server is the one used, and is checked
    stake = "the run's MLflow credentials would go there"
    return _uri_problems("mlflow_tracking_uri", uri, ctx.policy.mlflow_tracking_uris, "MLflow server", stake)


def _reward_url(field: FieldValue, ctx: RunContext) -> list[str]:
    """An external reward service (with no reward pods of the run's own): every rollout is sent there."""
    if not field.value or ctx.settings.reward_replicas:
        return []
    stake = "every rollout would be sent there"
    return _uri_problems("reward_url", field.value, ctx.policy.reward_urls, "reward service", stake)


def _judge_url(field: FieldValue, ctx: RunContext) -> list[str]:
    """An external LLM judge: every completion (and the judge token) is sent there."""
    if not field.value:
        return []
    stake = "every completion (and the judge token) would be sent there"
    return _uri_problems("judge_url", field.value, ctx.policy.judge_urls, "LLM judge", stake)


def _teacher_url(field: FieldValue, ctx: RunContext) -> list[str]:
    """An external distillation teacher: every sampled completion (prompt and completion tokens) is sent there, from
    the trainer pod."""
    if not field.value:
        return []
    stake = "every sampled completion would be sent there"
    return _uri_problems("teacher_url", field.value, ctx.policy.teacher_urls, "distillation teacher", stake)


def _vllm_flags(field: FieldValue, ctx: RunContext) -> list[str]:
    """Each flag of vllm_extra_args is in `vllm_flags` (`config.vllm_serve_args`: every flag the server gets)."""
    return _flag_problems(ctx.config.vllm_serve_args, ctx.policy)


def _gpus(field: FieldValue, ctx: RunContext) -> list[str]:
    """GPUs one pod asks for (nproc_per_node, vllm_gpus, judge_gpus when the run serves a judge, teacher_gpus when
    it serves a teacher) stay within `max_gpus_per_pod`."""
    cap = ctx.policy.max_gpus_per_pod
    if cap is None or ctx.settings.device != "gpu" or field.value <= cap:
        return []
    if field.name == "judge_gpus" and not serves_judge(ctx.config):
        return []
    if field.name == "teacher_gpus" and not serves_teacher(ctx.config):
        return []
    return [
        f"{field.name}={field.value} asks for more GPUs per pod than the platform allows ({cap}). {FIX} (max_gpus_per_pod)."
    ]


def _node_selector(field: FieldValue, ctx: RunContext) -> list[str]:
    """Each nodeSelector label is listed in `node_selectors` with its value."""
    allowed = ctx.policy.node_selectors
    odd = {k: v for k, v in field.value.items() if v not in allowed.get(k, [])}
    if not odd:
        return []
    return [f"node_selector {odd} is not allowed (allowed: {allowed}). {FIX} (node_selectors)."]


def _tolerations(field: FieldValue, ctx: RunContext) -> list[str]:
    """Each toleration equals one listed in `tolerations`."""
    odd = [t for t in field.value if t not in ctx.policy.tolerations]
    if not odd:
        return []
    return [f"tolerations {odd} are not allowed (allowed: {ctx.policy.tolerations}). {FIX} (tolerations)."]


def _nccl_env(field: FieldValue, ctx: RunContext) -> list[str]:
    """Each variable of nccl_env is listed in `nccl_env_keys`."""
    unknown = sorted(set(field.value) - set(ctx.policy.nccl_env_keys))
    if not unknown:
        return []
    return [
        f"nccl_env sets {unknown}, which are not allowed NCCL/gloo variables (allowed: {ctx.policy.nccl_env_keys}). "
        f"{FIX} (nccl_env_keys)."
    ]


def _own_namespace(field: FieldValue, ctx: RunContext) -> list[str]:
    """The namespace: a launcher in a pod creates objects only in its own (`check_namespace`, which the kubernetes
    backend applies when it is built, knowing its pod's namespace); rendering manifests creates nothing."""
    return []


# PlatformPolicy key -> the checker of the fields that name it (`config.trust.policy_list`).
POLICY_CHECKS: dict[str, Any] = {
    "images": _images,
    "service_accounts": _in_list("service_accounts", "allowed"),
    "secrets": _in_list("secrets", "an allowed secret"),
    "pvcs": _in_list("pvcs", "an allowed workspace volume"),
    "data_mount_paths": _in_list("data_mount_paths", "an allowed mount path"),
    "trainer_runtimes": _in_list("trainer_runtimes", "an allowed ClusterTrainingRuntime"),
    "priority_classes": _in_list("priority_classes", "an allowed PriorityClass"),
    "kueue_queues": _in_list("kueue_queues", "an allowed Kueue LocalQueue"),
    "nccl_env_keys": _nccl_env,
    "mlflow_tracking_uris": _mlflow_uri,
    "reward_urls": _reward_url,
    "judge_urls": _judge_url,
    "teacher_urls": _teacher_url,
    "vllm_flags": _vllm_flags,
    "max_gpus_per_pod": _gpus,
    "node_selectors": _node_selector,
    "tolerations": _tolerations,
    "own_namespace": _own_namespace,
}


def _parsed_or_none(ref: str):
    try:
        return parse_image_ref(ref)
    except BadImageReference:
        return None


def _uri_problems(field: str, uri: str, allowed: list[str], what: str, stake: str) -> list[str]:
    """A URI the run would send credentials or data to: it must parse unambiguously (`uris.parse_http_uri`) and lie
    under an allowed entry."""
    try:
        parse_http_uri(uri)
    except UnsafeURI as err:
        return [f"{field}: {err}"]
    if uri_allowed(uri, allowed):
        return []
    return [f"{field}={uri!r} is not an allowed {what} (allowed: {allowed}); {stake}. {FIX} ({field}s)."]


def _flag_problems(args: list[str], policy: PlatformPolicy) -> list[str]:
    problems = []
    for arg in args:
        if not arg.startswith("-") or re.fullmatch(r"-?\d+(\.\d+)?([eE]-?\d+)?", arg):
            continue  # a flag's value
        flag = arg.split("=", 1)[0]
        if flag not in policy.vllm_flags:
            problems.append(
                f"vllm_extra_args: flag {flag!r} is not allowed (it may load code, change the "
                f"server's address or auth, or fetch files). {FIX} (vllm_flags)."
            )
    return problems


def trust_problems(
    config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy, *, allow_placeholders: bool = False
) -> list[str]:
    """Every field of the run config and the cluster settings checked by its declared class (`config.trust`):
    `tenant` passes, `volume_path` must lie on the workspace volume, `code` runs only where no credential is,
    `policy` must be allowed by the policy key it names, `platform` must be unset or the platform's value.

    Returns:
        One line per problem, each naming the field and the fix.

    Raises:
        ValueError: a field declares no class, or a `policy` field names a key without a checker (a bug here: the
            run is refused rather than let through).
    """
    ctx = RunContext(config, settings, policy, allow_placeholders)
    problems: list[str] = []
    for field in declared_fields(config, settings):
        trust = field.trust.trust
        if trust is Trust.VOLUME_PATH:
            problems += volume_path_problems(field, ctx)
        elif trust is Trust.CODE:
            problems += code_problems(field, ctx)
        elif trust is Trust.PLATFORM:
            problems += platform_problems(field, ctx)
        elif trust is Trust.POLICY:
            check = POLICY_CHECKS.get(field.trust.policy_key or "")
            if check is None:
                raise ValueError(
                    f"{field.name} names policy key {field.trust.policy_key!r}, which has no checker. Fix: add one "
                    "to k8s_policy.POLICY_CHECKS."
                )
            problems += check(field, ctx)
    return list(dict.fromkeys(problems))  # one line per problem (e.g. vllm_extra_args is read once per run)


def check_run(
    config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy, *, allow_placeholders: bool = False
) -> None:
    """Refuse a run that asks for anything the policy does not allow: every field of the run config and the cluster
    settings by its declared trust class (`trust_problems`; images, the ServiceAccount, secrets, the workspace PVC
    and mount, the MLflow server, an external reward service, LLM judge or teacher, vLLM flags, GPUs per pod,
    scheduling, paths on the volume, code where credentials are, platform-only fields).

    Args:
        settings: as resolved by `resolve_images` (the images the pods will run).
        allow_placeholders: accept images with PLACEHOLDER_DIGEST (rendering documentation, never launching).

    Raises:
        PolicyViolation: one line per problem, each naming the field and the fix.
    """
    problems = trust_problems(config, settings, policy, allow_placeholders=allow_placeholders)
    if problems:
        raise PolicyViolation("the platform policy refuses this run:\n  " + "\n  ".join(problems))


def check_backend_choice(launch_backend: str, policy: PlatformPolicy | None = None) -> None:
    """Refuse the `local` backend inside a Kubernetes pod (a pipeline step): it would run the submitter's
    reward code, data producer and vLLM flags in that pod, next to the MLflow credentials and the launcher's
    ServiceAccount token. Outside a pod (kfp.local, a laptop) anything goes.

    Raises:
        PolicyViolation: launch_backend is "local", this process runs in a pod (KUBERNETES_SERVICE_HOST is
            set) and the policy does not allow user_code_with_credentials.
    """
    if launch_backend != "local" or not in_cluster_pod():
        return
    policy = policy or load_policy()[0]
    if not policy.user_code_with_credentials:
        raise PolicyViolation(
            "launch_backend='local' inside a cluster pod would run the run's reward code next to "
            "the pipeline's credentials and ServiceAccount token. Fix: use launch_backend="
            "kubernetes (reward code then runs in pods without credentials)."
        )


def in_cluster_pod() -> bool:
    """True inside a Kubernetes pod (KUBERNETES_SERVICE_HOST is set by the kubelet)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def work_dir_problems(work_dir: str) -> list[str]:
    """The pipeline's `work_dir` must be the workspace mount (DEFAULT_DATA_MOUNT_PATH) or a normalized folder under
    it: the train step stages data there and the cleanup step deletes `<work_dir>/<run>/staging`."""
    trimmed = work_dir.rstrip("/")
    ok = trimmed == DEFAULT_DATA_MOUNT_PATH or (
        posixpath.normpath(trimmed) == trimmed and trimmed.startswith(DEFAULT_DATA_MOUNT_PATH + "/")
    )
    if ok and "\x00" not in work_dir:
        return []
    return [
        f"work_dir={work_dir!r} is not the workspace volume ({DEFAULT_DATA_MOUNT_PATH}) or a normalized folder "
        f"under it. Fix: leave work_dir at {DEFAULT_DATA_MOUNT_PATH}."
    ]


def check_work_dir(work_dir: str) -> None:
    """In a cluster pod, refuse a `work_dir` off the workspace volume (`work_dir_problems`); elsewhere (kfp.local,
    a laptop) any folder is the user's own.

    Raises:
        PolicyViolation: in a pod, work_dir is not on the workspace volume.
    """
    problems = work_dir_problems(work_dir) if work_dir and in_cluster_pod() else []
    if problems:
        raise PolicyViolation("the platform policy refuses this run:\n  " + "\n  ".join(problems))


def check_namespace(settings: ClusterSettings, own_namespace: str | None) -> None:
    """A launcher in a pod creates objects only in its own namespace (its Role's); `settings.namespace` may not
    name another.

    Raises:
        PolicyViolation: `own_namespace` is known and differs from `settings.namespace`.
    """
    if own_namespace and settings.namespace != own_namespace:
        raise PolicyViolation(
            f"the platform policy refuses this run:\n  namespace={settings.namespace!r} is not this "
            f"launcher's namespace {own_namespace!r}. Fix: drop namespace from kubernetes_options."
        )


def _role(field: str) -> str:
    return field.removesuffix("_image")


def prepare_run(
    config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy, *, allow_placeholders: bool = False
) -> ClusterSettings:
    """`resolve_images` then `check_run`: the settings a run is built with. Raises PolicyViolation."""
    resolved = resolve_images(settings, policy)
    check_run(config, resolved, policy, allow_placeholders=allow_placeholders)
    return resolved


def placeholder_images(settings: ClusterSettings) -> list[str]:
    """The run images that still carry PLACEHOLDER_DIGEST."""
    return [settings.image(r) for r in ("trainer", "vllm", "reward") if settings.image(r).endswith(PLACEHOLDER_DIGEST)]


def registered_model_problems(name: str, policy: PlatformPolicy, action: str = "register a version of") -> list[str]:
    """A cluster run may `action` (register a version of, promote, roll back) the registered model `name` only when
    the policy's `registered_models` lists it (exactly or by an fnmatch pattern): all runs share one MLflow user, so
    the registry itself cannot tell team A's run from team B's.

    Returns:
        One problem naming registered_model_name and the fix, or none.
    """
    if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in policy.registered_models):
        return []
    return [
        f"registered_model_name={name!r}: this namespace may not {action} it (allowed: {policy.registered_models}); "
        f"the registry is shared, and its champion alias is what other runs retrain from. {FIX} (registered_models)."
    ]


def check_registered_model(name: str, policy: PlatformPolicy, action: str = "register a version of") -> None:
    """Refuse `action` on registered model `name` unless the policy allows it (`registered_model_problems`).

    Raises:
        PolicyViolation: the name is not allowed; the message names registered_model_name and the fix.
    """
    problems = registered_model_problems(name, policy, action)
    if problems:
        raise PolicyViolation("the platform policy refuses this run:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------------------------------------ pipeline steps
_REGISTRY_URI = re.compile(r"models:/([^/@]+)(?:/[^/@]+|@[^/@]+)")


def registry_model_name(uri: str) -> str | None:
    """The registered model a `models:/<name>/<version>` or `models:/<name>@<alias>` URI reads; None when `uri` is
    not a registry URI at all (no `models:/` prefix).

    A `models:/` string of any other shape (a host, extra segments, an empty name) is returned whole, so it is judged
    as a name no `registered_models` pattern but `*` covers (the registry's own parser refuses it later anyway).
    """
    if not isinstance(uri, str) or not uri.startswith("models:/"):
        return None
    match = _REGISTRY_URI.fullmatch(uri)
    return match.group(1) if match else uri


def step_problems(
    policy: PlatformPolicy,
    *,
    tracking_uri: str | None = None,
    registered_models: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    work_dir: str = "",
) -> list[str]:
    """What the platform policy says about one pipeline step's own inputs (those `check_run` does not see).

    Args:
        policy: the platform policy.
        tracking_uri: the MLflow server the step would send its credentials to; None: not checked. It must parse
            unambiguously and lie under `mlflow_tracking_uris` (as `check_run` judges a run's URI).
        registered_models: (name, action) pairs: each registered model the step reads or writes and what it does
            to it ("register a version of", "read the champion of", ...), judged by `registered_model_problems`.
        work_dir: the pipeline's work_dir; "" is not checked (`work_dir_problems`).

    Returns:
        One line per problem, each naming the field (mlflow_tracking_uri, registered_model_name, work_dir) and the
        fix; [] when the step may go on.
    """
    problems = work_dir_problems(work_dir) if work_dir else []
    if tracking_uri is not None:
        problems += _uri_problems(
            "mlflow_tracking_uri",
            tracking_uri,
            policy.mlflow_tracking_uris,
            "MLflow server",
            "the step's MLflow credentials would go there",
        )
    for name, action in registered_models:
        problems += registered_model_problems(name, policy, action)
    return problems


def check_step(
    step: str,
    *,
    launch_backend: str | None = None,
    tracking_uri: str | None = None,
    registered_models: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    work_dir: str = "",
    policy: PlatformPolicy | None = None,
) -> PlatformPolicy | None:
    """A pipeline step's decision on its run, taken before it loads any credential (`step_secrets.load_step_secrets`)
    or makes any network call: in a cluster pod (`in_cluster_pod`), or wherever `launch_backend` is "kubernetes".
    Elsewhere (kfp.local, `make demo`, a laptop) nothing is checked and nothing is loaded.

    In a pod, every check of `step_problems` applies: the tracking URI, the registered models (all runs of a
    namespace share one MLflow user, so the registry cannot tell teams apart: reading another team's champion is
    refused as writing it is, so a run neither trains from nor compares against a model its namespace does not
    list), and the work_dir. With the kubernetes backend outside a pod only the tracking URI is checked: there the
    MLflow credentials and the registry are the user's own.

    Args:
        step: the step's name, for the log (e.g. "train_grpo").
        launch_backend: the step's launch backend, if it has one.
        tracking_uri, registered_models, work_dir: as `step_problems`.
        policy: the platform policy; None loads it (`load_policy`: $ASYNC_GRPO_POLICY_FILE, the mounted ConfigMap,
            else the built-in defaults).

    Returns:
        The policy it decided with, or None when nothing was decided (not in a pod, and not the kubernetes backend
        or no tracking URI to judge).

    Raises:
        PolicyViolation: one line per problem, each naming the field and the fix.
        ConfigError: the policy file is missing or invalid.
    """
    in_pod = in_cluster_pod()
    if not in_pod and (launch_backend != "kubernetes" or tracking_uri is None):
        return None  # off the cluster, and nothing this step could be refused for
    if policy is None:
        policy, source = load_policy()
        logger.info("%s: platform policy from %s", step, source)
    problems = step_problems(
        policy,
        tracking_uri=tracking_uri,
        registered_models=registered_models if in_pod else (),
        work_dir=work_dir if in_pod else "",
    )
    if problems:
        raise PolicyViolation("the platform policy refuses this run:\n  " + "\n  ".join(problems))
    return policy


def trust_markdown_table() -> str:
    """The trust class of every run-config and cluster-settings field as a markdown table (docs/security.md holds
    it between `<!-- trust-table -->` markers; `python -c "from async_grpo.launch.k8s_policy import
    trust_markdown_table as t; print(t())"` prints it)."""
    models: list[tuple[str, type[BaseModel]]] = [("run config", RunFields)]
    models += [(f"run config: {section}", model) for section, model in SECTIONS.items()]
    models.append(("cluster settings", ClusterSettings))
    return trust_markdown(models)
