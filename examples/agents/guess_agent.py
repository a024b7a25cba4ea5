"""A number-guessing agent written against the OpenAI API, unaware of training (docs/agents.md).

It plays the game of `builtin:guess`: the model guesses a secret from 1 to 16, the agent answers "higher" or
"lower" as the user, and a right guess after k guesses earns 0.9 ** (k - 1). It is an ordinary `openai` program:
pointed at any OpenAI-compatible server it plays there. The run points it at its own endpoint, and the episode's
tokens, exactly as vLLM sampled them, become the trained rows.

Two ways to run it, the same file:

    agent: examples/agents/guess_agent.py:play           # a function, called once per episode
    agent_command: [python, examples/agents/guess_agent.py]   # a program: the row on stdin, the reward printed last

and by hand against any server: `echo '{"prompt": [{"role": "user", "content": "guess a number from 1 to 16. reply
with one number; i say higher or lower.\\n"}], "answer": "11"}' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1
OPENAI_API_KEY=... python examples/agents/guess_agent.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import weakref

from openai import AsyncOpenAI

MAX_GUESSES = 5  # binary search over 1..16 needs at most 5
DISCOUNT = 0.9
LOW, HIGH = 1, 16
MAX_TOKENS = 8  # a guess is a number and the end-of-turn token
# One client (one connection pool) per event loop and server, shared by the episodes: a new AsyncOpenAI costs ~20 ms of
# CPU (it loads the TLS certificates), more than the calls of a short game. Each episode sends its own key.
_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client_for(base_url: str, api_key: str) -> AsyncOpenAI:
    """A client for `base_url` sending `api_key`, sharing the running loop's connection pool to that server."""
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    if base_url not in clients:
        clients[base_url] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return clients[base_url].with_options(api_key=api_key)


def reply_to(secret: int, text: str) -> tuple[str, bool]:
    """The game's answer to a guess: ("correct", True), ("higher" | "lower", False), or the rules (no number)."""
    match = re.search(r"-?\d+", text)
    if match is None:
        return f"reply with one number from {LOW} to {HIGH}", False
    guess = int(match.group())
    if guess == secret:
        return "correct", True
    return ("higher" if guess < secret else "lower"), False


async def play(row: dict, base_url: str, api_key: str) -> float:
    """Play one game on the row's prompt against `base_url`; returns the reward (0.0 when not solved)."""
    secret = int(row["answer"])
    messages = list(row["prompt"])
    client = client_for(base_url, api_key)
    model = (await client.models.list()).data[0].id
    for guess in range(1, MAX_GUESSES + 1):
        response = await client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS)
        text = response.choices[0].message.content or ""
        reply, solved = reply_to(secret, text)
        if solved:
            return DISCOUNT ** (guess - 1)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": reply}]
    return 0.0


if __name__ == "__main__":
    row = json.loads(sys.stdin.readline())
    reward = asyncio.run(play(row, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
    print(json.dumps(reward))
