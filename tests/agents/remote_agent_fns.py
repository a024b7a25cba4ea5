"""An agent function the reward service runs in tests/agents/test_remote.py, chosen per episode by the row's `mode`:

answer   asks the endpoint once with the real `openai` client: reward 1.0 when the reply is the row's answer, else 0
sleep    sleeps row["sleep_s"] seconds; when cancelled, writes the file row["marker"] first (so a test sees it)
raise    raises RuntimeError
env      returns 1.0 when the reward service's token is in its environment, else 0.0
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import openai


async def agent(row, base_url, api_key):
    mode = row.get("mode", "answer")
    if mode == "sleep":
        try:
            await asyncio.sleep(float(row["sleep_s"]))
        except asyncio.CancelledError:
            pathlib.Path(row["marker"]).write_text("cancelled")
            raise
        return 1.0
    if mode == "raise":
        raise RuntimeError(f"agent bug on {row['answer']!r}")
    if mode == "env":
        return float("ASYNC_GRPO_REWARD_TOKEN" in os.environ)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
    return 1.0 if (reply.choices[0].message.content or "").strip() == row["answer"] else 0.0
