"""The `inference` section: the vLLM servers that generate rollouts: attach to running ones or launch them (port,
dtype, model length, KV cache, GPU memory, tensor parallelism, extra flags), how many replicas, where generation runs
relative to training (`ResourceSharing`: whether the servers share the trainer's cores or GPU; `inference.replicas`
and `runner.resource_sharing` implement it), request timeouts and recovery from a lost server."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import platform_only, policy_list, tenant

ResourceSharing = Literal["auto", "overlap", "time_slice", "adaptive"]


class InferenceConfig(Section):
    """The vLLM server that generates rollouts: attach to one, or how to launch it."""

    # Where generation runs relative to training: how many vLLM servers, and whether they share the trainer's cores
    # or GPU (`inference.replicas` and `runner.resource_sharing` implement them)
    vllm_replicas: int = Field(
        1,
        ge=1,
        description="vLLM servers generating for the run (the vLLM Deployment's replicas on Kubernetes; this "
        "many local servers otherwise). Each request goes to the live replica with the fewest requests in flight; "
        "every weight push reaches every replica; a replica that dies is excluded, recovered and rejoins with the "
        "current weights while the others serve.",
        json_schema_extra=tenant(),
    )
    resource_sharing: ResourceSharing = Field(
        "auto",
        description="How generation and training share the machine. `overlap`: vLLM generates the next "
        "groups while the trainer computes (what pays when each has its own GPUs or cores). `time_slice`: vLLM is "
        "paused (mode keep: requests freeze, nothing is lost) while the trainer runs an optimizer step, so each "
        "gets every core in turn instead of both fighting over them; groups are still generated ahead, between "
        "steps, and scored meanwhile (verl's colocated hybrid engine makes the same trade on one GPU). `adaptive` "
        "(CPU): vLLM is never paused; the vLLM CPU servers this run launches compute on half the cores "
        "(OMP_NUM_THREADS), and the trainer's torch threads follow vLLM's activity: the other half while a "
        "generation request is in flight, every core while vLLM is idle, checked before each decoder layer's "
        "forward and backward (metric trainer/reduced_threads_s). Under adaptive and time_slice, a run that "
        "launched its vLLM servers on its own CPU machine also measures the trainer's thread ceiling over its steps: "
        "every core, or one fewer when that is 20% faster now, e.g. beside another process (metric "
        "trainer/thread_ceiling; not with full_determinism or streaming_min_groups). `auto`: adaptive when this run launched its vLLM "
        "servers on its own CPU machine and the trainer uses every core (torch_num_threads unset or >= the cores), "
        "else overlap (a trainer held to fewer threads leaves vLLM the other cores; attached servers, Kubernetes "
        "pods and GPUs have their own resources). streaming_min_groups cannot be combined with time_slice.",
        json_schema_extra=tenant(),
    )
    # vLLM server resources (TRL names; flags of the server we launch)
    vllm_gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="`--gpu-memory-utilization` of the vLLM server we launch (TRL name; TRL "
        "applies it to a colocated engine, ours is a separate server). None: vLLM's default (0.9). No effect on "
        "the CPU build.",
        json_schema_extra=tenant(),
    )
    vllm_tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="`--tensor-parallel-size` of the vLLM server we launch (TRL name): the server needs "
        "that many GPUs.",
        json_schema_extra=tenant(),
    )
    # Attach or launch, timeouts and recovery
    vllm_url: str | None = Field(
        None,
        description="Attach to running vLLM servers instead of starting them: one URL, "
        "a comma-separated list of vllm_replicas URLs, or one URL whose host name resolves to "
        "the replicas' addresses (a Kubernetes headless Service).",
        json_schema_extra=platform_only(),
    )
    vllm_port: int = Field(
        0, ge=0, le=65535, description="Port for the launched server; 0 picks a free one.", json_schema_extra=tenant()
    )
    vllm_dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "float32",
        description="dtype the launched vLLM server runs the model in (vLLM's --dtype choices; it reaches vLLM's argv, "
        "so nothing else is accepted).",
        json_schema_extra=tenant(),
    )
    vllm_max_model_len: int = Field(
        512, ge=16, description="vLLM --max-model-len (tokens).", json_schema_extra=tenant()
    )
    vllm_kv_cache_gib: int = Field(
        1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build (GiB).", json_schema_extra=tenant()
    )
    vllm_startup_timeout_s: float = Field(
        300.0, gt=0.0, description="Wait this long for vLLM /health (seconds).", json_schema_extra=tenant()
    )
    vllm_request_timeout_s: float = Field(
        120.0, gt=0.0, description="Timeout for one generation request (seconds).", json_schema_extra=tenant()
    )
    vllm_coalesce_window_s: float = Field(
        0.0,
        ge=0.0,
        description="Group requests sent within this many seconds of each other with equal sampling parameters "
        "share one multi-prompt /v1/completions call (up to 128 sequences; what TRL's vllm-serve client does with a "
        "batch); 0 (default) sends each group alone. It pays for short rollouts, where vLLM's per-request work "
        "dominates: one demo step's 16 groups x 8 came back in 0.73-0.77x the time (benchmarks/coalescing.py, 2 "
        "cores); for 128-token completions it changed nothing. A shared call answers when its slowest group is done, "
        "so with long, uneven completions early groups wait. Seeded requests (evaluation, full_determinism) are "
        "always sent alone; a call vLLM refuses is retried prompt by prompt, so a bad prompt fails only its own "
        "group (seconds).",
        json_schema_extra=tenant(),
    )
    vllm_extra_args: list[str] = Field(
        default_factory=list, description="Extra `vllm serve` flags.", json_schema_extra=policy_list("vllm_flags")
    )
    max_inference_restarts: int = Field(
        3,
        ge=0,
        description="Times the run recovers from a vLLM server that died or stopped answering (the local "
        "backend restarts it; on Kubernetes its Deployment does) before it fails with a clear message. Each "
        "recovery re-initialises the weight transfer and pushes the current weights; groups in flight are "
        "generated again, not lost.",
        json_schema_extra=tenant(),
    )
    vllm_recovery_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Longest wait for a lost vLLM server to answer /health again, and for "
        "generation requests parked meanwhile (seconds).",
        json_schema_extra=tenant(),
    )
