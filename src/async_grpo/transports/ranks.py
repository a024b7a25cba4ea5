"""Typed commands between trainer ranks (rank 0 -> followers), and the two collectives that carry them.

Rank 0 is the only rank that talks to the outside world (rollouts, vLLM, MLflow); it drives the other
ranks by broadcasting one command per operation that needs every rank (a training step, pi_old, a weight
gather, a state dict, a checkpoint load, the end). Each command is a small frozen dataclass, so a follower
dispatches on the type, never on a tuple position. Step batches travel once: the first command that names
a batch carries it, later ones name it by `key`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from async_grpo.transports.messages import TrainBatch


@dataclass(frozen=True)
class OldLogps:
    """Compute and keep pi_old for this rank's share of batch `key` (rollout reuse).

    Attributes:
        key: the batch's id, unique within the run.
        batch: the whole step batch the first time `key` is named, else None (the follower kept it).
    """

    key: int
    batch: TrainBatch | None


@dataclass(frozen=True)
class Step:
    """One optimizer step on this rank's share of batch `key`.

    Attributes:
        key: the batch's id.
        batch: the whole step batch the first time `key` is named, else None.
        use_old_logps: True when pi_old was cached by an earlier `OldLogps` for `key`.
    """

    key: int
    batch: TrainBatch | None
    use_old_logps: bool


@dataclass(frozen=True)
class Forget:
    """Drop the cached copy (and pi_old) of batch `key`: its rollout is done."""

    key: int


@dataclass(frozen=True)
class GatherWeights:
    """Rank 0 is iterating the policy's full weights for a weight push (`WeightSource` order): join each
    all-gather."""


@dataclass(frozen=True)
class FullModelState:
    """Rank 0 is gathering the policy's full state dict (saving the model): join the gather."""


@dataclass(frozen=True)
class StateDict:
    """Rank 0 is collecting the learner's state (a collective under FSDP): join it."""


@dataclass(frozen=True)
class LoadStateDict:
    """Load a learner state saved by rank 0 (checkpoint resume).

    Attributes:
        state: the learner state dict (`Learner.state_dict()` of rank 0) for replicas; None under FSDP, where
            every rank joins a load that broadcasts it from rank 0.
    """

    state: dict[str, Any] | None


@dataclass(frozen=True)
class Stop:
    """The run is over (or failed): followers return from their loop."""


Command = OldLogps | Step | Forget | GatherWeights | FullModelState | StateDict | LoadStateDict | Stop


def broadcast_command(command: Command | None) -> Command:
    """Rank 0 sends `command`; every other rank passes None and receives it.

    Raises:
        RuntimeError / DistBackendError: a rank died or the collective timed out (the process group's timeout).
        TypeError: a follower received something that is not a `Command`.
    """
    box = [command]
    dist.broadcast_object_list(box, src=0)
    received = box[0]
    if not isinstance(received, Command):
        raise TypeError(f"trainer rank {dist.get_rank()} received {type(received).__name__}, not a rank command")
    return received


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (`all_gather_object`)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
