"""Data-parallel training over several trainer ranks (torchrun, or a PyTorchJob's Master + Workers).

Rank 0 is the only rank that talks to the outside world: it runs the rollout producer (vLLM
orchestrator, reward pool), evaluation, MLflow, and the weight push to vLLM. Every rank holds a
replica of the policy. For each optimizer step rank 0 broadcasts the step batch; each rank trains on
its contiguous share of the groups, and `GRPOLearner` averages the gradients across ranks in one flat
all-reduce, with TRL's normalizers (global token count / num_processes for dapo and cispo), so the
update equals a single process training on the whole batch with the same micro-batches
(`tests/trainer/test_streaming_reuse_distributed.py` checks this with two gloo ranks). Rank 0 drives the other
ranks with the typed commands of `transports.ranks`.

By default each rank holds a replica of the policy, which suits models whose float32 weights,
gradients and AdamW state (16 bytes per parameter) fit one device. With `fsdp: true` the ranks shard
them with FSDP2 (`shard_model`): ranks then run equally many forward/backward passes (a rank with fewer
micro-batches runs zero-weight placeholders), FSDP averages the gradients, and the followers join the
all-gathers when rank 0 pushes weights to vLLM or saves the model.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import ParamMeta, WeightSource

from async_grpo.trainer.protocol import AdapterPush
from async_grpo.transports import ranks
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
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def check_env() -> int:
    """WORLD_SIZE from the environment (1 when unset), checked to come with what torchrun sets.

    Raises:
        ValueError: WORLD_SIZE > 1 without RANK / MASTER_ADDR / MASTER_PORT.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world > 1 and missing:
        raise ValueError(
            f"WORLD_SIZE={world} but {missing} are not set. Fix: start the trainer with torchrun "
            "(a PyTorchJob does this), or unset WORLD_SIZE."
        )
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


def shard_model(model: torch.nn.Module, mixed_precision: str | None = None) -> torch.nn.Module:
    """Shard `model` across the ranks with FSDP2 (`fully_shard`): one unit per decoder layer, then the root
    (embeddings, final norm, LM head). Parameter names are unchanged, and each parameter becomes a DTensor
    holding 1/world_size of it; forward all-gathers a unit's weights and frees them after use, backward
    reduce-scatters (averages) its gradients. In place; returns `model`.

    `mixed_precision="bf16"` (TRL `bf16`) gives every unit FSDP2's `MixedPrecisionPolicy`: the all-gathered
    parameters, hence the forward and backward, are bfloat16, and gradients are reduce-scattered in bfloat16 on
    GPU (NCCL) and float32 on CPU (gloo has no bfloat16 reduction); the sharded master weights, their gradients
    and AdamW's state stay float32 (PyTorch FSDP2 docs, "MixedPrecisionPolicy").

    Raises:
        ValueError: the model has no `get_decoder().layers` (not a transformers decoder-only LM).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        reduce = torch.bfloat16 if dist.is_initialized() and dist.get_backend() == "nccl" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)

    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if layers is None:
        raise ValueError(
            f"fsdp: {type(model).__name__} has no get_decoder().layers to shard. Fix: use a "
            "transformers decoder-only causal LM, or set fsdp=false."
        )
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
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


def shard(batch: TrainBatch, rank: int, world_size: int, micro_batch_size: int) -> TrainBatch:
    """Rank `rank`'s share of `batch`: a contiguous run of the micro-batches one process would cut from the whole
    batch (`micro_batch_size` completions each, in order), the first n % world_size ranks taking one more.

    So the ranks together train on exactly one process's micro-batches, and the update equals one process's for
    every loss type (per-micro-batch means included). With whole steps every rank gets the same number; after stale
    drops the shares may differ by one micro-batch, or be empty (the rank then contributes zero gradients). A group
    is split between two ranks only when a micro-batch boundary falls inside it (micro_batch_size not a multiple of
    the group size).

    Raises:
        ValueError: micro_batch_size < 1.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    rows = sum(g.size for g in batch.groups)
    n_micro = -(-rows // micro_batch_size)
    base, extra = divmod(n_micro, world_size)
    first = rank * base + min(rank, extra)
    start, end = first * micro_batch_size, min((first + base + (1 if rank < extra else 0)) * micro_batch_size, rows)
    groups, offset = [], 0
    for grp in batch.groups:
        lo, hi = max(start - offset, 0), min(end - offset, grp.size)
        if lo < hi:
            groups.append(grp if (lo, hi) == (0, grp.size) else _rows(grp, lo, hi))
        offset += grp.size
    return TrainBatch(groups=groups, metrics=batch.metrics, final=batch.final)


def _rows(group, lo: int, hi: int):
    """Completions [lo, hi) of a `RolloutGroup` (their advantages were computed over the whole group already): every
    per-completion field, list or dict of lists (`rollout_stats`, `reward_extra`), sliced; the optional ones (the
    teacher's, `spans`) when set."""
    per_completion = [
        "completion_ids",
        "sampling_logprobs",
        "truncated",
        "completions",
        "rewards_per_func",
        "rewards",
        "advantages",
        "loss_mask",
        "token_versions",
    ]
    per_completion += [
        f
        for f in ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs", "spans", "episode_index")
        if getattr(group, f)
    ]
    sliced = {f: getattr(group, f)[lo:hi] for f in per_completion}
    if sliced.get("episode_index"):  # renumbered from 0: a rank's share may start inside an episode
        sliced["episode_index"] = [e - sliced["episode_index"][0] for e in sliced["episode_index"]]
    for f in ("rollout_stats", "reward_extra"):  # name -> (G,) values
        sliced[f] = {name: values[lo:hi] for name, values in getattr(group, f).items()}
    return dataclasses.replace(group, **sliced)


class DataParallelLearner:
    """Rank 0's `Learner` over a learner on every rank: each call that needs every rank is broadcast as a typed
    command (`transports.ranks`) to the followers (`follow`), and run here on rank 0's share.

    Args:
        learner: this rank's `GRPOLearner`.
        info: this rank's `DistInfo` (must be rank 0).

    Raises:
        ValueError: built on a rank other than 0.
    """

    def __init__(self, learner, info: DistInfo):
        if not info.is_main:
            raise ValueError("DataParallelLearner runs on rank 0; the other ranks call follow().")
        self.learner = learner
        self.info = info
        self.model = learner.model
        self._keys = itertools.count()
        self._key_of: dict[int, int] = {}

    def _key(self, batch: TrainBatch) -> tuple[int, bool]:
        key = self._key_of.get(id(batch))
        if key is not None:
            return key, False
        key = self._key_of[id(batch)] = next(self._keys)
        return key, True

    def _share(self, batch: TrainBatch) -> TrainBatch:
        return shard(batch, 0, self.info.world_size, self.learner.micro_batch_size)

    def old_logps(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Every rank computes and keeps pi_old for its shard; returns this rank's (see `GRPOLearner.old_logps`)."""
        key, new = self._key(batch)
        ranks.broadcast_command(ranks.OldLogps(key, batch if new else None))
        return self.learner.old_logps(self._share(batch))

    def step(self, batch: TrainBatch, *, old_logps: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One data-parallel optimizer step (see `GRPOLearner.step`); metrics merged over the ranks
        (`merge_rank_metrics`), so `loss` is the whole batch's loss.

        Raises:
            ValueError: `batch` is a stream of chunks (streaming needs a single rank).
        """
        if not isinstance(batch, TrainBatch):
            raise ValueError("streaming_min_groups with several trainer ranks is not supported. Fix: unset it.")
        key, new = self._key(batch)
        ranks.broadcast_command(ranks.Step(key, batch if new else None, old_logps is not None))
        metrics = self.learner.step(self._share(batch), old_logps=old_logps)
        return merge_rank_metrics(ranks.gather_objects(metrics))

    def state_dict(self) -> dict:
        """The learner state (rank 0's; under FSDP every rank joins the full gather)."""
        if self.learner.sharded:
            ranks.broadcast_command(ranks.StateDict())
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load `state` on every rank (replicas receive it in the command; FSDP broadcasts it from rank 0)."""
        # under FSDP the tensors are broadcast by the load itself; the schedule's position travels in the command
        light = {
            "model": {},
            "optimizer": {},
            "lr_scheduler": state.get("lr_scheduler"),
            "skipped_zero_adv_microbatches": state["skipped_zero_adv_microbatches"],
            "skipped_zero_adv_completions": state.get("skipped_zero_adv_completions", 0),
            "skipped_nonfinite_steps": state.get("skipped_nonfinite_steps", 0),
        }
        ranks.broadcast_command(ranks.LoadStateDict(light if self.learner.sharded else state))
        self.learner.load_state_dict(state)

    def named_parameters_for_push(self) -> WeightSource:
        """The policy's full weights; iterating them first tells the followers to join the FSDP all-gathers."""
        return _FollowedSource(self.learner.named_parameters_for_push(), self.learner.sharded)

    def adapter_for_push(self) -> AdapterPush:
        """Rank 0's learner's (LoRA runs without FSDP, so rank 0 holds the whole adapter and base; no collective).

        Raises:
            TypeError: the policy has no LoRA adapter.
        """
        return self.learner.adapter_for_push()

    def save_pretrained(self, path) -> None:
        """Write the full policy as a Hugging Face folder (every rank joins the gather under FSDP)."""
        if self.learner.sharded:
            ranks.broadcast_command(ranks.FullModelState())
        self.learner.save_pretrained(path)

    def forget(self, batch: TrainBatch) -> None:
        """Drop every rank's cached copy of `batch` (call when a rollout is done)."""
        key = self._key_of.pop(id(batch), None)
        if key is not None:
            ranks.broadcast_command(ranks.Forget(key))

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        ranks.broadcast_command(ranks.Stop())


class _FollowedSource(WeightSource):
    """A rank-0 `WeightSource` whose every pass first sends `GatherWeights` when the weights are sharded, so the
    followers iterate their own source in the same order (each parameter's all-gather is a collective)."""

    def __init__(self, inner: WeightSource, sharded: bool):
        self._inner, self._sharded = inner, sharded

    def metadata(self) -> list[ParamMeta]:
        return self._inner.metadata()

    def __iter__(self):
        if self._sharded:
            ranks.broadcast_command(ranks.GatherWeights())
        return iter(self._inner)


def follow(learner, info: DistInfo) -> int:
    """Run on ranks > 0: execute rank 0's commands (`transports.ranks`) on this rank's shards until `Stop`.

    Returns:
        The number of optimizer steps taken.

    Raises:
        RuntimeError / DistBackendError: rank 0 died or the collective timed out (torchrun then ends the job).
    """
    batches: dict[int, TrainBatch] = {}
    olds: dict[int, list[torch.Tensor]] = {}
    steps = 0
    while True:
        cmd = ranks.broadcast_command(None)
        match cmd:
            case ranks.Stop():
                return steps
            case ranks.Forget(key=key):
                batches.pop(key, None)
                olds.pop(key, None)
            case ranks.GatherWeights():  # rank 0 is sending the weights to vLLM: all-gather in the same order
                for _ in learner.named_parameters_for_push():
                    pass
            case ranks.FullModelState():
                learner.full_state_dict()
            case ranks.StateDict():
                learner.state_dict()
            case ranks.LoadStateDict(state=state):
                learner.load_state_dict(state)
            case ranks.OldLogps(key=key, batch=batch):
                if batch is not None:
                    batches[key] = shard(batch, info.rank, info.world_size, learner.micro_batch_size)
                olds[key] = learner.old_logps(batches[key])
            case ranks.Step(key=key, batch=batch, use_old_logps=use_old):
                if batch is not None:
                    batches[key] = shard(batch, info.rank, info.world_size, learner.micro_batch_size)
                ranks.gather_objects(learner.step(batches[key], old_logps=olds.get(key) if use_old else None))
                steps += 1


# computed after the collectives
_SAME_ON_EVERY_RANK = ("grad_norm", "learning_rate", "num_tokens", "skipped_nonfinite_steps")


def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: `*/min` and `*/max` keep the extreme, `skipped_zero_adv_microbatches` and
    `skipped_zero_adv_completions` add up, grad_norm / learning_rate / num_tokens / skipped_nonfinite_steps (identical on every rank) are taken
    as they are, and the rest is averaged over the ranks that report it. The mean of the ranks' losses is the loss of the whole
    batch, since each rank's loss is normalized as TRL does under DDP (global tokens / num_processes for
    dapo/cispo, per-rank means otherwise)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith("/max"):
            out[key] = max(values)
        elif key in (
            "skipped_zero_adv_microbatches",
            "skipped_zero_adv_completions",
            "oversized_microbatch_sequences",
            "shared_prompt_microbatches",
        ):  # counts add up
            out[key] = float(sum(values))
        elif key in _SAME_ON_EVERY_RANK:
            out[key] = values[0]
        else:
            out[key] = sum(values) / len(values)
    return out
