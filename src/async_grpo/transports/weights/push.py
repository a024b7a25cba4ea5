"""The weight push's contract: what the runner drives (`WeightPush`) and what each push reports (`PushReport`).

Three pushers meet it: `sync.WeightPusher` (every weight to one vLLM server over vLLM's weight transfer, full or
delta), `lora.LoRAAdapterPusher` (the adapter files to one server, the base weights once per setup) and
`replicas.ReplicaPusher` (one of those per replica, all at once). The runner's `OverlappedPush` runs the
`ReplicaPusher`'s push on a background thread. The runner reads what a push sent from `last_report`, never from a
pusher's own attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PushReport:
    """What one weight push did.

    Attributes:
        seconds: wall seconds of the push (pause, send, resume; for several replicas, all of them).
        wire_bytes: bytes sent to one server (bytes; 0 when the transport does not count them). With
            weight_sync_mode: delta, the changed elements and their indices; with vllm_lora_sync, the adapter files
            (plus the base weights on the first push after a setup).
        dense_bytes: what a full push of the same tensors takes (bytes; 0 when not known). `wire_bytes` is below it
            only with weight_sync_mode: delta.
        replica_seconds: per replica index, the seconds of its part of the push; only with several replicas.
    """

    seconds: float = 0.0
    wire_bytes: int = 0
    dense_bytes: int = 0
    replica_seconds: Mapping[int, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The push's MLflow metrics: `weight_sync/bytes` (`wire_bytes`) and `weight_sync/dense_bytes` when known,
        and `weight_sync/replica_<i>/seconds` per replica. `weight_sync/seconds` is the runner's (it times an
        overlapped push from the step that started it)."""
        out = {}
        if self.wire_bytes:
            out["weight_sync/bytes"] = float(self.wire_bytes)
        if self.dense_bytes:
            out["weight_sync/dense_bytes"] = float(self.dense_bytes)
        out.update({f"weight_sync/replica_{i}/seconds": float(s) for i, s in self.replica_seconds.items()})
        return out


class WeightPush(Protocol):
    """Sends the trainer's weights to vLLM, one policy version per `push`.

    Attributes:
        last_report: what the latest successful push did (`PushReport()` before the first).
    """

    last_report: PushReport

    def setup(self) -> None:
        """Join the server's weight transfer (a rendezvous), once before the first push and again after the
        server restarted.

        Raises:
            requests.RequestException / RuntimeError: the server refused or did not answer in the pusher's timeout.
        """

    def push(self, version: int) -> float:
        """Send the current weights tagged `version` (the policy version the server then reports); returns its
        wall seconds. The server generates again when it returns, whether or not the push succeeded.

        Raises:
            whatever the transport raised; the server's weights are then not known to be `version`.
        """

    def close(self) -> None:
        """Leave the weight transfer (idempotent)."""
