"""A weight source that can hold a copy of the weights still while the trainer moves on (`weight_sync_overlap`).

A push that runs beside the trainer's next optimizer step must send the weights of the step that started it, not a
mix of that step's and the next one's. `FrozenSource.freeze()` copies every tensor of the inner source once, on the
trainer's thread, between steps; until `thaw()` every pass over the source yields those copies, so the push's
packing, wire and vLLM load can run on another thread while the optimizer updates the live parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer import WeightSource
from vllm.distributed.weight_transfer.base import ParamMeta


class FrozenSource(WeightSource):
    """vLLM `WeightSource` that passes the inner source through, or, once frozen, yields a copy taken at `freeze()`.

    Memory: a frozen source holds one copy of every pushed tensor, in the inner source's dtype (the pushed dtype
    when the inner source casts, e.g. `transports.weights.cast.CastSource` for a bfloat16 server), on the device
    the inner source yields it on.

    Args:
        inner: the source to copy (the learner's, possibly cast: `runner.builders.push_source`). Its iteration must
            not be a collective (one trainer rank): `freeze()` runs on one thread of one process.
    """

    def __init__(self, inner: WeightSource):
        self.inner = inner
        self._frozen: list[tuple[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    @property
    def frozen(self) -> bool:
        """True between `freeze()` and `thaw()`."""
        with self._lock:
            return self._frozen is not None

    def freeze(self) -> int:
        """Copy every tensor of one pass over the inner source; later passes yield the copies. Returns the bytes
        held.

        Raises:
            RuntimeError: already frozen (a push is still in flight: `thaw` first).
        """
        with self._lock:
            if self._frozen is not None:
                raise RuntimeError("FrozenSource.freeze(): already frozen; thaw() after the push that reads it")
        with torch.no_grad():
            copies = [(name, tensor.detach().clone()) for name, tensor in self.inner]
        with self._lock:
            self._frozen = copies
        return sum(t.numel() * t.element_size() for _, t in copies)

    def thaw(self) -> None:
        """Drop the copies; passes read the inner source again (no-op when not frozen)."""
        with self._lock:
            self._frozen = None

    def metadata(self) -> list[ParamMeta]:
        """The inner source's metadata (a copy has the same names, dtypes and shapes, in the same order)."""
        return self.inner.metadata()

    def held_names(self):
        """As the inner source."""
        return self.inner.held_names()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with self._lock:
            frozen = self._frozen
        if frozen is None:
            yield from self.inner
        else:
            yield from frozen
