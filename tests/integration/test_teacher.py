"""The teacher's client against a real vLLM CPU server (the session's tiny-model server plays the teacher): the prompt
logprobs it returns for a group of uneven completions are Hugging Face transformers' log-softmax of the same model at
temperature 1, token for token (the measurement `distillation.teacher` rests on: vLLM's prompt logprobs are the raw
model's whatever the request's temperature), and a sequence beyond the server's context is a `TeacherError`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from async_grpo.distillation.teacher import TeacherClient, TeacherError

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4  # float32 on both sides; the kernels differ (vLLM's CPU attention against transformers' eager)


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[t] | prompt, completion[:t]) from transformers, float32, temperature 1."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (P + T, V)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logps[positions, torch.tensor(completion)].tolist()


def test_teacher_logprobs_equal_transformers_log_softmax(vllm_server, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    groups = [
        ("reverse: hello\n", ["olleh", "", "o", "olleh olleh olleh, and a longer tail of text"]),
        ("add 12 and 30:", ["42", "4", "forty-two\n"]),
    ]
    groups = [
        (tokenizer.encode(p, add_special_tokens=False), [tokenizer.encode(c, add_special_tokens=False) for c in cs])
        for p, cs in groups
    ]

    async def scored() -> list[list[list[float]]]:
        client = TeacherClient(f"{vllm_server.url}/v1", timeout_s=60)
        try:
            return list(await asyncio.gather(*(client.score(p, cs) for p, cs in groups)))
        finally:
            await client.aclose()

    results = asyncio.run(scored())
    for (prompt, completions), teacher in zip(groups, results, strict=True):
        assert [len(row) for row in teacher] == [len(c) for c in completions]
        for completion, row in zip(completions, teacher, strict=True):
            if completion:
                assert row == pytest.approx(hf_logprobs(model, prompt, completion), abs=TOLERANCE)


def test_a_sequence_beyond_the_teachers_context_is_a_teacher_error(vllm_server):
    async def too_long() -> None:
        client = TeacherClient(f"{vllm_server.url}/v1", timeout_s=60)
        try:
            await client.score([65] * 300, [[66] * 300])  # 600 tokens, the server's max_model_len is 512
        finally:
            await client.aclose()

    with pytest.raises(TeacherError, match="HTTP 400"):
        asyncio.run(too_long())
