"""Weights pushed to a 16-bit vLLM server are cast once on the trainer: half the bytes, the same rounding."""

from __future__ import annotations

import math

import torch
from vllm.distributed.weight_transfer import ModuleSource

from async_grpo.transports.weights.cast import CastSource, for_server


def test_bf16_server_gets_bf16_tensors_and_half_the_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    source = for_server(ModuleSource(model), "bfloat16")
    assert isinstance(source, CastSource)
    metas = source.metadata()
    assert [m.name for m in metas] == [n for n, _ in model.named_parameters()]
    assert {m.dtype for m in metas} == {torch.bfloat16}
    sent = dict(source)
    for name, param in model.named_parameters():
        assert sent[name].dtype == torch.bfloat16 and sent[name].shape == param.shape
        assert torch.equal(sent[name], param.detach().to(torch.bfloat16))  # vLLM's own copy_ rounds the same way
    full = sum(math.prod(m.shape) * m.dtype.itemsize for m in ModuleSource(model).metadata())
    assert sum(math.prod(m.shape) * m.dtype.itemsize for m in metas) * 2 == full
    assert [n for n, _ in source] == [m.name for m in metas]  # re-iterable: a fresh pass each push


def test_float32_and_auto_servers_get_the_weights_as_they_are():
    model = torch.nn.Linear(2, 2)
    inner = ModuleSource(model)
    assert for_server(inner, "float32") is inner and for_server(inner, "auto") is inner
