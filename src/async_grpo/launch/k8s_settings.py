"""Where and how a run executes on a cluster: the knobs the run config does not hold.

Kept apart from the object builders (`k8s_objects.py`) so KFP components and the CLI can validate
cluster settings without importing anything else; like `GRPOConfig` it is one pydantic model.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from async_grpo import __version__
from async_grpo.config import ConfigError, format_validation_error
from async_grpo.config.trust import platform_only, policy_list, tenant

DEFAULT_REGISTRY = "ghcr.io/async-grpo"
DEFAULT_DATA_MOUNT_PATH = "/workspace"  # where the pipeline's steps and every run pod mount the workspace PVC
# nccl_env may only ever name NCCL_*/GLOO_* variables, and never one that names a file or a library NCCL reads or
# loads: NCCL_CONF_FILE (NCCL 2.23+ reads any variable from it, the plugin ones included), *_PLUGIN, *_FILE.
NCCL_ENV_KEY = re.compile(r"(NCCL|GLOO)_[A-Z0-9_]+")
NCCL_NEVER = re.compile(r"NCCL_CONF_FILE|.*_PLUGIN|.*_FILE|.*_PATH|.*_DIR")
# The tuning and diagnostic variables a run may set by default (the platform policy's `nccl_env_keys`).
NCCL_TUNING_ENV = (
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TC",
    "NCCL_IB_SL",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_SPLIT_DATA_ON_QPS",
    "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_READ",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_BUFFSIZE",
    "NCCL_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD",
    "NCCL_SOCKET_NTHREADS",
    "NCCL_SOCKET_FAMILY",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_CROSS_NIC",
    "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_IGNORE_CPU_AFFINITY",
    "NCCL_LAUNCH_MODE",
    "NCCL_NET_SHARED_BUFFERS",
    "GLOO_DEVICE_TRANSPORT",
)
# Where the workspace may never be mounted: over the image's code, libraries, configuration, HOME (/cache: a user
# site directory or a .pth there would run at start-up) or the pod's scratch and system folders.
PROTECTED_DIRS = (
    "/bin",
    "/boot",
    "/cache",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/models",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/src",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
)


def check_mount_path(value: str) -> str:
    """`value` when it is an absolute, normalized path (no `..`, no `//`, no trailing slash) that neither is, holds
    nor lies in one of PROTECTED_DIRS.

    Raises:
        ValueError: it is not; the message names data_mount_path and the fix.
    """
    if not value.startswith("/") or posixpath.normpath(value) != value or value == "/" or "\x00" in value:
        raise ValueError(
            f"data_mount_path={value!r} must be an absolute, normalized path such as /workspace. "
            "Fix: write it without '..', '.', '//' or a trailing slash."
        )
    clash = [d for d in PROTECTED_DIRS if value == d or value.startswith(d + "/") or d.startswith(value + "/")]
    if clash:
        raise ValueError(
            f"data_mount_path={value!r} would cover or sit inside {clash}, where the images keep "
            "code, configuration or HOME. Fix: use /workspace."
        )
    return value


class ClusterSettings(BaseModel):
    """Where and how a run executes on the cluster (everything the run config does not say).

    Sizes carry their unit in the name (`_gib`, `_s`); `cpu` fields are cores.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(
        "async-grpo",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Namespace of the run.",
        json_schema_extra=policy_list("own_namespace"),
    )
    device: Literal["gpu", "cpu"] = Field(
        "gpu", description="gpu: CUDA images + NCCL; cpu: the CPU image + gloo.", json_schema_extra=tenant()
    )
    image_registry: str | None = Field(
        None,
        description="Registry prefix of our images; None: the platform "
        f"policy's default images, else {DEFAULT_REGISTRY}.",
        json_schema_extra=policy_list("images"),
    )
    image_tag: str | None = Field(
        None,
        description="Tag of our images; None: the platform policy's default "
        "images, else the package version they hold.",
        json_schema_extra=policy_list("images"),
    )
    trainer_image: str | None = Field(
        None, description="Override the trainer image reference.", json_schema_extra=policy_list("images")
    )
    vllm_image: str | None = Field(
        None, description="Override the vLLM image reference.", json_schema_extra=policy_list("images")
    )
    reward_image: str | None = Field(
        None, description="Override the reward-worker image reference.", json_schema_extra=policy_list("images")
    )
    trainer_nodes: int = Field(
        1, ge=1, description="PyTorchJob pods: one Master plus trainer_nodes - 1 Workers.", json_schema_extra=tenant()
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Trainer processes per pod (GPUs per pod on gpu).",
        json_schema_extra=policy_list("max_gpus_per_pod"),
    )
    trainer_cpu: float = Field(
        8.0, gt=0, description="CPU cores requested per trainer pod.", json_schema_extra=tenant()
    )
    trainer_memory_gib: int = Field(64, ge=1, description="Memory per trainer pod (GiB).", json_schema_extra=tenant())
    vllm_gpus: int = Field(
        1,
        ge=1,
        description="GPUs of the vLLM pod (its tensor-parallel size).",
        json_schema_extra=policy_list("max_gpus_per_pod"),
    )
    vllm_cpu: float = Field(8.0, gt=0, description="CPU cores requested by the vLLM pod.", json_schema_extra=tenant())
    vllm_memory_gib: int = Field(64, ge=1, description="Memory of the vLLM pod (GiB).", json_schema_extra=tenant())
    judge_replicas: int = Field(
        1,
        ge=1,
        description="Pods of the LLM judge's vLLM Deployment, behind the `<run>-judge` Service (only when the run "
        "serves `judge_model_name_or_path` for builtin:llm_judge).",
        json_schema_extra=tenant(),
    )
    judge_gpus: int = Field(
        1,
        ge=1,
        description="GPUs per judge pod (its tensor-parallel size).",
        json_schema_extra=policy_list("max_gpus_per_pod"),
    )
    judge_cpu: float = Field(8.0, gt=0, description="CPU cores requested per judge pod.", json_schema_extra=tenant())
    judge_memory_gib: int = Field(64, ge=1, description="Memory per judge pod (GiB).", json_schema_extra=tenant())
    teacher_replicas: int = Field(
        1,
        ge=1,
        description="Pods of the distillation teacher's vLLM Deployment, behind the `<run>-teacher` Service (only "
        "when the run serves `teacher_model_name_or_path`).",
        json_schema_extra=tenant(),
    )
    teacher_gpus: int = Field(
        1,
        ge=1,
        description="GPUs per teacher pod (its tensor-parallel size).",
        json_schema_extra=policy_list("max_gpus_per_pod"),
    )
    teacher_cpu: float = Field(
        8.0, gt=0, description="CPU cores requested per teacher pod.", json_schema_extra=tenant()
    )
    teacher_memory_gib: int = Field(64, ge=1, description="Memory per teacher pod (GiB).", json_schema_extra=tenant())
    reward_replicas: int = Field(
        1,
        ge=0,
        description="Reward-service pods (`python -m async_grpo.rewards.server`, "
        "reward_num_workers processes each) behind the reward Service; the trainer gets "
        "its URL in ASYNC_GRPO_REWARD_URL. 0 scores in a process pool in the trainer pod.",
        json_schema_extra=tenant(),
    )
    reward_cpu: float = Field(2.0, gt=0, description="CPU cores requested per reward pod.", json_schema_extra=tenant())
    reward_memory_gib: int = Field(4, ge=1, description="Memory per reward pod (GiB).", json_schema_extra=tenant())
    shm_size_gib: int = Field(
        16, ge=1, description="Size limit of the /dev/shm emptyDir (GiB).", json_schema_extra=tenant()
    )
    gpu_resource: str = Field(
        "nvidia.com/gpu",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$",
        description="Extended resource name of a GPU (domain-prefixed, e.g. nvidia.com/gpu, amd.com/gpu).",
        json_schema_extra=platform_only(),
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="nodeSelector of the GPU/compute pods.",
        json_schema_extra=policy_list("node_selectors"),
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tolerations of the compute pods.",
        json_schema_extra=policy_list("tolerations"),
    )
    pvc_name: str = Field(
        "async-grpo-workspace",
        description="PVC holding models, datasets and run folders (the pipeline's workspace volume).",
        json_schema_extra=policy_list("pvcs"),
    )
    data_mount_path: str = Field(
        DEFAULT_DATA_MOUNT_PATH,
        description="Where that PVC is mounted in every pod: the same path as "
        "in the pipeline's steps, so paths mean the same everywhere. An absolute, normalized "
        "path outside the image's folders (PROTECTED_DIRS); the platform policy's "
        "data_mount_paths lists the allowed ones.",
        json_schema_extra=policy_list("data_mount_paths"),
    )
    mlflow_tracking_uri: str = Field(
        "http://mlflow:5000",
        description="MLflow tracking server as pods see it, used when the run config sets none.",
        json_schema_extra=policy_list("mlflow_tracking_uris"),
    )
    mlflow_secret: str | None = Field(
        "mlflow-tracking",
        description="Secret whose optional keys "
        "MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN reach the trainer pods (only them).",
        json_schema_extra=policy_list("secrets"),
    )
    service_account: str = Field(
        "async-grpo-workload",
        description="ServiceAccount of run pods (no API rights).",
        json_schema_extra=policy_list("service_accounts"),
    )
    nccl_socket_ifname: str = Field(
        "eth0", description="NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: the pod NIC.", json_schema_extra=tenant()
    )
    nccl_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra NCCL/gloo tuning variables for "
        "trainer and vLLM; the platform policy's nccl_env_keys lists the allowed names "
        "(default NCCL_TUNING_ENV). Never a variable that names a file or a library.",
        json_schema_extra=policy_list("nccl_env_keys"),
    )
    vllm_port: int = Field(8000, ge=1, le=65535, description="vLLM HTTP port.", json_schema_extra=tenant())
    reward_port: int = Field(8080, ge=1, le=65535, description="Reward service HTTP port.", json_schema_extra=tenant())
    weight_transfer_ports: tuple[int, int] = Field(
        (40000, 41999),
        description="Inclusive TCP port range of the weight-transfer rendezvous and NCCL sockets. "
        "Pods get it as their ephemeral range (sysctl net.ipv4.ip_local_port_range); NetworkPolicies open it.",
        json_schema_extra=tenant(),
    )
    restart_policy: Literal["Never", "OnFailure", "ExitCode", "Always"] = Field(
        "OnFailure",
        description="PyTorchJob restart policy of the trainer pods. A restarted trainer resumes from "
        "the newest checkpoint on the PVC (the pod's config sets resume_from_checkpoint: true); Never fails the run "
        "at the first pod failure.",
        json_schema_extra=tenant(),
    )
    backoff_limit: int = Field(
        3,
        ge=0,
        description="PyTorchJob runPolicy.backoffLimit: trainer pod restarts before the job is failed.",
        json_schema_extra=tenant(),
    )
    ttl_after_finished_s: int = Field(
        7 * 24 * 3600, ge=0, description="Finished PyTorchJob kept this long (s).", json_schema_extra=tenant()
    )
    run_as_user: int = Field(
        1000,
        ge=1,
        description="UID (and GID, fsGroup) of every container; never root.",
        json_schema_extra=platform_only(),
    )
    trainer_api: Literal["pytorchjob", "trainjob"] = Field(
        "pytorchjob",
        description="How the trainer is launched: pytorchjob (Training Operator v1, vLLM and reward workers as "
        "Deployments) or trainjob (Kubeflow Trainer v2.3: one TrainJob on the ClusterTrainingRuntime "
        "`trainer_runtime`, every role a replicated job of its JobSet; see k8s_trainjob.py).",
        json_schema_extra=tenant(),
    )
    trainer_runtime: str = Field(
        "async-grpo",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="trainjob: name of the ClusterTrainingRuntime the TrainJob references "
        "(manifests/components/trainer-v2 installs `async-grpo`).",
        json_schema_extra=policy_list("trainer_runtimes"),
    )
    kueue_queue_name: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=63,
        description="trainjob: Kueue LocalQueue of the run (label kueue.x-k8s.io/queue-name); None: not queued.",
        json_schema_extra=policy_list("kueue_queues"),
    )
    priority_class_name: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description="PriorityClass of every run pod (trainjob: Kueue's kueue.x-k8s.io/priority-class label too).",
        json_schema_extra=policy_list("priority_classes"),
    )

    @field_validator("nccl_env")
    @classmethod
    def _check_nccl_env(cls, value: dict[str, str]) -> dict[str, str]:
        """Only NCCL_*/GLOO_* variables, never one naming a file or library (NCCL_NEVER), values printable ASCII."""
        bad = sorted(k for k in value if not NCCL_ENV_KEY.fullmatch(k) or NCCL_NEVER.fullmatch(k))
        if bad:
            raise ValueError(
                f"nccl_env may only set NCCL/gloo tuning variables, not {bad}. Fix: drop them "
                "(LD_PRELOAD, PYTHONPATH, NCCL_CONF_FILE or a plugin would load code into the pods)."
            )
        odd = sorted(k for k, v in value.items() if not isinstance(v, str) or not all(0x20 <= ord(c) < 0x7F for c in v))
        if odd:
            raise ValueError(f"nccl_env values of {odd} hold control or non-ASCII characters. Fix: give plain values.")
        return value

    @field_validator("data_mount_path")
    @classmethod
    def _check_data_mount_path(cls, value: str) -> str:
        return check_mount_path(value)

    @model_validator(mode="after")
    def _check_ports(self) -> ClusterSettings:
        """The weight-transfer range must be ordered, wide enough, and clear of the HTTP ports."""
        lo, hi = self.weight_transfer_ports
        if not 1024 < lo < hi <= 65535 or hi - lo < 255:
            raise ValueError(
                f"weight_transfer_ports={self.weight_transfer_ports} must be an ordered range of "
                "at least 256 ports within 1025-65535. Fix: e.g. (40000, 41999)."
            )
        if lo <= self.vllm_port <= hi or lo <= self.reward_port <= hi:
            raise ValueError("vllm_port/reward_port fall inside weight_transfer_ports. Fix: move one of them.")
        return self

    @model_validator(mode="after")
    def _check_trainer_api(self) -> ClusterSettings:
        """Kueue and Trainer v2 settings only mean something with trainer_api: trainjob."""
        if self.trainer_api == "pytorchjob" and self.kueue_queue_name:
            raise ValueError(
                f"kueue_queue_name={self.kueue_queue_name!r} needs trainer_api: trainjob (the PyTorchJob path "
                "is not queued). Fix: set trainer_api: trainjob, or drop kueue_queue_name."
            )
        return self

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> ClusterSettings:
        """Validate a mapping of fields (YAML, CLI `--set`, the pipeline's `kubernetes_options`).

        Raises:
            ConfigError: unknown or invalid fields; the message names each and the fix.
        """
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            text = format_validation_error(err).replace("invalid config", "invalid cluster settings")
            raise ConfigError(text.replace("against GRPOConfig", "against ClusterSettings")) from None

    def image(self, role: Literal["trainer", "vllm", "reward"]) -> str:
        """Image reference of `role`: the override, else `<registry>/<name>:<tag>` (cpu: one image for trainer and
        vLLM); `k8s_policy.resolve_images` first fills the overrides from the platform's default images."""
        override = {"trainer": self.trainer_image, "vllm": self.vllm_image, "reward": self.reward_image}[role]
        if override:
            return override
        name = "cpu" if self.device == "cpu" and role != "reward" else role
        return f"{self.image_registry or DEFAULT_REGISTRY}/{name}:{self.image_tag or __version__}"


def with_trainer_api(options: Mapping[str, Any] | None, trainer_api: str) -> dict[str, Any]:
    """`options` (ClusterSettings fields) with the pipeline's typed `trainer_api` parameter merged in; "" leaves them
    as they are.

    Raises:
        ConfigError: `options` names another `trainer_api` than the parameter (set it in one place).
    """
    merged = dict(options or {})
    if not trainer_api:
        return merged
    if merged.get("trainer_api", trainer_api) != trainer_api:
        raise ConfigError(
            f"trainer_api={trainer_api!r} but kubernetes_options sets trainer_api={merged['trainer_api']!r}. "
            "Fix: set it in one place."
        )
    merged["trainer_api"] = trainer_api
    return merged
