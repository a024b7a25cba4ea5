"""Coalesce concurrent generation requests into one multi-prompt `/v1/completions` call.

The orchestrator keeps `max_inflight_groups` groups in flight, one request per group, and the groups of a step
finish (and are refilled) together. Sent one by one, vLLM's API server parses, fans out and answers each request on
its own and the engine starts the first requests before the last arrive, so one step's rollouts took several
partly filled engine batches. `/v1/completions` takes a list of prompts with one set of sampling parameters (what
TRL's `vllm-serve` client does with a whole batch), so requests that arrive within a short window and share their
sampling parameters are sent as one call. Measured on 2 cores (`benchmarks/coalescing.py`: the demo's warm-started
tiny model, 16 prompts x n=8, up to 12 tokens, the modes alternated over 20 reps, two runs): 226 / 238 ms per step
alone, 173 / 175 ms coalesced (0.77x / 0.73x); with 128-token completions (8 prompts x 8) 1.39 s against 1.47 s, no
gain. The cost: a shared call answers when its slowest prompt is done, so with long, uneven completions the groups
that finish early wait for it.

A request keeps its own answer and its own failure: a batch that vLLM refuses (HTTP 4xx, e.g. one prompt longer
than the server's context) is split and each prompt retried alone, so one bad prompt fails only its own group. A
transport error or a timeout reaches every request of the batch (the server is gone or stuck for all of them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

# Sends one multi-prompt request: (prompts, sampling parameters) -> one answer per prompt, in order (for
# `AsyncVLLMClient`, each answer is the prompt's list of `Completion`s).
SendBatch = Callable[[list[list[int]], dict[str, Any]], Awaitable[list[Any]]]


@dataclass
class _Pending:
    """Requests with the same sampling parameters waiting for their window to close."""

    params: dict[str, Any]
    prompts: list[list[int]] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    seqs: int = 0
    timer: asyncio.TimerHandle | None = None


class RequestCoalescer:
    """Collects `submit` calls for `window_s` seconds and sends those with equal sampling parameters together.

    Build it inside the event loop that uses it (it keeps timers and tasks of that loop).

    Args:
        send_batch: sends one multi-prompt request (see `SendBatch`) and returns exactly one answer per prompt;
            raises `rejected` when the server refused the request as a whole (HTTP 4xx), any other exception for a
            failure of the transport or the server.
        window_s: seconds the first request of a batch waits for others (> 0).
        max_seqs: a batch is sent at once when its requests ask for this many sequences together (>= 1; each
            request says how many it asks for, its `n`): vLLM's `--max-num-seqs` (the CPU engine runs at most 128
            sequences at once), so a batch fills the engine once.
        rejected: the exception type of a refused batch, which is then retried one prompt at a time.

    Raises:
        ValueError: window_s <= 0 or max_seqs < 1.
    """

    def __init__(
        self, send_batch: SendBatch, window_s: float, max_seqs: int, rejected: type[BaseException] = ValueError
    ):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.send_batch = send_batch
        self.window_s = window_s
        self.max_seqs = max_seqs
        self.rejected = rejected
        self._pending: dict[Hashable, _Pending] = {}
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0  # calls sent (a refused batch's one-prompt retries count too)
        self.requests = 0  # requests submitted
        self.split_batches = 0  # refused batches retried one prompt at a time

    async def submit(self, prompt_ids: list[int], params: dict[str, Any], seqs: int = 1) -> Any:
        """Queue one prompt (P,) with its sampling parameters (the JSON body's fields but `prompt`) asking for
        `seqs` sequences; returns its answer once its batch is answered.

        Raises:
            `rejected`: vLLM refused this prompt (after its batch was split).
            Any exception of `send_batch` that reached the whole batch (transport error, timeout).
        """
        key = _key(params)
        future = asyncio.get_running_loop().create_future()
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = _Pending(params)
            batch.timer = asyncio.get_running_loop().call_later(self.window_s, self._flush, key)
        batch.prompts.append(prompt_ids)
        batch.futures.append(future)
        batch.seqs += seqs
        self.requests += 1
        if batch.seqs >= self.max_seqs:
            self._flush(key)
        return await future

    def _flush(self, key: Hashable) -> None:
        batch = self._pending.pop(key, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: _Pending) -> None:
        live = [i for i, f in enumerate(batch.futures) if not f.done()]  # a cancelled request is not sent
        if not live:
            return
        prompts = [batch.prompts[i] for i in live]
        futures = [batch.futures[i] for i in live]
        self.batches += 1
        try:
            answers = await self.send_batch(prompts, batch.params)
        except self.rejected as err:
            if len(prompts) == 1:
                _settle(futures[0], exc=err)
                return
            self.split_batches += 1
            alone = (_Pending(batch.params, [p], [f]) for p, f in zip(prompts, futures, strict=True))
            await asyncio.gather(*(self._send(one) for one in alone))
            return
        except BaseException as err:  # every waiting request gets the batch's failure
            for f in futures:
                _settle(f, exc=err)
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        if len(answers) != len(prompts):  # never leave a request waiting on a malformed answer
            err = ValueError(f"send_batch answered {len(answers)} of a batch of {len(prompts)} prompts")
            for f in futures:
                _settle(f, exc=err)
            return
        for f, answer in zip(futures, answers, strict=True):
            _settle(f, result=answer)

    async def aclose(self) -> None:
        """Cancel queued and in-flight batches (their requests get `asyncio.CancelledError`)."""
        for key in list(self._pending):
            batch = self._pending.pop(key)
            if batch.timer is not None:
                batch.timer.cancel()
            for f in batch.futures:
                f.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> dict[str, int]:
        """Counts since construction: requests submitted, batches sent, refused batches split."""
        return {"requests": self.requests, "batches": self.batches, "split_batches": self.split_batches}


def _key(params: dict[str, Any]) -> str:
    """Requests share a batch only with equal sampling parameters (model, n, max_tokens, seed, extra body...)."""
    return json.dumps(params, sort_keys=True, default=repr)


def _settle(future: asyncio.Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():  # the request was cancelled while its batch was in flight
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    elif exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
