"""The teacher's client (`distillation.teacher`) against a stub vLLM teacher on 127.0.0.1 (`stub_teacher`): the request
it sends, the prompt-logprob parser, and what it does when the teacher fails: 4xx at once, 5xx / dropped connections /
time-outs retried then `TeacherError` / `TeacherTimeout` (never a raw httpx error), at most max_concurrency in flight.
The same client against a real vLLM server: tests/integration/test_teacher_server.py."""

from __future__ import annotations

import asyncio
import math
import pickle
import time

import pytest

from async_grpo.config.sections.distillation import TEACHER_API_KEY_ENV, DistillationConfig
from async_grpo.distillation.teacher import (
    TeacherClient,
    TeacherError,
    TeacherTimeout,
    parse_prompt_logprobs,
    teacher_url,
)
from async_grpo.inference.server import free_port
from async_grpo.transports.drops import DROP_REASONS
from async_grpo.transports.scorer import RewardError
from tests.distillation.stub_teacher import MODEL, StubTeacher, expected

PROMPT = [5, 6, 7]
COMPLETIONS = [[10, 11, 12, 13], [], [20], [30, 31]]  # uneven, one empty


def score(client: TeacherClient, prompt=PROMPT, completions=COMPLETIONS) -> list[list[float]]:
    """`client.score` on a fresh loop, the client closed after."""

    async def go():
        try:
            return await client.score(prompt, completions)
        finally:
            await client.aclose()

    return asyncio.run(go())


# ------------------------------------------------------------------ the parser
def test_parser_picks_the_actual_tokens_entry_at_the_completion_positions():
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    answer = {
        "choices": [
            {"index": 1, "prompt_logprobs": [None, {"2": {"logprob": -0.2}}, {"5": {"logprob": -0.5, "rank": 3}}]},
            {
                "index": 0,
                "prompt_logprobs": [
                    None,
                    {"2": {"logprob": -0.2}},
                    {"3": {"logprob": -0.3}, "9": {"logprob": -0.01}},  # a top-k entry beside the actual token
                    {"4": {"logprob": -0.4}},
                ],
            },
        ]
    }
    assert parse_prompt_logprobs(answer, seqs, 2) == [[-0.3, -0.4], [-0.5]]


def test_parser_gives_nan_where_the_teacher_gave_no_finite_logprob():
    seqs = [[1, 2, 3, 4, 5]]
    entries = [None, {"2": {"logprob": -1.0}}, {"7": {"logprob": -0.1}}, {"4": {"logprob": float("-inf")}}, None]
    out = parse_prompt_logprobs({"choices": [{"index": 0, "prompt_logprobs": entries}]}, seqs, 2)
    assert len(out[0]) == 3 and all(math.isnan(v) for v in out[0])


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"choices": [{"prompt_logprobs": []}]},  # no index
        {"choices": [{"index": 1, "prompt_logprobs": [None, {}, {}]}]},  # wrong index
        {"choices": [{"index": 0, "prompt_logprobs": [None, {}]}]},  # one entry short
        {"choices": [{"index": 0, "prompt_logprobs": None}]},  # no prompt logprobs asked
        {"choices": []},
    ],
)
def test_parser_refuses_a_malformed_answer(answer):
    with pytest.raises(ValueError):
        parse_prompt_logprobs(answer, [[1, 2, 3]], 2)


# ------------------------------------------------------------------ the request
def test_one_batched_request_per_group_and_the_logprobs_at_the_completion_positions(monkeypatch):
    monkeypatch.setenv(TEACHER_API_KEY_ENV, "s3cret")
    with StubTeacher() as stub:
        client = TeacherClient(stub.url)

        async def twice():
            try:
                return [await client.score(PROMPT, COMPLETIONS), await client.score([1], [[2, 3]])]
            finally:
                await client.aclose()

        first, second = asyncio.run(twice())
    assert first == [pytest.approx(expected(PROMPT, c)) for c in COMPLETIONS]
    assert first[1] == []
    assert second == [pytest.approx(expected([1], [2, 3]))]
    body = stub.completions()[0]
    assert body == {
        "model": MODEL,
        "prompt": [PROMPT + c for c in COMPLETIONS if c],  # the empty completion is not sent
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    assert [(m, p) for m, p, _, _ in stub.requests] == [
        ("GET", "/v1/models"),  # discovered once
        ("POST", "/v1/completions"),
        ("POST", "/v1/completions"),
    ]
    assert all(h.get("Authorization") == "Bearer s3cret" for _, _, h, _ in stub.requests)


def test_a_named_model_is_used_as_named_and_no_token_means_no_header(monkeypatch):
    monkeypatch.delenv(TEACHER_API_KEY_ENV, raising=False)
    with StubTeacher() as stub:
        score(TeacherClient(stub.url, model="mine"))
    assert [p for _, p, _, _ in stub.requests] == ["/v1/models", "/v1/completions"]  # asked once, for its length
    assert stub.completions()[0]["model"] == "mine"
    assert all("Authorization" not in headers for _, _, headers, _ in stub.requests)


def test_a_sequence_that_fills_the_teachers_context_loses_only_its_tail():
    """vLLM refuses a prompt of max_model_len tokens (no room for max_tokens=1): the client sends max_model_len - 1
    tokens of it, and the completion tokens cut off get NaN; shorter sequences go whole."""
    with StubTeacher() as stub:
        stub.max_model_len = len(PROMPT) + 3  # room for 2 completion tokens
        out = score(TeacherClient(stub.url))
    sent = stub.completions()[0]["prompt"]
    assert max(len(seq) for seq in sent) == len(PROMPT) + 2
    assert out[0][:2] == pytest.approx(expected(PROMPT, COMPLETIONS[0][:2]))
    assert all(math.isnan(x) for x in out[0][2:]) and len(out[0]) == 4
    assert out[1] == [] and out[2] == pytest.approx(expected(PROMPT, [20]))
    assert out[3] == pytest.approx(expected(PROMPT, [30, 31]))


def test_a_prompt_with_no_room_left_is_not_sent():
    with StubTeacher() as stub:
        stub.max_model_len = len(PROMPT) + 1  # the prompt alone fills max_model_len - 1
        out = score(TeacherClient(stub.url))
    assert stub.completions() == []
    assert [len(row) for row in out] == [len(c) for c in COMPLETIONS]
    assert all(math.isnan(x) for row in out for x in row)


def test_a_group_of_empty_completions_sends_nothing():
    with StubTeacher() as stub:
        assert score(TeacherClient(stub.url), completions=[[], []]) == [[], []]
    assert stub.requests == []


def test_from_config_and_the_url_check():
    section = DistillationConfig(
        teacher_url="http://127.0.0.1:9/v1/", teacher_model="t", teacher_timeout_s=3, teacher_max_retries=5
    )
    client = TeacherClient.from_config(section)
    assert (client.base_url, client.model, client.timeout_s, client.max_retries) == ("http://127.0.0.1:9/v1", "t", 3, 5)
    asyncio.run(client.aclose())
    with pytest.raises(ValueError, match="teacher_url is not set"):
        teacher_url(DistillationConfig(teacher_model_name_or_path="/models/teacher"))
    with pytest.raises(ValueError, match="not an http"):
        TeacherClient("127.0.0.1:8000/v1")


# ------------------------------------------------------------------ failures
def test_errors_are_reward_errors_with_their_drop_reasons():
    assert issubclass(TeacherTimeout, TeacherError) and issubclass(TeacherError, RewardError)
    assert (TeacherError.reason, TeacherTimeout.reason) == ("teacher_error", "teacher_timeout")
    assert {TeacherError.reason, TeacherTimeout.reason} <= set(DROP_REASONS)
    err = pickle.loads(pickle.dumps(TeacherTimeout("slow")))
    assert isinstance(err, TeacherTimeout) and str(err) == "slow"


def test_a_5xx_and_a_dropped_connection_are_retried():
    with StubTeacher() as stub:
        stub.script = [("status", 503, "busy"), ("close",)]
        out = score(TeacherClient(stub.url, model="m", max_retries=2, backoff_s=0.01))
    assert out == [pytest.approx(expected(PROMPT, c)) for c in COMPLETIONS]
    assert len(stub.completions()) == 3


def test_a_4xx_is_not_retried_and_names_the_servers_message():
    with StubTeacher() as stub:
        stub.script = [("status", 400, "This model's maximum context length is 512 tokens")]
        with pytest.raises(TeacherError, match="HTTP 400.*maximum context length") as info:
            score(TeacherClient(stub.url, model="m", max_retries=3, backoff_s=0.01))
    assert type(info.value) is TeacherError and info.value.reason == "teacher_error"
    assert len(stub.completions()) == 1


def test_5xx_on_every_attempt_is_a_teacher_error_after_the_retries():
    with StubTeacher() as stub:
        stub.script = [("status", 500, "boom")] * 3
        with pytest.raises(TeacherError, match="failed 3 time.*HTTP 500: boom") as info:
            score(TeacherClient(stub.url, model="m", max_retries=2, backoff_s=0.01))
    assert type(info.value) is TeacherError
    assert len(stub.completions()) == 3


def test_a_malformed_answer_is_a_teacher_error_not_retried():
    with StubTeacher() as stub:
        stub.script = [("json", {"choices": [{"index": 0, "text": "no prompt logprobs"}]})]
        with pytest.raises(TeacherError, match="malformed"):
            score(TeacherClient(stub.url, model="m", max_retries=2, backoff_s=0.01))
    assert len(stub.completions()) == 1


def test_no_answer_in_time_on_every_attempt_is_a_teacher_timeout():
    with StubTeacher() as stub:
        stub.script = [("sleep", 2.0)] * 2
        t0 = time.monotonic()
        with pytest.raises(TeacherTimeout, match="teacher_timeout_s=0.2") as info:
            score(TeacherClient(stub.url, model="m", timeout_s=0.2, max_retries=1, backoff_s=0.01))
        assert time.monotonic() - t0 < 1.5  # two attempts of 0.2 s, not the server's 2 s
    assert info.value.reason == "teacher_timeout"
    assert len(stub.completions()) == 2


def test_a_timeout_then_an_answer_succeeds():
    with StubTeacher() as stub:
        stub.script = [("sleep", 2.0)]
        out = score(TeacherClient(stub.url, model="m", timeout_s=0.3, max_retries=1, backoff_s=0.01))
    assert out[0] == pytest.approx(expected(PROMPT, COMPLETIONS[0]))


def test_an_unreachable_teacher_is_a_teacher_error_not_an_httpx_error():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(TeacherError, match="failed 2 time.*ConnectError") as info:
        score(TeacherClient(url, model="m", max_retries=1, backoff_s=0.01))
    assert type(info.value) is TeacherError
    with pytest.raises(TeacherError, match="failed 1 time"):  # model discovery fails the same way
        score(TeacherClient(url, max_retries=0))


def test_at_most_max_concurrency_requests_in_flight():
    with StubTeacher(answer_delay_s=0.1) as stub:
        client = TeacherClient(stub.url, model="m", max_concurrency=2)

        async def many():
            try:
                return await asyncio.gather(*(client.score([1, 2], [[3 + i]]) for i in range(6)))
            finally:
                await client.aclose()

        out = asyncio.run(many())
    assert [row[0][0] for row in out] == pytest.approx([expected([1, 2], [3 + i])[0] for i in range(6)])
    assert len(stub.completions()) == 6 and stub.in_flight_max == 2
