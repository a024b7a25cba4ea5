"""A weight push through vLLM's control plane (gloo data plane) changes what the real server samples."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import ModuleSource

from async_grpo.inference.client import AsyncVLLMClient, VLLMControlClient
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.tiny_model import build_tiny_model
from async_grpo.transports.weights.cast import for_server
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


def _perturb_some(model, fraction: float, seed: int) -> None:
    """Move `fraction` of the elements of every other parameter by about 1e-3 (a few bfloat16 ulps); the rest keep
    their bits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2:
                continue
            flat = p.view(-1)
            index = torch.randperm(flat.numel(), generator=gen)[: max(1, int(fraction * flat.numel()))]
            flat[index] += torch.randn(index.numel(), generator=gen) * 1e-3


@pytest.mark.parametrize("pushed_dtype, fraction", [("float32", 0.02), ("bfloat16", 0.3)])
def test_a_delta_push_serves_exactly_what_a_full_push_serves(vllm_server, tiny_model_dir, pushed_dtype, fraction):
    """weight_sync_mode: delta sends a fraction of the bytes, and the server then samples exactly (token ids and
    logprobs, bit for bit) what it samples after a full push of the same weights; twice in a row, so the second
    patch is applied to a snapshot that itself came from a patch. The float32 changes (2%) travel as indices and
    values, the bfloat16 ones (30%, a few ulps each) as a mask and one-byte ulp steps (`mask_steps`)."""
    url, served = vllm_server.url, str(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    source = for_server(ModuleSource(model), pushed_dtype)
    pusher = WeightPusher(source, url, backend="gloo", timeout_s=120, bucket_bytes=64 * 1024, mode="delta")
    try:
        pusher.push(11)  # the first push of a delta chain is full
        assert pusher.last_report.wire_bytes >= pusher.last_report.dense_bytes > 0
        samples = []
        for seed in (0, 1):
            _perturb_some(model, fraction, seed)
            pusher.push(12 + 2 * seed)
            assert pusher.last_report.wire_bytes < 0.2 * pusher.last_report.dense_bytes
            after_delta = _sample(url, served, seed=1)
            pusher.push(13 + 2 * seed, full=True)  # the same weights, every tensor whole
            assert pusher.last_report.wire_bytes >= pusher.last_report.dense_bytes
            after_full = _sample(url, served, seed=1)
            assert [(c.token_ids, c.logprobs) for c in after_delta] == [(c.token_ids, c.logprobs) for c in after_full]
            if pushed_dtype == "float32":
                assert _max_gap(model, after_delta) < 1e-3
            samples.append(after_delta)
        assert [c.logprobs for c in samples[0]] != [c.logprobs for c in samples[1]]  # the second patch did land
    finally:
        pusher.close()


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


def test_a_checkpoint_pushed_from_its_files_is_what_vllm_samples_with(vllm_server, tiny_model_dir, tmp_path):
    """The pipeline's evaluate step serves the champion in the challenger's server (`push_checkpoint`): the server
    then samples with the champion's weights, read from its safetensors files, not the ones it started with."""
    from async_grpo.transports.weights.checkpoint import layout_difference, push_checkpoint

    champion = build_tiny_model(tmp_path / "champion", seed=3)
    assert layout_difference(tiny_model_dir, champion) is None
    url, served = vllm_server.url, str(tiny_model_dir)
    push_checkpoint(champion, url, vllm_dtype="float32", backend="gloo", timeout_s=120)
    completions = _sample(url, served, seed=1)
    pushed = AutoModelForCausalLM.from_pretrained(champion, dtype=torch.float32)
    started = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert _max_gap(pushed, completions) < 1e-3
    assert _max_gap(started, completions) > 0.1  # the push changed what the server computes
    push_checkpoint(tiny_model_dir, url, vllm_dtype="float32", backend="gloo", timeout_s=120)  # as it was
    assert _max_gap(started, _sample(url, served, seed=1)) < 1e-3
