"""Coalescing the teacher's requests: the groups that finish generating close together share one `/completions` call.

The orchestrator asks the teacher about each group as soon as it is generated (`distillation.rollout`), and groups
finish in bursts (vLLM generates them batched). One HTTP request per group costs the teacher's server a fixed share of
work per request (parsing, scheduling, building the answer) on top of the scoring itself. Measured on vLLM 0.32 CPU
with the tiny teacher of examples/distill_cpu.yaml (26-token sequences, one request at a time, median of 6):

| prompts per request | prompt_logprobs | milliseconds per request | per prompt |
| --- | --- | --- | --- |
| 8 (one group) | 0 | 51 | 6.4 |
| 128 (16 groups) | 0 | 207 | 1.6 |
| 8 (one group) | 20 | 75 | 9.4 |
| 128 (16 groups) | 20 | 808 | 6.3 |

So `PromptBatcher` holds each caller's prompts for at most `wait_s` seconds (`teacher_batch_wait_s`), or until
`max_prompts` are waiting, and sends everything waiting as one request; each caller gets back the choices of its own
prompts, re-indexed from 0, exactly as if it had sent them alone. The requests of one batch succeed or fail together:
a failed request fails (and so drops and counts) every group in it. vLLM batches concurrent requests in its engine
either way, so on an accelerator the saving is the per-request share only; `teacher_batch_wait_s: 0` turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_BATCH_PROMPTS", "PromptBatcher", "split_choices"]

MAX_BATCH_PROMPTS = 256  # prompts at most in one coalesced request (a caller with more sends them alone, at once)


@dataclass
class _Waiting:
    """One caller's prompts and the future its answer (or error) goes to."""

    prompts: list[list[int]]
    future: asyncio.Future


class PromptBatcher:
    """Coalesces the `/completions` prompts of concurrent callers into one request (module docstring). Use it on one
    event loop and `aclose` it there.

    Args:
        send: sends one request for a list of token-id prompts and returns the decoded answer (``{"choices": [...]}``,
            one choice per prompt with its ``index``); it raises what the caller should see (e.g. `TeacherError`).
        wait_s: the longest a caller's prompts wait for others (seconds, >= 0; 0: every call is sent at once, alone).
        max_prompts: a batch is sent as soon as this many prompts wait (>= 1).

    Raises:
        ValueError: `wait_s` < 0 or `max_prompts` < 1.
    """

    def __init__(self, send: Callable[[list[list[int]]], Awaitable[Any]], *, wait_s: float, max_prompts: int):
        if not wait_s >= 0 or max_prompts < 1:
            raise ValueError(
                f"PromptBatcher: wait_s={wait_s} must be >= 0 and max_prompts={max_prompts} >= 1. Fix: set "
                "teacher_batch_wait_s >= 0."
            )
        self._send = send
        self.wait_s = float(wait_s)
        self.max_prompts = int(max_prompts)
        self._waiting: list[_Waiting] = []
        self._timer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.requests_sent = 0  # coalesced requests sent so far (a measure of the saving; tests)

    @property
    def tasks_alive(self) -> int:
        """Window timers and requests of this batcher still running (0 after `aclose`)."""
        return sum(not task.done() for task in self._tasks)

    async def submit(self, prompts: Sequence[Sequence[int]]) -> dict:
        """The answer for `prompts`: ``{"choices": [...]}`` with one choice per prompt, indices 0..len-1 in the order
        of `prompts`, from a request shared with the other callers of the same `wait_s` window.

        Raises:
            whatever `send` raises for the shared request; ValueError: its answer does not hold one indexed choice per
                prompt (`split_choices`); asyncio.CancelledError: `aclose` was called while waiting.
        """
        own = [list(p) for p in prompts]
        if self.wait_s == 0:
            self.requests_sent += 1
            return split_choices(await self._send(own), [len(own)])[0]
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(own, future))
        if sum(len(w.prompts) for w in self._waiting) >= self.max_prompts:
            self._flush()
        elif self._timer is None:
            self._timer = self._spawn(self._flush_after())
        return await future

    async def aclose(self) -> None:
        """Cancel the window timer and every request in flight (their callers see CancelledError) and wait for them."""
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            w.future.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._timer = None

    async def _flush_after(self) -> None:
        await asyncio.sleep(self.wait_s)
        self._timer = None
        self._flush()

    def _flush(self) -> None:
        """Send everything waiting (callers that gave up, e.g. were cancelled, are left out) as one request."""
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None
        batch = [w for w in self._waiting if not w.future.done()]
        self._waiting = []
        if batch:
            self._spawn(self._run(batch))

    async def _run(self, batch: list[_Waiting]) -> None:
        """One request for `batch`; each caller's future gets its share of the answer, or the request's error."""
        self.requests_sent += 1
        try:
            answer = await self._send([p for w in batch for p in w.prompts])
            parts = split_choices(answer, [len(w.prompts) for w in batch])
        except asyncio.CancelledError:
            for w in batch:
                w.future.cancel()
            raise
        except Exception as err:  # every caller of the batch sees the request's own error
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(err)
            return
        for w, part in zip(batch, parts, strict=True):
            if not w.future.done():
                w.future.set_result(part)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def split_choices(answer: Any, sizes: Sequence[int]) -> list[dict]:
    """`answer`'s choices, ordered by ``index``, cut into consecutive parts of `sizes`, each re-indexed from 0 as
    ``{"choices": [...]}`` (the answer each caller would have had for its own prompts alone).

    Raises:
        ValueError: `answer` has no list of choices, or its indices are not exactly 0..sum(sizes)-1.
    """
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"no indexed choices in {str(answer)[:200]}") from err
    total = sum(sizes)
    if [c["index"] for c in choices] != list(range(total)):
        raise ValueError(f"choice indices {[c['index'] for c in choices][:20]} for {total} prompts")
    parts, start = [], 0
    for size in sizes:
        parts.append({"choices": [{**c, "index": j} for j, c in enumerate(choices[start : start + size])]})
        start += size
    return parts
