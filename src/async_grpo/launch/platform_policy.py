"""The platform policy itself: the document in which the platform engineer says what the runs of a namespace may use
(ConfigMap `async-grpo-policy`, key `policy.yaml`; manifests/base/policy.yaml), and where it is read from.

`k8s_policy` is the gate that checks a run against it (`check_run`, `trust_problems`). This module only parses and
validates the document, so that whatever reads the policy (the object builders, the pipeline's steps, the launcher)
sees one model with one set of validators.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from async_grpo.config import ConfigError, format_validation_error
from async_grpo.config.sections.distillation import TEACHER_API_KEY_ENV
from async_grpo.config.trust import Trust, trust_table
from async_grpo.launch.image_refs import parse_image_ref
from async_grpo.launch.k8s_settings import NCCL_TUNING_ENV, ClusterSettings, check_mount_path
from async_grpo.launch.uris import parse_http_uri, uri_allowed

POLICY_FILE_ENV = "ASYNC_GRPO_POLICY_FILE"
POLICY_CONFIG_MAP = "async-grpo-policy"
POLICY_MOUNT_DIR = "/etc/async-grpo/policy"  # where the pipeline mounts the ConfigMap
POLICY_KEY = "policy.yaml"
SECRET_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"  # a DNS-1123 subdomain
METADATA_CIDRS = ("169.254.169.254/32", "fd00:ec2::254/128")  # cloud metadata endpoints, never reachable
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
    teacher_urls: list[str] = Field(
        default_factory=list,
        description="Distillation teachers a run may send every sampled completion to (teacher_url); the trainer "
        "asks them, so the platform also opens their range in trainer_egress.",
    )
    teacher_token_secrets: dict[str, str] = Field(
        default_factory=dict,
        description="Bearer tokens of the teachers in teacher_urls: an entry of teacher_urls -> the name of a Secret "
        f"in the run's namespace whose key {TEACHER_API_KEY_ENV} holds that teacher's token. A run whose teacher_url "
        "lies under the entry (the longest one, when several cover it) gets that key in its trainer pods as "
        f"{TEACHER_API_KEY_ENV}, and no other pod does. The platform binds each token to its teacher here: no run "
        "field names a Secret, so no run can send one teacher's token to another.",
    )
    max_gpus_per_pod: int | None = Field(
        None,
        ge=1,
        description="Most GPUs one run pod may ask for (trainer nproc_per_node, vllm_gpus, judge_gpus, teacher_gpus); "
        "None: no cap.",
    )
    vllm_flags: list[str] = Field(
        default_factory=lambda: list(DEFAULT_VLLM_FLAGS), description="Flags allowed in vllm_extra_args."
    )
    code_modules: list[str] = Field(
        default_factory=lambda: ["trl.rewards"],
        description="Image modules (exact names or fnmatch patterns, e.g. `acme_rewards.*`) whose code a run may run "
        "in the trainer pod, which holds the MLflow credentials: a data_producer, an environment (a verifiers "
        "taskset id names its module), and an agent function, reward functions or tools when reward_replicas=0. "
        "A module is image code, but any function of any module can be named, so only the listed ones run beside "
        "credentials.",
    )
    user_code_with_credentials: bool = Field(
        False,
        description="Allow submitter code to run where credentials "
        "are: a data producer or an environment loaded from files in the trainer pod; with reward_replicas=0, "
        "reward functions, tools or an agent loaded from files, or an agent_command, in the trainer pod; or the "
        "local backend inside a pipeline pod.",
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
    trainjob_status_namespace: str | None = Field(
        None,
        description="Namespace of the Kubeflow Trainer controller whose status server collects a TrainJob's "
        "progress (KEP-2779, feature gate TrainJobStatus; e.g. kubeflow-system). Set, trainer pods of a "
        "trainer_api: trainjob run may reach its pods (`trainjob_status_pod_labels`) on `trainjob_status_port`, "
        "and `kubectl get trainjob` shows the run's progress; None (default): no such egress, and the trainer's "
        "progress reports fail quietly.",
    )
    trainjob_status_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "trainer"},
        description="Labels of the Kubeflow Trainer controller pods (with trainjob_status_namespace).",
    )
    trainjob_status_port: int = Field(
        8080, ge=1, le=65535, description="Port of the controller's status server (with trainjob_status_namespace)."
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
        description="Values of platform-only cluster settings (`config.trust.Trust.PLATFORM` fields of "
        "ClusterSettings) that this cluster uses instead of their defaults, e.g. {run_as_user: 2000, gpu_resource: "
        "amd.com/gpu}; every run gets them. A run may leave such a field out or repeat this value; any other value is "
        "refused, naming the field. Platform-only run-config fields (the sandbox's programs, vllm_url) always keep "
        "their defaults on a cluster: the images provide bwrap and Python, the launcher the vLLM address.",
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

    @field_validator("mlflow_tracking_uris", "reward_urls", "judge_urls", "teacher_urls")
    @classmethod
    def _valid_uris(cls, value: list[str]) -> list[str]:
        """Each allowed server parses unambiguously (`uris.parse_http_uri`)."""
        for uri in value:
            parse_http_uri(uri)
        return value

    @field_validator("teacher_token_secrets")
    @classmethod
    def _valid_teacher_token_secrets(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """Each key is an entry of teacher_urls, each value a Secret name (a DNS-1123 subdomain)."""
        allowed = info.data.get("teacher_urls", [])
        for url, secret in value.items():
            if url not in allowed:
                raise ValueError(
                    f"teacher_token_secrets names {url!r}, which is not an entry of teacher_urls ({allowed}). Fix: "
                    "key each Secret by the teacher_urls entry it is the token of."
                )
            if len(secret) > 253 or not re.fullmatch(SECRET_NAME, secret):
                raise ValueError(
                    f"teacher_token_secrets[{url!r}]={secret!r} is not a Secret name (a DNS-1123 subdomain: lowercase "
                    "letters, digits, '-' and '.'). Fix: name the Secret holding that teacher's token."
                )
        return value

    def teacher_token_secret(self, teacher_url: str) -> str | None:
        """The Secret holding the bearer token of `teacher_url`: the value of the longest `teacher_token_secrets`
        entry that covers it (`uris.uri_allowed`), or None (no token: the teacher is asked without one)."""
        covering = [url for url in self.teacher_token_secrets if uri_allowed(teacher_url, [url])]
        return self.teacher_token_secrets[max(covering, key=len)] if covering else None

    @field_validator("data_mount_paths")
    @classmethod
    def _valid_mount_paths(cls, value: list[str]) -> list[str]:
        """Each path passes `k8s_settings.check_mount_path`."""
        for path in value:
            check_mount_path(path)
        return value

    @field_validator("platform_settings")
    @classmethod
    def _valid_platform_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Each key is a platform-only ClusterSettings field, and its value validates as that field."""
        platform = {n for n, t in trust_table(ClusterSettings) if t is not None and t.trust is Trust.PLATFORM}
        unknown = sorted(set(value) - platform)
        if unknown:
            raise ValueError(
                f"platform_settings names {unknown}, which are not platform-only cluster settings. Fix: use "
                f"{sorted(platform)}."
            )
        ClusterSettings.model_validate(value)  # ValidationError names a bad value
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
