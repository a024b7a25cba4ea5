"""The platform's allow-list: what a run submitter may choose on the cluster, set by the platform engineer.

A submitter controls the run config and `ClusterSettings` (the pipeline's `kubernetes_options`); the
platform engineer controls this policy, in ConfigMap `async-grpo-policy` (manifests/base/policy.yaml),
which the pipeline mounts into its steps. `check_run` is the one gate: `render`, `pipeline submit`,
the kubernetes backend and the evaluate step all call it, so a run that passes one passes all.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from async_grpo.config import ConfigError, GRPOConfig, format_validation_error
from async_grpo.launch.image_refs import BadImageReference, parse_image_ref, prefix_covers
from async_grpo.launch.k8s_judge import serves_judge
from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH, NCCL_TUNING_ENV, ClusterSettings, check_mount_path
from async_grpo.launch.uris import UnsafeURI, parse_http_uri, uri_allowed
from async_grpo.user_code import is_file_spec, split_adapter

logger = logging.getLogger(__name__)

POLICY_FILE_ENV = "ASYNC_GRPO_POLICY_FILE"
POLICY_CONFIG_MAP = "async-grpo-policy"
POLICY_MOUNT_DIR = "/etc/async-grpo/policy"  # where the pipeline mounts the ConfigMap
POLICY_KEY = "policy.yaml"
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64  # marks "set your image's digest here" in the manifests
METADATA_CIDRS = ("169.254.169.254/32", "fd00:ec2::254/128")  # cloud metadata endpoints, never reachable
FIX = f"Fix: change it, or ask your platform engineer to allow it in ConfigMap {POLICY_CONFIG_MAP}"
# vLLM flags a submitter may pass in vllm_extra_args: sizing and scheduling only. Flags that load code
# (--trust-remote-code, --worker-extension-cls, --middleware, plugins), change auth or the listening
# address, or fetch files are absent on purpose; the platform may widen the list.
DEFAULT_VLLM_FLAGS = (
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--kv-cache-dtype",
    "--block-size",
    "--swap-space",
    "--cpu-offload-gb",
    "--quantization",
    "--enforce-eager",
    "--pipeline-parallel-size",
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--enable-expert-parallel",
    "--disable-custom-all-reduce",
    "--max-logprobs",
    "--scheduling-policy",
    "--long-prefill-token-threshold",
    "--max-num-partial-prefills",
    "--async-scheduling",
    "--served-model-name",
    "--tokenizer-mode",
)


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


class EgressRule(BaseModel):
    """One extra egress destination opened by the platform (an external MLflow, an object store, a judge API).

    A range that holds a cloud metadata address gets it carved out (`except`): metadata is never reachable.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cidr: str = Field(description="Destination range, e.g. 10.20.0.0/16.")
    except_cidrs: list[str] = Field(default_factory=list, description="Ranges carved out of `cidr`.")
    ports: list[int] = Field(default_factory=list, description="TCP ports; empty opens every port.")

    @field_validator("cidr", "except_cidrs")
    @classmethod
    def _valid_cidrs(cls, value: Any) -> Any:
        for cidr in [value] if isinstance(value, str) else value:
            ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad range
        return value

    def ip_block(self) -> dict[str, Any]:
        """The NetworkPolicy `ipBlock`, with every metadata address inside `cidr` excepted."""
        net = ipaddress.ip_network(self.cidr, strict=False)
        excepts = list(self.except_cidrs)
        for meta in METADATA_CIDRS:
            m = ipaddress.ip_network(meta)
            if m.version == net.version and m.subnet_of(net) and meta not in excepts:
                excepts.append(meta)
        return {"cidr": str(net), **({"except": excepts} if excepts else {})}


class PlatformPolicy(BaseModel):
    """What runs in this namespace may use. Defaults are the base manifests' values (and are strict).

    Images are allowed by prefix (`image_prefixes`) or exact reference (`images`); with `require_digest`
    each must also be pinned (`@sha256:...`). `default_images` (keys trainer, vllm, reward, cpu) are the
    references a run gets when it names no image of its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_prefixes: list[str] = Field(
        default_factory=lambda: ["ghcr.io/async-grpo/"],
        description="Allowed image reference prefixes (registry/repository).",
    )
    images: list[str] = Field(default_factory=list, description="Allowed exact image references.")
    require_digest: bool = Field(False, description="Every run image must be pinned by digest.")
    default_images: dict[str, str] = Field(
        default_factory=dict, description="Image per role (trainer, vllm, reward, cpu) for runs that name none."
    )
    service_accounts: list[str] = Field(
        default_factory=lambda: ["async-grpo-workload"], description="ServiceAccounts run pods may use."
    )
    secrets: list[str] = Field(
        default_factory=lambda: ["mlflow-tracking", "hf-token"],
        description="Secrets a run or a pipeline step may read.",
    )
    pvcs: list[str] = Field(
        default_factory=lambda: ["async-grpo-workspace"],
        description="PersistentVolumeClaims a run may mount as its workspace.",
    )
    data_mount_paths: list[str] = Field(
        default_factory=lambda: ["/workspace"],
        description="Paths at which a run "
        "may mount the workspace PVC (data_mount_path); the pipeline mounts it at "
        "/workspace.",
    )
    nccl_env_keys: list[str] = Field(
        default_factory=lambda: list(NCCL_TUNING_ENV),
        description="NCCL/gloo variables a run may set in nccl_env (never one naming a file or library).",
    )
    mlflow_tracking_uris: list[str] = Field(
        default_factory=lambda: ["http://mlflow:5000"],
        description="MLflow servers a run may log to (and send credentials).",
    )
    reward_urls: list[str] = Field(default_factory=list, description="External reward services (reward_url).")
    judge_urls: list[str] = Field(
        default_factory=list, description="LLM judges a run may send its completions to (judge_url)."
    )
    max_gpus_per_pod: int | None = Field(
        None,
        ge=1,
        description="Most GPUs one run pod may ask for (trainer nproc_per_node, vllm_gpus, judge_gpus); None: no cap.",
    )
    vllm_flags: list[str] = Field(
        default_factory=lambda: list(DEFAULT_VLLM_FLAGS), description="Flags allowed in vllm_extra_args."
    )
    user_code_with_credentials: bool = Field(
        False,
        description="Allow submitter code to run where credentials "
        "are: reward functions or a data producer loaded from files in the "
        "trainer pod, or the local backend inside a pipeline pod.",
    )
    dns_namespace: str = Field("kube-system", description="Namespace of the cluster DNS pods.")
    dns_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"k8s-app": "kube-dns"}, description="Labels of the cluster DNS pods."
    )
    mlflow_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "mlflow"},
        description="Labels of the in-namespace MLflow server pods.",
    )
    mlflow_port: int = Field(5000, ge=1, le=65535, description="Port of the MLflow server pods.")
    trainer_egress: list[EgressRule] = Field(
        default_factory=list,
        description="Extra trainer egress (an MLflow server or object store outside the namespace).",
    )
    reward_egress: list[EgressRule] = Field(
        default_factory=list, description="Egress of reward pods (none: reward code reaches nothing, not even DNS)."
    )
    registered_models: list[str] = Field(
        default_factory=list,
        description="MLflow registered-model names runs of this namespace may write, promote and roll back: exact "
        "names or fnmatch patterns (`team-a-*`). All runs share the server's MLflow user, so this list is what keeps "
        "one team from registering a version of, or moving the champion alias of, another team's model. Empty: "
        "no name (a cluster run that asks to register is refused, naming registered_model_name).",
    )
    trainer_runtimes: list[str] = Field(
        default_factory=lambda: ["async-grpo"],
        description="ClusterTrainingRuntimes a TrainJob may reference (trainer_runtime): a runtime fixes the "
        "images, commands and volumes of every pod it creates.",
    )
    priority_classes: list[str] = Field(
        default_factory=list,
        description="PriorityClasses a run's pods may use (priority_class_name); a high one preempts other "
        "teams' pods. Empty: none, the cluster's default priority.",
    )
    kueue_queues: list[str] = Field(
        default_factory=list,
        description="Kueue LocalQueues a TrainJob may join (kueue_queue_name). Empty: none.",
    )
    node_selectors: dict[str, list[str]] = Field(
        default_factory=lambda: {"nvidia.com/gpu.present": ["true"]},
        description="nodeSelector labels a run may set and their allowed values (node_selector): a selector steers "
        "pods onto nodes, e.g. another team's reserved pool.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations a run may give its pods (tolerations), each exactly as listed: a toleration admits "
        "pods onto tainted, reserved nodes.",
    )
    platform_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Values of platform-only fields (run config or cluster settings, `trust.Trust.PLATFORM`) that "
        "this cluster uses instead of their defaults, e.g. {run_as_user: 2000, gpu_resource: amd.com/gpu, "
        "python_tool_bwrap: /usr/bin/bwrap}. A run may leave such a field out or repeat this value; any other "
        "value is refused, naming the field.",
    )

    @field_validator("images")
    @classmethod
    def _valid_images(cls, value: list[str]) -> list[str]:
        """Each allowed reference parses in full (`image_refs.parse_image_ref`)."""
        for ref in value:
            parse_image_ref(ref)
        return value

    @field_validator("default_images")
    @classmethod
    def _valid_default_images(cls, value: dict[str, str]) -> dict[str, str]:
        """Each default image parses in full, under a known role."""
        unknown = sorted(set(value) - {"trainer", "vllm", "reward", "cpu"})
        if unknown:
            raise ValueError(f"default_images has unknown roles {unknown}. Fix: use trainer, vllm, reward, cpu.")
        for ref in value.values():
            parse_image_ref(ref)
        return value

    @field_validator("image_prefixes")
    @classmethod
    def _valid_prefixes(cls, value: list[str]) -> list[str]:
        """Each prefix is `registry[/path...][/]` in plain characters."""
        for prefix in value:
            if not re.fullmatch(r"[a-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)*/?", prefix):
                raise ValueError(f"image_prefixes entry {prefix!r} is not registry[/path][/]. Fix: e.g. ghcr.io/org/.")
        return value

    @field_validator("mlflow_tracking_uris", "reward_urls", "judge_urls")
    @classmethod
    def _valid_uris(cls, value: list[str]) -> list[str]:
        """Each allowed server parses unambiguously (`uris.parse_http_uri`)."""
        for uri in value:
            parse_http_uri(uri)
        return value

    @field_validator("data_mount_paths")
    @classmethod
    def _valid_mount_paths(cls, value: list[str]) -> list[str]:
        """Each path passes `k8s_settings.check_mount_path`."""
        for path in value:
            check_mount_path(path)
        return value

    @classmethod
    def from_yaml(cls, text: str, source: str) -> PlatformPolicy:
        """Parse a policy YAML mapping.

        Raises:
            ConfigError: not a mapping, unknown or invalid fields (named, with `source`).
        """
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"platform policy {source} must be a YAML mapping of field: value.")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            text = format_validation_error(err).replace("invalid config", f"invalid platform policy {source}")
            raise ConfigError(text.replace("against GRPOConfig", "against PlatformPolicy")) from None


def load_policy(path: str | Path | None = None) -> tuple[PlatformPolicy, str]:
    """The platform policy: from `path`, else the file named by $ASYNC_GRPO_POLICY_FILE, else the mounted
    ConfigMap (POLICY_MOUNT_DIR/policy.yaml), else the built-in defaults. Returns (policy, its source).

    Raises:
        ConfigError: a named file does not exist or holds an invalid policy.
    """
    named = path or os.environ.get(POLICY_FILE_ENV)
    mounted = Path(POLICY_MOUNT_DIR) / POLICY_KEY
    if named:
        p = Path(named)
        if not p.is_file():
            raise ConfigError(
                f"platform policy file {str(p)!r} does not exist. Fix: give the path of a YAML "
                f"copy of ConfigMap {POLICY_CONFIG_MAP} (key {POLICY_KEY})."
            )
    elif mounted.is_file():
        p = mounted
    else:
        return PlatformPolicy(), "built-in defaults"
    return PlatformPolicy.from_yaml(p.read_text(), str(p)), str(p)


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
    """`settings` with each image the run does not choose (no override, no image_registry/image_tag) set to
    the policy's default image for that role, where the policy has one."""
    if settings.image_registry is not None or settings.image_tag is not None:
        return settings
    update = {
        f: policy.default_images[name]
        for f, name in image_roles(settings).items()
        if getattr(settings, f) is None and name in policy.default_images
    }
    return settings.model_copy(update=update) if update else settings


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


def on_volume(path: str, settings: ClusterSettings) -> bool:
    """True when `path` is a normalized absolute path under the workspace mount: no `..` or `.` segment, no `//`
    (`posixpath.normpath` leaves it unchanged but for a trailing slash), no NUL, inside `data_mount_path` by
    segment."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return False
    trimmed = path.rstrip("/") or "/"
    return posixpath.normpath(trimmed) == trimmed and trimmed.startswith(settings.data_mount_path + "/")


def path_problems(config: GRPOConfig, settings: ClusterSettings) -> list[str]:
    """Every path the run reads on the cluster must lie on the workspace volume (`on_volume`): the model (or
    builtin:tiny, or a `models:/` registry URI, downloaded onto the volume by the train step), the datasets (or builtin tasks), a checkpoint to resume from, each submitter file named by
    reward_funcs, tools, data_producer and environment, and the judge model the run serves (a path on the volume only). Returns one problem per path that does not, naming the field and the fix.
    """
    mount = settings.data_mount_path
    fix = f"Fix: copy it onto PVC {settings.pvc_name!r} and name it as {mount}/<path>, without '..' or '//'"
    checked = [
        ("model_name_or_path", config.model_name_or_path, "the model folder"),
        ("dataset", config.data.dataset, "the dataset"),
        ("eval_dataset", config.data.eval_dataset, "the dataset"),
    ]
    resume = config.checkpoint.resume_from_checkpoint
    if isinstance(resume, str):
        checked.append(("resume_from_checkpoint", resume, "the checkpoint"))
    for field, specs in (
        ("reward_funcs", config.rewards.reward_funcs),
        ("tools", config.tools.tools),
        ("data_producer", [config.producer.data_producer]),
        ("environment", [split_adapter(config.environments.environment)[1]]),  # openenv:f.py:x -> f.py:x
    ):
        checked += [(field, spec.rsplit(":", 1)[0], f"the file of {spec!r}") for spec in specs if is_file_spec(spec)]
    problems = _judge_model_problems(config, settings, fix)
    return problems + [
        f"{field}={value!r}: on Kubernetes {what} must be a builtin, a normalized path on the shared volume (run "
        f"pods reach no hub) or, for the model, an MLflow registry URI (models:/...). {fix}."
        for field, value, what in checked
        if value is not None
        and not value.startswith("builtin:")
        and not on_volume(value, settings)
        # the train step downloads a registry version from the run's (allowed) MLflow server onto the volume, into
        # the run's folder, before any pod starts (`warm_start.resolve_warm_start`); the pods see only that folder
        and not (field == "model_name_or_path" and value.startswith("models:/"))
    ]


def _judge_model_problems(config: GRPOConfig, settings: ClusterSettings, fix: str) -> list[str]:
    """A judge model the run serves (builtin:llm_judge with judge_model_name_or_path) is read by the judge's vLLM pod
    from the workspace volume: a normalized path there, never a builtin, a hub id or a registry URI (nothing
    downloads it)."""
    model = config.rewards.judge_model_name_or_path
    if not serves_judge(config) or on_volume(model, settings):
        return []
    return [
        f"judge_model_name_or_path={model!r}: on Kubernetes the judge's model folder must be a normalized path on "
        f"the shared volume (the judge's pod reaches no hub and nothing downloads it). {fix}."
    ]


def _gpu_problems(config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy) -> list[str]:
    """Each GPU pod of the run asks for at most `max_gpus_per_pod` GPUs: trainer (nproc_per_node), vLLM (vllm_gpus)
    and the judge it serves (judge_gpus)."""
    cap = policy.max_gpus_per_pod
    if cap is None or settings.device != "gpu":
        return []
    asked = {"nproc_per_node": settings.nproc_per_node, "vllm_gpus": settings.vllm_gpus}
    if serves_judge(config):
        asked["judge_gpus"] = settings.judge_gpus
    return [
        f"{field}={n} asks for more GPUs per pod than the platform allows ({cap}). {FIX} (max_gpus_per_pod)."
        for field, n in asked.items()
        if n > cap
    ]


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


def check_run(
    config: GRPOConfig, settings: ClusterSettings, policy: PlatformPolicy, *, allow_placeholders: bool = False
) -> None:
    """Refuse a run that asks for anything the policy does not allow: images, the ServiceAccount, secrets,
    the workspace PVC, the MLflow server, an external reward service or LLM judge (`judge_url`; the judge a run
    serves itself from `judge_model_name_or_path` runs the vLLM image and is checked as the policy's vLLM is), vLLM
    flags, GPUs per pod, user code in the trainer.

    Args:
        settings: as resolved by `resolve_images` (the images the pods will run).
        allow_placeholders: accept images with PLACEHOLDER_DIGEST (rendering documentation, never launching).

    Raises:
        PolicyViolation: one line per problem, each naming the field and the fix.
    """
    problems: list[str] = []
    for field in image_roles(settings):
        problems += _image_problems(field, settings.image(_role(field)), policy, allow_placeholders)
    if settings.service_account not in policy.service_accounts:
        problems.append(
            f"service_account={settings.service_account!r} is not allowed (allowed: "
            f"{policy.service_accounts}). {FIX} (service_accounts)."
        )
    if settings.mlflow_secret is not None and settings.mlflow_secret not in policy.secrets:
        problems.append(
            f"mlflow_secret={settings.mlflow_secret!r} is not an allowed secret (allowed: "
            f"{policy.secrets}). {FIX} (secrets)."
        )
    if settings.data_mount_path not in policy.data_mount_paths:
        problems.append(
            f"data_mount_path={settings.data_mount_path!r} is not an allowed mount path (allowed: "
            f"{policy.data_mount_paths}). {FIX} (data_mount_paths)."
        )
    unknown_nccl = sorted(set(settings.nccl_env) - set(policy.nccl_env_keys))
    if unknown_nccl:
        problems.append(
            f"nccl_env sets {unknown_nccl}, which are not allowed NCCL/gloo variables (allowed: "
            f"{policy.nccl_env_keys}). {FIX} (nccl_env_keys)."
        )
    if settings.pvc_name not in policy.pvcs:
        problems.append(
            f"pvc_name={settings.pvc_name!r} is not an allowed workspace volume (allowed: {policy.pvcs}). {FIX} (pvcs)."
        )
    uri = config.tracking.mlflow_tracking_uri or settings.mlflow_tracking_uri
    problems += _uri_problems(
        "mlflow_tracking_uri",
        uri,
        policy.mlflow_tracking_uris,
        "MLflow server",
        "the run's MLflow credentials would go there",
    )
    if config.rewards.reward_url and not settings.reward_replicas:
        problems += _uri_problems(
            "reward_url",
            config.rewards.reward_url,
            policy.reward_urls,
            "reward service",
            "every rollout would be sent there",
        )
    if config.rewards.judge_url:
        problems += _uri_problems(
            "judge_url",
            config.rewards.judge_url,
            policy.judge_urls,
            "LLM judge",
            "every completion (and the judge token) would be sent there",
        )
    problems += _flag_problems(config.vllm_serve_args, policy)
    problems += _gpu_problems(config, settings, policy)
    problems += path_problems(config, settings)
    if not policy.user_code_with_credentials:
        in_trainer = (
            [s for s in config.rewards.reward_funcs if is_file_spec(s)]
            if not (settings.reward_replicas or config.rewards.reward_url)
            else []
        )
        if in_trainer:
            problems.append(
                f"reward_funcs {in_trainer} are files and reward_replicas=0 would run them in the "
                "trainer pod, which holds the MLflow credentials. Fix: set reward_replicas >= 1 (they "
                "then run in reward pods without credentials)."
            )
        tools = (
            [s for s in config.tools.tools if is_file_spec(s)]
            if not (settings.reward_replicas or config.rewards.reward_url)
            else []
        )
        if tools:  # tool calls run where rewards are scored: the reward pods, or else the trainer pod
            problems.append(
                f"tools {tools} are files and reward_replicas=0 would run them in the trainer pod, which "
                "holds the MLflow credentials. Fix: set reward_replicas >= 1 (tool calls then run in the "
                "reward pods, without credentials)."
            )
        init = config.model_init_kwargs or {}
        odd = sorted(set(init) - set(SAFE_INIT_KWARGS))
        attention = init.get("attn_implementation")
        if odd or (attention is not None and attention not in BUILTIN_ATTENTION):
            problems.append(
                f"model_init_kwargs {odd or {'attn_implementation': attention}} may load files or "
                f"compiled kernels in the trainer pod, which holds the MLflow credentials. Fix: use only "
                f"{list(SAFE_INIT_KWARGS)}, with attn_implementation one of {list(BUILTIN_ATTENTION)}."
            )
        if config.trust_remote_code:
            problems.append(
                "trust_remote_code=true would run the model folder's Python code in the trainer pod, "
                "which holds the MLflow credentials. Fix: use a model that transformers supports "
                "natively, or ask your platform engineer to set user_code_with_credentials."
            )
        if config.producer.data_producer and is_file_spec(config.producer.data_producer):
            problems.append(
                f"data_producer={config.producer.data_producer!r} is a file: it would run in the trainer pod, "
                "which holds the MLflow credentials. Fix: install it in the trainer image and name it "
                f"as pkg.module:factory, or ask your platform engineer to set user_code_with_credentials."
            )
        environment = config.environments.environment
        if environment and is_file_spec(environment):  # the environment rollout runs in the trainer pod
            problems.append(
                f"environment={environment!r} is a file: it would run in the trainer pod, which holds the MLflow "
                "credentials. Fix: install it in the trainer image and name it as pkg.module:factory, or ask your "
                "platform engineer to set user_code_with_credentials."
            )
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
