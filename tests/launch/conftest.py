"""Fixtures of the launch tests: the two reference cluster setups (2 nodes x 8 GPUs, and CPU)."""

from __future__ import annotations

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.launch.k8s_objects import ClusterSettings

RUN = "agrpo-test-abc123"


@pytest.fixture
def gpu_config() -> GRPOConfig:
    """A Qwen-class GPU run whose model sits on the shared PVC."""
    return GRPOConfig(
        model_name_or_path="/workspace/models/Qwen2.5-1.5B-Instruct",
        dataset="/workspace/datasets/math.jsonl",
        vllm_dtype="bfloat16",
        vllm_extra_args=["--gpu-memory-utilization", "0.85"],
    )


@pytest.fixture
def gpu_settings() -> ClusterSettings:
    """Trainer on 2 nodes x 8 GPUs, vLLM on 8 GPUs, GPU node selector and taint toleration."""
    return ClusterSettings(
        namespace="team-a",
        device="gpu",
        trainer_nodes=2,
        nproc_per_node=8,
        vllm_gpus=8,
        reward_replicas=1,
        node_selector={"nvidia.com/gpu.present": "true"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        nccl_env={"NCCL_IB_DISABLE": "1"},
    )


@pytest.fixture
def cpu_config() -> GRPOConfig:
    """The tiny builtin model on the reverse task."""
    return GRPOConfig(model_name_or_path="builtin:tiny", dataset="builtin:reverse")


@pytest.fixture
def cpu_settings() -> ClusterSettings:
    """Everything on CPU (dev overlay)."""
    return ClusterSettings(
        namespace="async-grpo",
        device="cpu",
        reward_replicas=1,
        trainer_cpu=2,
        trainer_memory_gib=8,
        vllm_cpu=2,
        vllm_memory_gib=8,
        shm_size_gib=1,
    )
