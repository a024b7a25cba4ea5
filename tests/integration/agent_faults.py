"""An agent for tests/integration/test_agents.py that fails in every way the agent rollout counts, in turn: the
n-th episode this process starts is healthy, raises, hangs, returns a non-number, makes no call, or tries a call past
max_turns=2 (and the run must count each and go on)."""

from __future__ import annotations

import asyncio
import itertools

from openai import AsyncOpenAI, BadRequestError

KINDS = ("healthy", "exception", "timeout", "bad_return", "no_call", "max_turns")
_EPISODES = itertools.count()


async def play(row: dict, base_url: str, api_key: str):
    """One episode: a guess, then the fault of this episode's turn in KINDS."""
    kind = KINDS[next(_EPISODES) % len(KINDS)]
    if kind == "no_call":
        return 0.0
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = list(row["prompt"])
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        if kind == "exception":
            raise RuntimeError("the agent crashed after its first call")
        if kind == "timeout":
            await asyncio.sleep(30)
        if kind == "bad_return":
            return "won"
        if kind == "max_turns":
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            try:
                for _ in range(2):
                    messages += [{"role": "user", "content": "again"}]
                    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            except BadRequestError:
                return 0.5
        return 1.0
