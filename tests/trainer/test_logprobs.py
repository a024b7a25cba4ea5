"""Chunked LM-head logprobs equal the full-logits path, values and gradients."""

from __future__ import annotations

import pytest
import torch

from async_grpo.trainer.logprobs import chunked_token_logps, completion_logps_from_model
from async_grpo.trainer.packing import pack_batch

from .test_trainer import mixed_batch


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_matches_full_logits_and_gradients(chunk):
    torch.manual_seed(0)
    n, t, h, v = 3, 7, 16, 50
    hidden = torch.randn(n, t, h, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=True)
    targets = torch.randint(0, v, (n, t))
    full = torch.log_softmax(head(hidden), -1).gather(-1, targets[..., None]).squeeze(-1)
    full_ent = -(torch.softmax(head(hidden), -1) * torch.log_softmax(head(hidden), -1)).sum(-1)
    g_full = torch.autograd.grad(full.sum(), [hidden, head.weight])
    chunked, ent = chunked_token_logps(hidden, head, targets, chunk, with_entropy=True)
    g_chunk = torch.autograd.grad(chunked.sum(), [hidden, head.weight])
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, full_ent.detach(), rtol=0, atol=1e-5)
    for a, b in zip(g_chunk, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_chunked_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        chunked_token_logps(torch.zeros(1, 2, 4), torch.nn.Linear(4, 5), torch.zeros(1, 2, dtype=torch.long), 0)


def test_model_path_chunked_equals_full(tiny_model):
    packed = pack_batch(mixed_batch(), pad_token_id=256)
    args = (packed.input_ids, packed.attention_mask, packed.position_ids, packed.completion_ids)
    full, _ = completion_logps_from_model(tiny_model, *args)
    chunked, _ = completion_logps_from_model(tiny_model, *args, chunk_size=2)
    mask = packed.completion_mask.bool()
    torch.testing.assert_close(chunked[mask], full[mask], rtol=0, atol=1e-5)
