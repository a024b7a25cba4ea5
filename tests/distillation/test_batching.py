"""Coalescing the teacher's requests (`distillation.batching.PromptBatcher`): callers within one window share one
request and each gets back exactly its own choices; a full batch goes at once; a failed request fails every caller of
its batch and no other; a cancelled caller leaves the others' answers intact; `aclose` leaves no task behind. And the
teacher's client on a stub server: concurrent groups share one `/completions` request and score as they would alone."""

from __future__ import annotations

import asyncio

import pytest

from async_grpo.distillation.batching import PromptBatcher, split_choices
from async_grpo.distillation.teacher import TeacherClient, TeacherError
from tests.distillation.stub_teacher import StubTeacher, expected


class Sender:
    """A `send` that answers one choice per prompt (its first token as "text"), after `delay_s`, recording calls."""

    def __init__(self, delay_s: float = 0.0, fail: Exception | None = None):
        self.calls: list[list[list[int]]] = []
        self.delay_s = delay_s
        self.fail = fail

    async def __call__(self, prompts: list[list[int]]) -> dict:
        self.calls.append(prompts)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return {"choices": [{"index": i, "text": p[0]} for i, p in reversed(list(enumerate(prompts)))]}


def texts(answer: dict) -> list[int]:
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["text"] for c in answer["choices"]]


def test_callers_within_one_window_share_one_request_and_get_their_own_choices():
    async def go():
        send = Sender()
        batcher = PromptBatcher(send, wait_s=0.05, max_prompts=100)
        a, b, c = await asyncio.gather(
            batcher.submit([[1], [2]]), batcher.submit([[3]]), batcher.submit([[4], [5], [6]])
        )
        await batcher.aclose()
        return send, batcher, (a, b, c)

    send, batcher, (a, b, c) = asyncio.run(go())
    assert len(send.calls) == 1 == batcher.requests_sent and send.calls[0] == [[1], [2], [3], [4], [5], [6]]
    assert (texts(a), texts(b), texts(c)) == ([1, 2], [3], [4, 5, 6])


def test_without_a_window_every_call_is_its_own_request():
    async def go():
        send = Sender()
        batcher = PromptBatcher(send, wait_s=0.0, max_prompts=100)
        out = await asyncio.gather(batcher.submit([[1]]), batcher.submit([[2]]))
        return send, out

    send, out = asyncio.run(go())
    assert send.calls == [[[1]], [[2]]] and [texts(o) for o in out] == [[1], [2]]


def test_a_full_batch_goes_at_once_without_waiting_for_the_window():
    async def go():
        send = Sender()
        batcher = PromptBatcher(send, wait_s=30.0, max_prompts=3)  # the window would outlast the test's timeout
        out = await asyncio.wait_for(asyncio.gather(batcher.submit([[1], [2]]), batcher.submit([[3]])), 5.0)
        await batcher.aclose()
        return send, out

    send, out = asyncio.run(go())
    assert send.calls == [[[1], [2], [3]]] and [texts(o) for o in out] == [[1, 2], [3]]


def test_a_failed_request_fails_every_caller_of_its_batch_and_no_later_one():
    async def go():
        send = Sender(fail=TeacherError("teacher down"))
        batcher = PromptBatcher(send, wait_s=0.05, max_prompts=100)
        first = await asyncio.gather(batcher.submit([[1]]), batcher.submit([[2]]), return_exceptions=True)
        send.fail = None
        later = await batcher.submit([[3]])
        await batcher.aclose()
        return first, later

    first, later = asyncio.run(go())
    assert all(isinstance(e, TeacherError) for e in first) and texts(later) == [3]


def test_a_malformed_answer_is_a_value_error_for_every_caller():
    async def go():
        async def send(prompts):
            return {"choices": [{"index": 0}]}  # one choice for two prompts

        batcher = PromptBatcher(send, wait_s=0.05, max_prompts=100)
        out = await asyncio.gather(batcher.submit([[1]]), batcher.submit([[2]]), return_exceptions=True)
        await batcher.aclose()
        return out

    assert all(isinstance(e, ValueError) for e in asyncio.run(go()))


def test_a_cancelled_caller_leaves_the_others_answers_intact():
    async def go():
        send = Sender(delay_s=0.1)
        batcher = PromptBatcher(send, wait_s=0.02, max_prompts=100)
        gone = asyncio.ensure_future(batcher.submit([[1]]))
        kept = asyncio.ensure_future(batcher.submit([[2]]))
        await asyncio.sleep(0.05)  # the batch is in flight
        gone.cancel()
        answer = await kept
        await batcher.aclose()
        return gone, answer

    gone, answer = asyncio.run(go())
    assert gone.cancelled() and texts(answer) == [2]


def test_aclose_cancels_the_waiting_callers_and_leaves_no_task():
    async def go():
        send = Sender(delay_s=10.0)
        batcher = PromptBatcher(send, wait_s=0.01, max_prompts=100)
        in_flight = asyncio.ensure_future(batcher.submit([[1]]))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(batcher.submit([[2]]))  # in the next window
        await asyncio.sleep(0)
        await asyncio.wait_for(batcher.aclose(), 2.0)
        results = await asyncio.gather(in_flight, waiting, return_exceptions=True)
        return results, batcher

    results, batcher = asyncio.run(go())
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert batcher.tasks_alive == 0  # nothing is left running


def test_split_choices_reindexes_each_part_and_refuses_a_mismatch():
    answer = {"choices": [{"index": 2, "t": "c"}, {"index": 0, "t": "a"}, {"index": 1, "t": "b"}]}
    parts = split_choices(answer, [2, 1])
    assert parts == [
        {"choices": [{"index": 0, "t": "a"}, {"index": 1, "t": "b"}]},
        {"choices": [{"index": 0, "t": "c"}]},
    ]
    with pytest.raises(ValueError, match="for 4 prompts"):
        split_choices(answer, [2, 2])
    with pytest.raises(ValueError, match="no indexed choices"):
        split_choices({}, [1])
    with pytest.raises(ValueError, match="wait_s"):
        PromptBatcher(Sender(), wait_s=-1.0, max_prompts=1)


def test_concurrent_groups_share_one_teacher_request_and_score_as_alone():
    groups = [([5, 6, 7], [[10, 11], [12]]), ([8, 9], [[20, 21, 22]]), ([5, 6, 7], [[], [30]])]

    async def go(url):
        client = TeacherClient(url, batch_wait_s=0.05)
        try:
            return await asyncio.gather(*(client.score(p, c) for p, c in groups))
        finally:
            await client.aclose()

    with StubTeacher() as stub:
        out = asyncio.run(go(stub.url))
        bodies = stub.completions()
    assert len(bodies) == 1 and len(bodies[0]["prompt"]) == 4  # the empty completion is not sent
    for (prompt, completions), got in zip(groups, out, strict=True):
        assert got == [expected(prompt, c) for c in completions]
