"""A weight push through vLLM's control plane (gloo data plane) changes what the real server samples."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_grpo.inference.client import AsyncVLLMClient, VLLMControlClient
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.tiny_model import build_tiny_model
from async_grpo.transports.weights.sync import WeightPusher

pytestmark = pytest.mark.integration

PROMPT = [114, 101, 118, 101, 114, 115, 101, 58, 32, 97, 98, 99, 10]  # "reverse: abc\n" in the tiny byte vocab


def _sample(url: str, model: str, seed: int):
    async def go():
        client = AsyncVLLMClient(url, model)
        try:
            return await client.generate(PROMPT, n=4, max_tokens=8, temperature=1.0, seed=seed)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _trainer_logps(model, completion) -> torch.Tensor:
    ids = torch.tensor([PROMPT + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


def _max_gap(model, completions) -> float:
    return max(float((_trainer_logps(model, c) - torch.tensor(c.logprobs)).abs().max()) for c in completions)


@pytest.mark.parametrize("bucket_bytes", [None, 64 * 1024], ids=["one-bucket", "pipelined-64KiB-buckets"])
def test_weight_push_makes_vllm_logprobs_match_trainer(vllm_server, tiny_model_dir, bucket_bytes):
    """A push (one flat bucket, or about 30 buckets packed, sent and loaded overlapped) makes vLLM sample with the
    trainer's weights."""
    url, served = vllm_server.url, str(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    pusher = WeightPusher(model, url, backend="gloo", timeout_s=120, bucket_bytes=bucket_bytes)
    try:
        pusher.push(6)  # the shared server may hold another test's weights: start from the checkpoint's
        before = _sample(url, served, seed=1)
        assert _max_gap(model, before) < 1e-3  # same weights on both sides

        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        stale = _sample(url, served, seed=1)
        assert _max_gap(model, stale) > 0.1  # server still has the old weights: logprobs disagree

        seconds = pusher.push(7)
    finally:
        pusher.close()
    assert seconds > 0
    after = _sample(url, served, seed=1)
    assert _max_gap(model, after) < 1e-3  # server now samples from the trainer's weights
    control = VLLMControlClient(url)
    assert control.weight_version() == "7"
    assert not control._call("GET", "/is_paused")["is_paused"]  # resumed after the push


def test_a_tied_model_samples_with_the_pushed_head(tmp_path):
    """Qwen2.5-0.5B/1.5B tie their embeddings. vLLM's layerwise reload processes a tied parameter for one layer
    only; on CPU the LM head's packed GEMM copy kept the old embedding (15.5 nats off after a push) until the gloo
    engine re-tied it (`retie_lm_head`)."""
    path = build_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VLLMServer(
        build_server_command(path, port=port, weight_transfer_backend="gloo"),
        server_env(1),
        tmp_path / "vllm.log",
        url,
        400.0,
    )
    server.start()
    try:
        pusher = WeightPusher(model, url, backend="gloo", timeout_s=120)
        try:
            torch.manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():  # the embedding moves, and with it the tied head
                    p.add_(torch.randn_like(p) * 0.3)
            assert _max_gap(model, _sample(url, str(path), seed=1)) > 0.1
            pusher.push(1)
        finally:
            pusher.close()
        assert _max_gap(model, _sample(url, str(path), seed=1)) < 1e-3
    finally:
        server.stop()
