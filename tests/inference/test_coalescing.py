"""`RequestCoalescer`: concurrent requests with equal sampling parameters share one multi-prompt call, each keeps
its own answer and its own failure; and `AsyncVLLMClient.generate_batch` maps vLLM's prompt-major choices back to
their prompts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from async_grpo.inference.client import AsyncVLLMClient, GenerationError, RejectedRequestError
from async_grpo.inference.coalescing import RequestCoalescer

PARAMS = {"model": "m", "n": 2, "max_tokens": 4, "temperature": 1.0}


class Recorder:
    """A `send_batch` that answers each prompt with its own token list reversed, after `delay_s`, and records calls."""

    def __init__(self, delay_s: float = 0.0, reject_token: int | None = None, fail: Exception | None = None):
        self.calls: list[tuple[list[list[int]], dict]] = []
        self.delay_s = delay_s
        self.reject_token = reject_token
        self.fail = fail

    async def __call__(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], dict(params)))
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        if self.reject_token is not None and any(self.reject_token in p for p in prompts):
            raise RejectedRequestError(f"prompt with token {self.reject_token} is too long")
        return [list(reversed(p)) for p in prompts]


def run(coro):
    return asyncio.run(coro)


def test_requests_in_one_window_share_one_call_and_keep_their_own_answers():
    send = Recorder()

    async def main():
        c = RequestCoalescer(send, window_s=0.05, max_seqs=128)
        out = await asyncio.gather(*(c.submit([i, i + 100], PARAMS, seqs=2) for i in range(5)))
        return out, c.stats()

    out, stats = run(main())
    assert out == [[i + 100, i] for i in range(5)]
    assert [prompts for prompts, _ in send.calls] == [[[i, i + 100] for i in range(5)]]
    assert send.calls[0][1] == PARAMS
    assert stats == {"requests": 5, "batches": 1, "split_batches": 0}


def test_different_sampling_parameters_never_share_a_call():
    send = Recorder()

    async def main():
        c = RequestCoalescer(send, window_s=0.05, max_seqs=128)
        hot = {**PARAMS, "temperature": 1.5}
        return await asyncio.gather(c.submit([1], PARAMS), c.submit([2], hot), c.submit([3], PARAMS))

    assert run(main()) == [[1], [2], [3]]
    by_temperature = sorted((params["temperature"], prompts) for prompts, params in send.calls)
    assert by_temperature == [(1.0, [[1], [3]]), (1.5, [[2]])]


def test_a_full_batch_is_sent_before_its_window_closes():
    send = Recorder()

    async def main():
        c = RequestCoalescer(send, window_s=30.0, max_seqs=8)
        t0 = time.monotonic()
        out = await asyncio.gather(*(c.submit([i], PARAMS, seqs=2) for i in range(4)))  # 4 x n=2 = 8 sequences
        return out, time.monotonic() - t0

    out, seconds = run(main())
    assert out == [[0], [1], [2], [3]] and seconds < 5.0
    assert len(send.calls) == 1


def test_a_refused_batch_is_split_so_only_the_bad_prompt_fails():
    send = Recorder(reject_token=99)

    async def main():
        c = RequestCoalescer(send, window_s=0.05, max_seqs=128, rejected=RejectedRequestError)
        results = await asyncio.gather(
            c.submit([1], PARAMS), c.submit([99], PARAMS), c.submit([3], PARAMS), return_exceptions=True
        )
        return results, c.stats()

    results, stats = run(main())
    assert results[0] == [1] and results[2] == [3]
    assert isinstance(results[1], RejectedRequestError)
    assert stats["split_batches"] == 1
    assert [prompts for prompts, _ in send.calls] == [[[1], [99], [3]], [[1]], [[99]], [[3]]]


def test_a_transport_failure_reaches_every_request_of_the_batch():
    send = Recorder(fail=httpx.ConnectError("server gone"))

    async def main():
        c = RequestCoalescer(send, window_s=0.05, max_seqs=128, rejected=RejectedRequestError)
        return await asyncio.gather(*(c.submit([i], PARAMS) for i in range(3)), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, httpx.ConnectError) for r in results)
    assert len(send.calls) == 1  # not retried prompt by prompt: the server is gone for all of them


def test_a_request_cancelled_before_its_batch_is_sent_is_left_out():
    send = Recorder()

    async def main():
        c = RequestCoalescer(send, window_s=0.05, max_seqs=128)
        keep = asyncio.ensure_future(c.submit([1], PARAMS))
        drop = asyncio.ensure_future(c.submit([2], PARAMS))
        await asyncio.sleep(0)
        drop.cancel()
        return await keep, drop.cancelled()

    assert run(main()) == ([1], True)
    assert [prompts for prompts, _ in send.calls] == [[[1]]]


def test_aclose_cancels_queued_and_in_flight_requests():
    send = Recorder(delay_s=30.0)

    async def main():
        c = RequestCoalescer(send, window_s=0.01, max_seqs=128)
        queued_late = asyncio.ensure_future(c.submit([1], PARAMS))
        await asyncio.sleep(0.1)  # the first batch is in flight (send sleeps 30 s)
        waiting = asyncio.ensure_future(c.submit([2], {**PARAMS, "n": 3}))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await c.aclose()
        results = await asyncio.gather(queued_late, waiting, return_exceptions=True)
        return results, time.monotonic() - t0

    results, seconds = run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results) and seconds < 5.0


@pytest.mark.parametrize("kwargs", [{"window_s": 0.0, "max_seqs": 8}, {"window_s": 0.01, "max_seqs": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="window_s|max_seqs"):
        RequestCoalescer(Recorder(), **kwargs)


def fake_vllm(requests_seen: list[dict], status: int = 200, drop_last: bool = False):
    """An httpx transport answering /v1/completions like vLLM: choices prompt-major (index = b * n + j), each
    choice's token ids [prompt's first token, j] with logprobs."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests_seen.append(body)
        if status != 200:
            return httpx.Response(status, text="prompt too long")
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        n = body["n"]
        choices = [
            {
                "index": b * n + j,
                "text": f"{b}.{j}",
                "token_ids": [p[0], j],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": "stop",
            }
            for b, p in enumerate(prompts)
            for j in range(n)
        ]
        if drop_last:
            choices = choices[:-1]
        return httpx.Response(200, json={"choices": choices[::-1]})  # any order: the client sorts by index

    return httpx.MockTransport(handler)


def client_over(transport: httpx.MockTransport, window_s: float) -> AsyncVLLMClient:
    client = AsyncVLLMClient("http://vllm", "m", coalesce_window_s=window_s)
    client._http = httpx.AsyncClient(base_url="http://vllm", transport=transport)
    return client


def test_generate_coalesces_unseeded_groups_and_maps_choices_back_to_their_prompts():
    seen: list[dict] = []

    async def main():
        client = client_over(fake_vllm(seen), window_s=0.05)
        try:
            groups = await asyncio.gather(
                *(client.generate([10 + b, 0], n=3, max_tokens=4, temperature=1.0) for b in range(4))
            )
            seeded = await client.generate([7, 0], n=3, max_tokens=4, temperature=1.0, seed=5)
        finally:
            await client.aclose()
        return groups, seeded

    groups, seeded = run(main())
    assert [[c.token_ids for c in g] for g in groups] == [[[10 + b, j] for j in range(3)] for b in range(4)]
    assert [c.logprobs for c in groups[2]] == [[-0.5, -0.25]] * 3
    assert len(seen) == 2
    assert seen[0]["prompt"] == [[10 + b, 0] for b in range(4)] and "seed" not in seen[0]
    assert seen[1]["prompt"] == [7, 0] and seen[1]["seed"] == 5  # a seeded request is sent alone
    assert [c.token_ids for c in seeded] == [[7, j] for j in range(3)]


def test_generate_batch_classifies_a_4xx_as_rejected_and_checks_the_choice_count():
    async def main(status):
        client = client_over(fake_vllm([], status=status), window_s=0.0)
        try:
            return await client.generate_batch([[1], [2]], {"model": "m", "n": 2})
        finally:
            await client.aclose()

    with pytest.raises(RejectedRequestError, match="400"):
        run(main(400))
    with pytest.raises(GenerationError, match="500") as err:
        run(main(500))
    assert not isinstance(err.value, RejectedRequestError)

    async def short_answer():
        client = client_over(fake_vllm([], drop_last=True), window_s=0.0)
        try:
            return await client.generate_batch([[1], [2]], {"model": "m", "n": 3})
        finally:
            await client.aclose()

    with pytest.raises(GenerationError, match="5 choices for 2 prompts x n=3"):
        run(short_answer())


def test_a_short_answer_fails_every_request_instead_of_leaving_one_waiting():
    async def short(prompts, params):
        return [[0]] * (len(prompts) - 1)

    async def main():
        c = RequestCoalescer(short, window_s=0.01, max_seqs=128)
        return await asyncio.wait_for(
            asyncio.gather(*(c.submit([i], PARAMS) for i in range(3)), return_exceptions=True), timeout=10
        )

    assert all(isinstance(r, ValueError) and "answered 2 of a batch of 3" in str(r) for r in run(main()))
