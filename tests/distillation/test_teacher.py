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
    TeacherScores,
    TeacherTimeout,
    parse_prompt_logprobs,
    parse_prompt_topk,
    teacher_url,
)
from async_grpo.inference.server import free_port
from async_grpo.transports.drops import DROP_REASONS
from async_grpo.transports.scorer import RewardError
from tests.distillation.stub_teacher import MODEL, StubTeacher, expected, expected_topk

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
    with pytest.raises(ValueError):  # the top-k parser validates the choices the same way
        parse_prompt_topk(answer, [[1, 2, 3]], 2, 2)


# ------------------------------------------------------------------ the top-k parser
def _entry(logprob: float, rank: int | None = None) -> dict:
    """One vLLM 0.32 prompt-logprob entry (rank omitted when None)."""
    out = {"logprob": logprob, "decoded_token": "x"}
    if rank is not None:
        out["rank"] = rank
    return out


def _nan_equal(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y) for x, y in zip(a, b))


def test_topk_parser_orders_by_rank_and_keeps_the_actual_tokens_logprob_outside_the_topk():
    """vLLM's dict holds the actual token's entry first (rank > k when it is not among the top k), then ranks 1..k;
    the parser keeps ranks 1..k in rank order whatever the dict's order, and reads the actual token's logprob from
    the same dict."""
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    answer = {
        "choices": [
            {
                "index": 0,
                "prompt_logprobs": [
                    None,
                    {"2": _entry(-0.5, 2), "7": _entry(-0.2, 1), "9": _entry(-3.0, 3)},  # the prompt: not returned
                    # the actual token 3 outside the top 2 (rank 5), the top 2 listed out of order
                    {"3": _entry(-4.0, 5), "8": _entry(-0.9, 2), "6": _entry(-0.1, 1)},
                    # the actual token 4 is the most likely: its one entry holds rank 1
                    {"4": _entry(-0.05, 1), "11": _entry(-3.5, 2)},
                ],
            },
            {
                "index": 1,
                "prompt_logprobs": [
                    None,
                    {"2": _entry(-1.0, 1)},
                    {"5": _entry(-2.0, 3), "6": _entry(-0.3, 1), "7": _entry(-1.5, 2)},
                ],
            },
        ]
    }
    out = parse_prompt_topk(answer, seqs, 2, 2)
    assert isinstance(out, TeacherScores)
    assert out.logprobs == [[-4.0, -0.05], [-2.0]]
    assert out.topk_ids == [[[6, 8], [4, 11]], [[6, 7]]]
    assert out.topk_logprobs == [[[-0.1, -0.9], [-0.05, -3.5]], [[-0.3, -1.5]]]
    # prompt_logprobs=0 of the same answer reads the same actual-token logprobs
    assert parse_prompt_logprobs(answer, seqs, 2) == out.logprobs


def test_topk_parser_pads_short_and_missing_positions_and_nans_non_finite_logprobs():
    seqs = [[1, 2, 3, 4, 5]]
    entries = [
        None,  # the first prompt token: vLLM's None
        {"2": _entry(-1.0, 1)},
        {"3": _entry(-0.7, 1), "12": _entry(float("-inf"), 2)},  # fewer than k = 3, one logprob not finite
        None,  # no dict at all: every entry padded, the actual token NaN
        {"5": _entry(-0.2, 1), "13": _entry(-1.0, 2), "14": _entry(-2.0, 3), "15": _entry(-3.0, 4)},  # more than k
    ]
    out = parse_prompt_topk({"choices": [{"index": 0, "prompt_logprobs": entries}]}, seqs, 2, 3)
    assert _nan_equal(out.logprobs[0], [-0.7, math.nan, -0.2])
    assert out.topk_ids == [[[3, 12, 0], [0, 0, 0], [5, 13, 14]]]
    rows = out.topk_logprobs[0]
    assert _nan_equal(rows[0], [-0.7, math.nan, math.nan])
    assert _nan_equal(rows[1], [math.nan] * 3)
    assert _nan_equal(rows[2], [-0.2, -1.0, -2.0])


def test_topk_parser_falls_back_to_logprob_order_without_int_ranks():
    seqs = [[1, 2, 3]]
    position = {"3": _entry(-5.0), "20": _entry(-0.4), "21": _entry(-0.1, "1"), "22": _entry(float("nan"), 2)}
    out = parse_prompt_topk({"choices": [{"index": 0, "prompt_logprobs": [None, {}, position]}]}, seqs, 2, 3)
    # a rank missing (3, 20) or not an int ("1"): the whole position is ordered by logprob, NaN last, cut at k
    assert out.topk_ids == [[[21, 20, 3]]]
    assert out.topk_logprobs == [[[-0.1, -0.4, -5.0]]]
    assert out.logprobs == [[-5.0]]


@pytest.mark.parametrize(
    "position",
    [
        {"a": _entry(-0.1, 1)},  # a key that is no token id
        {"-3": _entry(-0.1, 1)},  # a negative id
        {"3": "likely"},  # a value that is no entry
        {"3": [-0.1, 1]},
    ],
)
def test_topk_parser_refuses_a_malformed_position(position):
    answer = {"choices": [{"index": 0, "prompt_logprobs": [None, {"2": _entry(-1.0, 1)}, position]}]}
    with pytest.raises(ValueError, match="choice 0, prompt position 2"):
        parse_prompt_topk(answer, [[1, 2, 3]], 2, 2)


def test_topk_parser_needs_a_positive_k():
    answer = {"choices": [{"index": 0, "prompt_logprobs": [None, {}]}]}
    for k in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="k=.* must be an int >= 1"):
            parse_prompt_topk(answer, [[1, 2]], 1, k)


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


def score_group(client: TeacherClient, prompt=PROMPT, completions=COMPLETIONS) -> TeacherScores:
    """`client.score_group` on a fresh loop, the client closed after."""

    async def go():
        try:
            return await client.score_group(prompt, completions)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_topk_asks_prompt_logprobs_k_and_returns_the_topk_at_every_completion_position():
    with StubTeacher() as stub:
        out = score_group(TeacherClient(stub.url, topk=3))
    body = stub.completions()[0]
    assert body["prompt_logprobs"] == 3 and body["max_tokens"] == 1 and body["temperature"] == 1.0
    assert out.logprobs == [pytest.approx(expected(PROMPT, c)) for c in COMPLETIONS]  # the actual tokens', not the top
    for c, ids, logprobs in zip(COMPLETIONS, out.topk_ids, out.topk_logprobs, strict=True):
        want_ids, want_logprobs = expected_topk(PROMPT, c, 3)
        assert ids == want_ids and len(ids) == len(c)
        assert logprobs == [pytest.approx(row) for row in want_logprobs]
    assert out.topk_ids[1] == [] and out.topk_logprobs[1] == []


def test_without_topk_score_group_returns_no_topk_and_score_is_its_logprobs():
    with StubTeacher() as stub:
        out = score_group(TeacherClient(stub.url))
        assert stub.completions()[0]["prompt_logprobs"] == 0
        assert score(TeacherClient(stub.url)) == out.logprobs
    assert out.topk_ids == [] and out.topk_logprobs == []
    assert out.logprobs == [pytest.approx(expected(PROMPT, c)) for c in COMPLETIONS]


def test_topk_of_tokens_cut_at_the_teachers_context_is_padding():
    with StubTeacher() as stub:
        stub.max_model_len = len(PROMPT) + 3  # room for 2 completion tokens
        out = score_group(TeacherClient(stub.url, topk=2))
    want_ids, want_logprobs = expected_topk(PROMPT, COMPLETIONS[0][:2], 2)
    assert out.topk_ids[0] == want_ids + [[0, 0], [0, 0]]
    assert out.topk_logprobs[0][:2] == [pytest.approx(row) for row in want_logprobs]
    assert all(math.isnan(x) for row in out.topk_logprobs[0][2:] for x in row)
    assert out.topk_ids[3] == expected_topk(PROMPT, [30, 31], 2)[0]
    with StubTeacher() as stub:  # nothing left to send: every position is padding, no request
        stub.max_model_len = len(PROMPT) + 1
        out = score_group(TeacherClient(stub.url, topk=2))
        assert stub.completions() == []
    assert out.topk_ids == [[[0, 0]] * len(c) for c in COMPLETIONS]
    assert all(math.isnan(x) for rows in out.topk_logprobs for row in rows for x in row)


def test_a_refused_topk_is_a_teacher_error_naming_the_servers_message():
    refusal = "Requested prompt logprobs of 32, which is greater than max allowed: 20"
    with StubTeacher() as stub:
        stub.script = [("status", 400, refusal)]
        with pytest.raises(TeacherError, match="HTTP 400.*greater than max allowed: 20"):
            score_group(TeacherClient(stub.url, model="m", topk=32, max_retries=2, backoff_s=0.01))
    assert len(stub.completions()) == 1


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
    assert client.topk == 0  # reverse_kl: the sampled tokens' logprobs only
    asyncio.run(client.aclose())
    forward = DistillationConfig(
        teacher_url="http://127.0.0.1:9/v1", distillation_loss="forward_kl", distillation_topk=7
    )
    client = TeacherClient.from_config(forward)
    assert client.topk == 7
    asyncio.run(client.aclose())
    for topk in (-1, True, 2.5):
        with pytest.raises(ValueError, match="topk=.* must be an int >= 0"):
            TeacherClient("http://127.0.0.1:9/v1", topk=topk)
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
