"""The distillation teacher against real vLLM CPU servers (issue 52): vLLM refuses a prompt that fills its context
when asked for prompt logprobs and one generated token, so the teacher the launcher serves (the policy's context
length: one more would exceed the tiny model's position limit) scores a sequence that fills it but for its last token;
its logprobs are transformers' log-softmax of the same model at temperature 1 (vLLM ignores the request's temperature
for prompt logprobs), and with top-k (prompt_logprobs=5) its 5 most likely tokens at every position are transformers'
top 5, in the same order; the preflight of a served teacher (its `/v1/models`, `max_model_len` and `/tokenize`) passes
against a real server of the student's tokenizer and refuses one too short or of another tokenizer. The teacher is a
server of its own: the session's server has had weights pushed into it by other tests."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.distillation.teacher import TeacherClient
from async_grpo.launch import local
from async_grpo.preflight.teacher import URL_FIELD, check_teacher_url
from async_grpo.tiny_model import build_tiny_tokenizer

pytestmark = pytest.mark.integration

TIMEOUT_S = 120.0


def _score(url: str, model: str, ids: list[int]) -> httpx.Response:
    """The teacher's request: the whole sequence as the prompt, its prompt logprobs, one generated token."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)


def test_a_sequence_filling_the_launched_teachers_context_is_scored_but_its_last_token(
    vllm_server, tiny_model_dir, tmp_path
):
    # the session's server (max_model_len 512) refuses a 512-token prompt with prompt logprobs and one generated token
    ids = [97 + i % 26 for i in range(512)]
    refused = _score(vllm_server.url, str(tiny_model_dir), ids)
    assert refused.status_code == 400 and "max_tokens must be at least 1" in refused.text
    # the launcher's teacher for a run of vllm_max_model_len 128 holds 128 tokens, as the policy's server
    config = GRPOConfig(
        model_name_or_path=str(tiny_model_dir),
        teacher_model_name_or_path=str(tiny_model_dir),
        vllm_max_model_len=128,
        max_completion_length=64,
        max_prompt_length=64,
        output_dir=str(tmp_path / "run"),
        vllm_startup_timeout_s=400,
    )
    served, server = local.start_teacher_server(config)
    try:
        assert served.distillation.teacher_url == f"{server.url}/v1"
        assert (tmp_path / "run" / "vllm-teacher.log").is_file()
        prompt, full, shorter = ids[:64], ids[64:128], ids[64:127]  # 128 tokens in all, and 127

        async def score() -> list[list[float]]:
            client = TeacherClient.from_config(served.distillation)
            try:
                return await client.score(prompt, [full, shorter])
            finally:
                await client.aclose()

        whole_seq, short_seq = asyncio.run(score())
        assert len(whole_seq) == 64 and math.isnan(whole_seq[-1])  # cut: no room for the generated token
        assert all(math.isfinite(x) for x in whole_seq[:-1] + short_seq) and len(short_seq) == 63
        assert whole_seq[:-1] == pytest.approx(short_seq, abs=1e-5)  # the same tokens, the same context
        # the logprobs are transformers' log-softmax of the same model at temperature 1, token for token, for a
        # group of uneven completions (one empty): what distillation.teacher rests on
        check_against_transformers(served, tiny_model_dir)
        # with top-k, the same server's 5 most likely tokens at every position are transformers' top 5, and a token cut
        # at its context gets padding
        check_topk_against_transformers(served, tiny_model_dir, prompt, [full, shorter])
        # and preflight says the same of it, asking it as the trainer would
        assert check_teacher_url(served.model_copy(update={"model_name_or_path": "builtin:tiny"})) == ([], [])
    finally:
        server.close()


def check_against_transformers(served: GRPOConfig, model_dir) -> None:
    """The launched teacher's logprobs of two groups equal transformers' log_softmax of `model_dir` (float32, T=1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [
        ("reverse: hello\n", ["olleh", "", "o", "olleh olleh olleh, and a longer tail of text"]),
        ("add 12 and 30:", ["42", "4", "forty-two\n"]),
    ]
    groups = [
        (tokenizer.encode(p, add_special_tokens=False), [tokenizer.encode(c, add_special_tokens=False) for c in cs])
        for p, cs in texts
    ]

    async def scored() -> list[list[list[float]]]:
        client = TeacherClient.from_config(served.distillation)
        try:
            return list(await asyncio.gather(*(client.score(p, cs) for p, cs in groups)))
        finally:
            await client.aclose()

    for (prompt, completions), teacher in zip(groups, asyncio.run(scored()), strict=True):
        assert [len(row) for row in teacher] == [len(c) for c in completions]
        for completion, row in zip(completions, teacher, strict=True):
            if completion:
                ids = torch.tensor([prompt + completion])
                with torch.no_grad():
                    logps = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (P + T, V)
                positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
                expected = logps[positions, torch.tensor(completion)].tolist()
                assert row == pytest.approx(expected, abs=1e-4)  # float32; vLLM's CPU kernels against eager


def test_preflight_of_a_real_served_teacher(vllm_server, tmp_path):
    url = f"{vllm_server.url}/v1"
    fits = GRPOConfig(model_name_or_path="builtin:tiny", teacher_url=url, vllm_max_model_len=512)
    assert check_teacher_url(fits) == ([], [])
    (problem,) = check_teacher_url(fits.model_copy(update={"vllm_max_model_len": 600}))[0]
    assert problem.field == URL_FIELD and "max_model_len=512" in str(problem) and "--max-model-len 600" in str(problem)
    # a student whose tokenizer maps two tokens the other way round: the teacher's ids would mean other tokens
    student = tmp_path / "student"
    student.mkdir()
    tokenizer = build_tiny_tokenizer()
    vocab = dict(tokenizer.get_vocab())
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (student / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    type(tokenizer)(
        vocab=vocab, merges=[], eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    ).save_pretrained(student)  # fmt: skip
    (problem,) = check_teacher_url(fits.model_copy(update={"model_name_or_path": str(student)}))[0]
    assert problem.field == URL_FIELD and "does not tokenize as the student does" in str(problem)


TOPK = 5


def check_topk_against_transformers(served: GRPOConfig, model_dir, cut_prompt: list[int], cut: list[list[int]]) -> None:
    """`score_group` with topk=TOPK against the launched teacher: at every completion position, TOPK ids and logprobs
    equal transformers' top TOPK of log_softmax of `model_dir` (float32, T=1), in the same order, and the actual
    token's logprob equals `score`'s; `cut` (completions of `cut_prompt`, the first filling the teacher's context)
    gets padding (ids 0, NaN) at its last token only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.encode("reverse: hello\n", add_special_tokens=False)
    completions = [tokenizer.encode(c, add_special_tokens=False) for c in ("olleh", "", "olleh olleh, and a tail")]

    async def scored():
        client = TeacherClient(served.distillation.teacher_url, model=served.distillation.teacher_model, topk=TOPK)
        try:
            return await client.score_group(prompt, completions), await client.score_group(cut_prompt, cut)
        finally:
            await client.aclose()

    scores, cut_scores = asyncio.run(scored())
    assert [len(row) for row in scores.topk_ids] == [len(c) for c in completions]
    for completion, logprobs, ids, values in zip(
        completions, scores.logprobs, scores.topk_ids, scores.topk_logprobs, strict=True
    ):
        if not completion:
            assert ids == values == logprobs == []
            continue
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        top = torch.topk(logps[positions], TOPK, dim=-1)
        assert ids == top.indices.tolist()  # the same tokens, most likely first
        for row, expected in zip(values, top.values.tolist(), strict=True):
            assert row == pytest.approx(expected, abs=1e-4)
        assert logprobs == pytest.approx(logps[positions, torch.tensor(completion)].tolist(), abs=1e-4)
    whole_ids, whole_values = cut_scores.topk_ids[0], cut_scores.topk_logprobs[0]
    assert whole_ids[-1] == [0] * TOPK and all(math.isnan(x) for x in whole_values[-1])
    assert all(len(row) == TOPK and math.isfinite(sum(row)) for row in whole_values[:-1] + cut_scores.topk_logprobs[1])
    assert whole_ids[:-1] == cut_scores.topk_ids[1]  # the same tokens, the same context
