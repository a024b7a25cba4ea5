"""The agent endpoint (agents.endpoint) against a scripted generation client, called with the real `openai` client:
chat (tools, streaming) and completions are served and recorded exactly; what cannot be recorded or honored is
refused with an API error the agent sees and counted; keys are per episode and revoked."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from async_grpo.agents.endpoint import AgentEndpoint, chat_messages
from async_grpo.inference.client import Completion, GenerationError, RejectedRequestError
from async_grpo.orchestrator.rollout import SamplingSettings
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.render import render_ids

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class TextClient:
    """A `GenerationClient` answering each request with the next scripted text (encoded, cut at max_tokens)."""

    def __init__(self, tok, texts, finish="stop", error=None):
        self.tok, self.texts, self.finish, self.error, self.requests = tok, list(texts), finish, error, []

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None,
                       extra_body=None):  # fmt: skip
        self.requests.append({"prompt_ids": list(prompt_ids), "n": n, "max_tokens": max_tokens,
                              "temperature": temperature, "seed": seed, "extra_body": extra_body})  # fmt: skip
        if self.error is not None:
            raise self.error
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        finish = self.finish
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        return [Completion(ids, [-(k + 1) / 10 for k in range(len(ids))], "", finish)]


def serve(tok, client, body, max_turns=4, max_len=200, versions=(7,)):
    """Start an endpoint, open one session, run `body(openai_client, session)` and return (its result, session)."""

    async def main():
        endpoint = AgentEndpoint(tok)
        await endpoint.start()
        counter = iter(versions)
        last = [versions[0]]

        def version():
            last[0] = next(counter, last[0])
            return last[0]

        session = endpoint.open_session(client, SamplingSettings(1, max_len, 0.7, top_p=0.9), version,
                                        max_turns=max_turns)  # fmt: skip
        try:
            async with openai.AsyncOpenAI(base_url=endpoint.url, api_key=session.key, max_retries=0) as oai:
                return await body(oai, session), session
        finally:
            await endpoint.aclose()

    return asyncio.run(main())


def test_chat_with_tools_is_rendered_by_the_template_and_recorded_exactly(tok):
    client = TextClient(tok, ['<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call><|im_end|>',
                              "42<|im_end|>"])  # fmt: skip
    messages = [{"role": "user", "content": "6*7?"}]

    async def body(oai, session):
        first = await oai.chat.completions.create(model="any", messages=messages, tools=[CALC], temperature=0.0)
        call = first.choices[0].message.tool_calls[0]
        convo = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]  # fmt: skip
        second = await oai.chat.completions.create(model="any", messages=convo, tools=[CALC])
        return first, second, convo

    (first, second, convo), session = serve(tok, client, body, versions=(7, 8))
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    assert second.choices[0].message.content == "42" and second.choices[0].finish_reason == "stop"
    # each prompt is the policy's chat template over the request, tools rendered; the run's sampling applies
    schemas = [CALC]
    assert client.requests[0]["prompt_ids"] == render_ids(tok, messages, schemas, add_generation_prompt=True)
    assert client.requests[1]["prompt_ids"] == render_ids(tok, chat_messages(convo), schemas,
                                                          add_generation_prompt=True)  # fmt: skip
    assert {r["temperature"] for r in client.requests} == {0.7}  # the agent's temperature=0.0 is not the run's
    # recorded exactly: the ids vLLM returned, its logprobs, the version read when each call was sent
    a, b = session.calls
    assert a.completion_ids == tok.encode(client_text(tok, a), add_special_tokens=False)
    assert a.logprobs == [-(k + 1) / 10 for k in range(len(a.completion_ids))]
    assert (a.version, b.version) == (7, 8)
    assert first.model_extra["policy_version"] == 7 and second.model_extra["policy_version"] == 8
    # the second prompt starts with the first prompt and completion: one trajectory, nothing re-tokenized
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
    assert session.first_request == messages
    assert session.final_conversation[-1] == {"role": "assistant", "content": "42"}


def client_text(tok, call):
    return tok.decode(call.completion_ids, skip_special_tokens=False)


def test_streaming_chat_and_completions(tok):
    client = TextClient(tok, ["hello<|im_end|>", "olleh"])

    async def body(oai, session):
        stream = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   stream=True)  # fmt: skip
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        done = await oai.completions.create(model="m", prompt="reverse: hello\n", max_tokens=3)
        return text, finish, done

    (text, finish, done), session = serve(tok, client, body)
    assert (text, finish) == ("hello", "stop")
    assert done.choices[0].text == "oll" and done.choices[0].finish_reason == "length"
    assert client.requests[1]["prompt_ids"] == tok.encode("reverse: hello\n")  # as vLLM tokenizes a text prompt
    assert client.requests[1]["max_tokens"] == 3  # the agent's cap lowers the budget
    assert session.final_conversation == "oll" and session.first_request == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 2}, "n"),
        ({"tool_choice": "required", "tools": [CALC]}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
    ],
)
def test_what_cannot_be_recorded_or_honored_is_refused_and_counted(tok, kwargs, param):
    client = TextClient(tok, ["x<|im_end|>"])

    async def body(oai, session):
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)
        return err.value

    err, session = serve(tok, client, body)
    assert err.body["param"] == param
    assert session.refused["unsupported"] == 1 and not session.calls and not client.requests


def test_max_turns_and_budget_are_refused_with_an_api_error(tok):
    client = TextClient(tok, ["ab<|im_end|>"] * 3)

    async def body(oai, session):
        msgs = [{"role": "user", "content": "go"}]
        await oai.chat.completions.create(model="m", messages=msgs)
        await oai.chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model="m", messages=msgs)
        return err.value

    err, session = serve(tok, client, body, max_turns=2)
    assert err.body["code"] == "max_turns_exceeded" and session.refused["max_turns"] == 1 and len(session.calls) == 2

    client = TextClient(tok, ["abcdef<|im_end|>", "x<|im_end|>"])

    async def grow(oai, session):
        msgs = [{"role": "user", "content": "go"}]
        first = await oai.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more " * 4}]  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model="m", messages=msgs)
        return err.value

    err, session = serve(tok, client, grow, max_len=12)
    assert err.body["code"] == "context_length_exceeded"
    assert session.budget_exhausted and session.refused["budget"] == 1 and len(session.calls) == 1


def test_keys_are_per_episode_and_revoked(tok):
    async def main():
        endpoint = AgentEndpoint(tok)
        await endpoint.start()
        sampling = SamplingSettings(1, 50, 1.0)
        a = endpoint.open_session(TextClient(tok, ["a<|im_end|>"]), sampling, lambda: 0, max_turns=4)
        b = endpoint.open_session(TextClient(tok, ["b<|im_end|>"]), sampling, lambda: 0, max_turns=4)
        msgs = [{"role": "user", "content": "hi"}]
        try:
            async with openai.AsyncOpenAI(base_url=endpoint.url, api_key=b.key, max_retries=0) as oai:
                assert (await oai.chat.completions.create(model="m", messages=msgs)).choices[0].message.content == "b"
            async with openai.AsyncOpenAI(base_url=endpoint.url, api_key="ep-guess", max_retries=0) as oai:
                with pytest.raises(openai.AuthenticationError):
                    await oai.chat.completions.create(model="m", messages=msgs)
            endpoint.close_session(a)
            async with openai.AsyncOpenAI(base_url=endpoint.url, api_key=a.key, max_retries=0) as oai:
                with pytest.raises(openai.AuthenticationError):
                    await oai.chat.completions.create(model="m", messages=msgs)
            return a, b
        finally:
            await endpoint.aclose()

    a, b = asyncio.run(main())
    assert not a.calls and len(b.calls) == 1  # concurrent episodes never mix


@pytest.mark.parametrize(
    ("error", "status", "kept"),
    [(RejectedRequestError("prompt too long"), 400, False), (GenerationError("vLLM 500"), 503, True)],
)
def test_vllm_failures_reach_the_agent_and_the_session(tok, error, status, kept):
    client = TextClient(tok, [], error=error)

    async def body(oai, session):
        with pytest.raises(openai.APIStatusError) as err:
            await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return err.value

    err, session = serve(tok, client, body)
    assert err.status_code == status
    assert (session.error is error) == kept
    assert session.refused["rejected_by_vllm"] == int(not kept)


def test_an_aborted_call_is_kept_as_the_sessions_error(tok):
    client = TextClient(tok, ["x"], finish="abort")

    async def body(oai, session):
        with pytest.raises(openai.InternalServerError):
            await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    _, session = serve(tok, client, body)
    assert isinstance(session.error, GenerationError) and not session.calls
