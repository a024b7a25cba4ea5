"""Data-parallel training over several trainer ranks (torchrun, or a PyTorchJob's Master + Workers).

Rank 0 is the only rank that talks to the outside world: it runs the rollout producer (vLLM
orchestrator, reward pool), evaluation, MLflow, and the weight push to vLLM. Every rank holds a
replica of the policy. For each optimizer step rank 0 broadcasts the step batch; each rank trains on
its contiguous share of the groups, and `GRPOLearner` averages the gradients across ranks in one flat
all-reduce, with TRL's normalizers (global token count / num_processes for dapo and cispo), so the
update equals a single process training on the whole batch with the same micro-batches
(`tests/trainer/test_distributed.py` checks this with two gloo ranks).

By default each rank holds a replica of the policy, which suits models whose float32 weights,
gradients and AdamW state (16 bytes per parameter) fit one device. With `fsdp: true` the ranks shard
them with FSDP2 (`shard_model`): ranks then run equally many forward/backward passes (a rank with fewer
micro-batches runs zero-weight placeholders), FSDP averages the gradients, and the followers join the
all-gathers when rank 0 pushes weights to vLLM or saves the model.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_grpo.transports.messages import TrainBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits among the trainer ranks.

    Attributes:
        rank: global rank (0 is the main rank).
        world_size: number of ranks.
        local_rank: rank on this node (selects the GPU).
        device: the device this rank trains on.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0


def init_distributed(timeout_s: float) -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on GPU, gloo on CPU); pick the device.

    Args:
        timeout_s: collective timeout (seconds); it bounds how long a rank waits for rank 0, which may be
            evaluating or waiting for rollouts, so it must exceed those waits.

    Raises:
        ValueError: WORLD_SIZE > 1 without RANK / MASTER_ADDR (not started by torchrun or the operator).
    """
    world = check_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return DistInfo(device=device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def check_env() -> int:
    """WORLD_SIZE from the environment (1 when unset), checked to come with what torchrun sets.

    Raises:
        ValueError: WORLD_SIZE > 1 without RANK / MASTER_ADDR / MASTER_PORT.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world > 1 and missing:
        raise ValueError(f"WORLD_SIZE={world} but {missing} are not set. Fix: start the trainer with torchrun "
                         "(a PyTorchJob does this), or unset WORLD_SIZE.")
    return world


def close_distributed() -> None:
    """Leave the process group (no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_parameters(model: torch.nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (after rank 0's warm start)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.data, src=src)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` across the ranks with FSDP2 (`fully_shard`): one unit per decoder layer, then the root
    (embeddings, final norm, LM head). Parameter names are unchanged, and each parameter becomes a DTensor
    holding 1/world_size of it; forward all-gathers a unit's weights and frees them after use, backward
    reduce-scatters (averages) its gradients. In place; returns `model`.

    Raises:
        ValueError: the model has no `get_decoder().layers` (not a transformers decoder-only LM).
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if layers is None:
        raise ValueError(f"fsdp: {type(model).__name__} has no get_decoder().layers to shard. Fix: use a "
                         "transformers decoder-only causal LM, or set fsdp=false.")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def save_pretrained(model: torch.nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """`model.save_pretrained(path, state_dict=state)`, keeping the architecture name of a sharded model:
    `fully_shard` swaps the class for `FSDP<Name>`, which transformers would otherwise write into
    config.json, and `AutoModelForCausalLM` could then not load the checkpoint."""
    import json
    from pathlib import Path

    model.save_pretrained(path, state_dict=state)
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("architectures"):
        config["architectures"] = [a.removeprefix("FSDP") for a in config["architectures"]]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def shard(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """Rank `rank`'s contiguous share of `batch`'s groups (the first len % world_size ranks get one more).

    With whole steps of groups_per_step = world_size x per-rank groups, every rank gets the same number of
    groups; after stale drops the shares may differ by one group, or be empty (the rank then contributes
    zero gradients).
    """
    n = len(batch.groups)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return TrainBatch(groups=batch.groups[start:end], metrics=batch.metrics, final=batch.final)


_STOP = ("stop",)


class DataParallelLearner:
    """Rank 0's view of a learner replicated on every rank: the same `old_logps` / `step` calls as
    `GRPOLearner`, each broadcast to the followers (`follow`) and run on this rank's shard.

    Args:
        learner: this rank's `GRPOLearner`.
        info: this rank's `DistInfo` (must be rank 0).
    """

    def __init__(self, learner, info: DistInfo):
        if not info.is_main:
            raise ValueError("DataParallelLearner runs on rank 0; the other ranks call follow().")
        self.learner = learner
        self.info = info
        self._keys = itertools.count()
        self._key_of: dict[int, int] = {}

    def __getattr__(self, name):  # model, optimizer, counters... of the local learner
        return getattr(self.learner, name)

    def _key(self, batch: TrainBatch) -> tuple[int, bool]:
        key = self._key_of.get(id(batch))
        if key is not None:
            return key, False
        key = self._key_of[id(batch)] = next(self._keys)
        return key, True

    def old_logps(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Every rank computes and keeps pi_old for its shard; returns this rank's (see `GRPOLearner.old_logps`)."""
        key, new = self._key(batch)
        _broadcast(("old_logps", key, batch if new else None))
        return self.learner.old_logps(shard(batch, 0, self.info.world_size))

    def step(self, batch: TrainBatch, *, old_logps: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One data-parallel optimizer step (see `GRPOLearner.step`); metrics merged over the ranks
        (`merge_rank_metrics`), so `loss` is the whole batch's loss.

        Raises:
            ValueError: `batch` is a stream of chunks (streaming needs a single rank).
        """
        if not isinstance(batch, TrainBatch):
            raise ValueError("streaming_min_groups with several trainer ranks is not supported. Fix: unset it.")
        key, new = self._key(batch)
        _broadcast(("step", key, batch if new else None, old_logps is not None))
        metrics = self.learner.step(shard(batch, 0, self.info.world_size), old_logps=old_logps)
        return merge_rank_metrics(_gather(metrics))

    def push_weights(self, pusher, version: int) -> float:
        """`pusher.push(version)` (seconds); under FSDP the followers join each parameter's all-gather."""
        if self.learner.sharded:
            _broadcast(("gather",))
        return pusher.push(version)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy state dict on CPU (every rank joins the gather under FSDP)."""
        if self.learner.sharded:
            _broadcast(("state_dict",))
        return self.learner.full_state_dict()

    def forget(self, batch: TrainBatch) -> None:
        """Drop every rank's cached copy of `batch` (call when a rollout is done)."""
        key = self._key_of.pop(id(batch), None)
        if key is not None:
            _broadcast(("forget", key))

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        _broadcast(_STOP)


def follow(learner, info: DistInfo) -> int:
    """Run on ranks > 0: execute rank 0's broadcast commands on this rank's shards until stopped.

    Returns:
        The number of optimizer steps taken.

    Raises:
        RuntimeError / DistBackendError: rank 0 died or the collective timed out (torchrun then ends the job).
    """
    batches: dict[int, TrainBatch] = {}
    olds: dict[int, list[torch.Tensor]] = {}
    steps = 0
    while True:
        cmd = _broadcast(None)
        if cmd[0] == "stop":
            return steps
        if cmd[0] == "forget":
            batches.pop(cmd[1], None)
            olds.pop(cmd[1], None)
            continue
        if cmd[0] == "gather":  # rank 0 is sending the weights to vLLM: all-gather in the same order
            from vllm.distributed.weight_transfer import ModuleSource

            for _ in ModuleSource(learner.model):
                pass
            continue
        if cmd[0] == "state_dict":
            learner.full_state_dict()
            continue
        key, batch = cmd[1], cmd[2]
        if batch is not None:
            batches[key] = shard(batch, info.rank, info.world_size)
        if cmd[0] == "old_logps":
            olds[key] = learner.old_logps(batches[key])
        elif cmd[0] == "step":
            _gather(learner.step(batches[key], old_logps=olds.get(key) if cmd[3] else None))
            steps += 1


_SAME_ON_EVERY_RANK = ("grad_norm", "learning_rate", "num_tokens")  # computed after the collectives


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: `*/min` and `*/max` keep the extreme, `skipped_zero_adv_microbatches`
    adds up, grad_norm / learning_rate / num_tokens (identical on every rank) are taken as they are, and the
    rest is averaged over the ranks that report it. The mean of the ranks' losses is the loss of the whole
    batch, since each rank's loss is normalized as TRL does under DDP (global tokens / num_processes for
    dapo/cispo, per-rank means otherwise)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith("/max"):
            out[key] = max(values)
        elif key == "skipped_zero_adv_microbatches":
            out[key] = float(sum(values))
        elif key in _SAME_ON_EVERY_RANK:
            out[key] = values[0]
        else:
            out[key] = sum(values) / len(values)
    return out


def _gather(obj) -> list:
    """Every rank's `obj`, in rank order (on every rank)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    """Rank 0 sends `obj`; every other rank receives and returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
