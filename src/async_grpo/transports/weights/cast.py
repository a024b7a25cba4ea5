"""Cast the pushed weights to vLLM's dtype once, on the trainer, before they travel.

The trainer keeps float32 master weights; a vLLM server running in bfloat16 (`vllm_dtype`) would otherwise receive
float32 tensors and round them itself. Casting on the sender halves the bytes on the wire (`weight_sync/bytes`) and
rounds exactly once, with the same round-to-nearest-even that vLLM's own copy would apply, so the served weights are
identical either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer import WeightSource
from vllm.distributed.weight_transfer.base import ParamMeta

CASTABLE = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
"""`vllm_dtype` values that mean a 16-bit server (anything else, e.g. float32 or auto, is sent as the trainer holds
it)."""


class CastSource(WeightSource):
    """A `WeightSource` whose floating-point tensors are cast to `dtype` (others pass through unchanged).

    Args:
        inner: the learner's source (`Learner.named_parameters_for_push()`).
        dtype: the wire and serving dtype, e.g. torch.bfloat16.
    """

    def __init__(self, inner: WeightSource, dtype: torch.dtype):
        self.inner, self.dtype = inner, dtype

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if dtype.is_floating_point else dtype

    def metadata(self) -> list[ParamMeta]:
        """The inner metadata with floating dtypes replaced by `dtype` (same names, shapes and order)."""
        return [ParamMeta(m.name, self._cast(m.dtype), m.shape) for m in self.inner.metadata()]

    def held_names(self):
        """As the inner source."""
        return self.inner.held_names()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner:
            yield name, (tensor if tensor is None else tensor.to(self._cast(tensor.dtype)))


def uncast(source: WeightSource) -> tuple[WeightSource, torch.dtype | None]:
    """`(inner, dtype)` for a `CastSource` (its tensors before the cast, and the dtype they are cast to), else
    `(source, None)`: a sender that casts while it copies into its own buffer skips the cast copy."""
    if isinstance(source, CastSource):
        return source.inner, source.dtype
    return source, None


def for_server(source: WeightSource, vllm_dtype: str) -> WeightSource:
    """`source` cast to a 16-bit `vllm_dtype` (see CASTABLE), else `source` itself."""
    dtype = CASTABLE.get(vllm_dtype.lower())
    return source if dtype is None else CastSource(source, dtype)
