"""The runner's side of LoRA (`peft` config section): the LoRA learner, the adapter-only pusher and the model name
generation requests carry: everything the runner does differently for LoRA, in one place; docs/deploy.md, "LoRA".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from async_grpo.config import GRPOConfig
from async_grpo.trainer.protocol import Learner
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.weights.lora import LoRAAdapterPusher, adapter_name

LORA_SYNC_FOLDER = "lora_sync"  # <output_dir>/lora_sync/: the adapters pushed to vLLM (vllm_lora_sync)


def lora_policy(config: GRPOConfig, model: torch.nn.Module) -> tuple[type, Any]:
    """(learner class, policy) for `builders.build_local_learner`: `PeftLearner` over `model` wrapped with the
    lora_* fields. The adapter's random A is drawn from `seed`, so every trainer rank builds the same one.

    Raises:
        ValueError: lora_target_modules match no module (the message lists the model's linear layers).
    """
    from async_grpo.trainer.peft import PeftLearner, wrap_with_lora

    p = config.peft
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        wrapped = wrap_with_lora(
            model,
            r=p.lora_r,
            alpha=p.lora_alpha,
            dropout=p.lora_dropout,
            target_modules=p.lora_target_modules,
            disable_dropout=config.compute.disable_dropout,
        )
    return PeftLearner, wrapped


def lora_sync_folder(config: GRPOConfig) -> Path:
    """`<output_dir>/lora_sync`: on Kubernetes the run folder lies on the workspace PVC, which the vLLM pod mounts
    at the same path (`launch.k8s_objects.build_vllm_deployment`)."""
    return Path(config.output_dir).resolve() / LORA_SYNC_FOLDER


def adapter_pusher(config: GRPOConfig, learner: Learner, url: str) -> LoRAAdapterPusher:
    """The adapter-only pusher (vllm_lora_sync) from `learner` (`Learner.adapter_for_push`) to the server at `url`;
    its first push after each setup also sends the base weights once (full transfer, `LoRAAdapterPusher.base_pusher`),
    so the server's base is the trainer's.

    Raises:
        TypeError: the learner's policy has no LoRA adapter.
    """
    from async_grpo.transports.weights.sync import WeightPusher, rendezvous_address

    adapter = learner.adapter_for_push()
    sync = config.weight_sync
    base = WeightPusher(
        adapter.base,
        url,
        backend=sync.weight_sync_backend,
        timeout_s=sync.weight_sync_timeout_s,
        master_address=rendezvous_address(url),
    )
    return LoRAAdapterPusher(
        adapter.save_adapter,
        url,
        lora_sync_folder(config) / _slug(url),
        timeout_s=sync.weight_sync_timeout_s,
        base_pusher=base,
    )


def request_model(config: GRPOConfig, version: PolicyVersion, served_model: str) -> str | Callable[[], str]:
    """What generation requests name as `model`: the served model, or with vllm_lora_sync a callable giving the
    adapter of the current policy version (`adapter_name(version.value)`, read when each request is sent, like the
    rollout's version stamp)."""
    if not config.peft.vllm_lora_sync:
        return served_model
    return lambda: adapter_name(version.value)


def push_at_start(config: GRPOConfig) -> bool:
    """Whether setup must push version 0 although the server already holds the starting weights: with
    vllm_lora_sync requests name adapter `policy-v0`, which exists only once pushed."""
    return config.peft.vllm_lora_sync


def _slug(url: str) -> str:
    """A folder name for one server (replicas each get their own adapter folders)."""
    return "".join(c if c.isalnum() else "-" for c in url.split("://", 1)[-1]).strip("-")
