"""The teacher's client: a vLLM server's prompt logprobs of the student's sampled tokens (on-policy distillation).

For one group, `TeacherClient.score` sends ONE `/completions` request whose prompts are the group's prompt followed by
each completion (token ids), with ``max_tokens=1`` and ``prompt_logprobs=0``: vLLM then returns, for every prompt
token after the first, the logprob of that very token given everything before it (a dict with the one entry of the
actual token id: ``{"<id>": {"logprob", "rank", "decoded_token"}}``; the list starts with None for the first token).
The entries at the completion's positions are the teacher's logprobs of the sampled tokens. They are the raw model's
log-softmax at temperature 1 whatever the request's temperature (measured on vLLM 0.32 CPU against Hugging Face
transformers, `tests/integration/test_teacher_server.py`), so the run samples at temperature 1 (`config.rules`).

With ``topk`` = K > 0 (`distillation_loss: forward_kl`, `DistillationConfig.topk`) the request asks
``prompt_logprobs=K`` and `TeacherClient.score_group` also returns the teacher's K most likely tokens at every
completion position (`parse_prompt_topk`). vLLM 0.32 (`Sampler.gather_logprobs`, `append_logprobs_for_next_position`)
then gives each position one dict of the top-K entries, ranks 1..K, plus the actual token's entry when it is not among
them (its rank, 1 + the number of tokens at least as likely, is then above K, ties included); the ids are the dict's
keys, as strings in JSON. Prompt positions skip vLLM's sampling processors, so these logprobs too are the raw
log-softmax over the whole vocabulary at temperature 1 (not renormalized over the K), whatever ``--logprobs-mode``
(raw_ or processed_logprobs) the server runs; vLLM writes -inf as -9999.0 (`clamp_prompt_logprobs`). vLLM refuses a
K above its ``--max-logprobs`` (default 20) with HTTP 400: the launcher serves its teacher with ``--max-logprobs K``
when K > 20 (`DistillationConfig.teacher_serve_args`), and preflight asks a `teacher_url` for K once.

vLLM refuses a prompt of ``max_model_len`` tokens or more (HTTP 400: ``max_tokens`` must be at least 1, measured on
vLLM 0.32), so a sequence that fills the teacher's whole context cannot be sent whole. The launcher serves the teacher
with the policy's ``vllm_max_model_len`` (one more would exceed the position limit of a model whose context the policy
already fills, as the tiny model's 512): the client reads the teacher's ``max_model_len`` from ``GET /models`` and
sends at most ``max_model_len - 1`` tokens of a sequence; the completion tokens cut off get NaN (no distillation
advantage, counted in `distill/teacher_tokens_unscored`). Only a sequence that fills the whole context loses its last
token.

Failures are `RewardError`s, so the orchestrator handles them as a failed reward: the group is dropped and counted
(`dropped_groups/teacher_error`, `dropped_groups/teacher_timeout`), and a teacher that fails every group for
``reward_failure_timeout_s`` stops the run. Connection errors, timeouts and 5xx answers (and 429) are retried
``teacher_max_retries`` times with a short exponential backoff; other 4xx answers and malformed bodies are not. No
`httpx` error leaves this module: the orchestrator reads a raw connection error as the *policy's* vLLM server being
lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from async_grpo.config.sections.distillation import TEACHER_API_KEY_ENV, DistillationConfig
from async_grpo.inference.client import KEEPALIVE_EXPIRY_S
from async_grpo.transports.drops import DropReason
from async_grpo.transports.scorer import RewardError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # opening a connection to the teacher (at most the request's own timeout)
BACKOFF_S = 0.5  # the first retry's wait; doubled for each later one
MAX_BACKOFF_S = 4.0  # the longest wait between two attempts
RETRIED_STATUSES = frozenset({429})  # 4xx answers that mean "later", retried as 5xx answers are
ERROR_BODY_CHARS = 500  # how much of an error answer goes into the exception's message


class TeacherError(RewardError):
    """The teacher could not score a group (reason "teacher_error"): its server answered with an error, a 4xx at once
    or a 5xx / connection error after every retry, or with a body that is not vLLM's prompt logprobs. The
    orchestrator drops the group and counts it as it does a failed reward (`transports.scorer.RewardError`)."""

    reason: ClassVar[DropReason] = "teacher_error"


class TeacherTimeout(TeacherError):
    """The teacher did not answer within ``teacher_timeout_s`` seconds, on every attempt (reason "teacher_timeout")."""

    reason: ClassVar[DropReason] = "teacher_timeout"


def teacher_url(section: DistillationConfig) -> str:
    """The `distillation` section's `teacher_url`, checked: an http(s) URL.

    Raises:
        ValueError: it is not set (a teacher the launcher serves from `teacher_model_name_or_path` gets its URL from
            the launcher before the run starts), or it is not an http(s) URL.
    """
    url = section.teacher_url
    if not url:
        raise ValueError(
            "distillation: teacher_url is not set at run time. Fix: give teacher_url (a served teacher), or start "
            "the run through the launcher (`async-grpo train`), which serves teacher_model_name_or_path and sets "
            "teacher_url to it."
        )
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"teacher_url={url!r} is not an http(s) URL. Fix: e.g. http://127.0.0.1:8002/v1.")
    return url


@dataclass
class TeacherScores:
    """What the teacher said of one group's completions (`TeacherClient.score_group`); G = completions, T_i = tokens
    of completion i, K = `TeacherClient.topk`.

    Attributes:
        logprobs: G lists, (T_i,) the teacher's logprob (nats, temperature 1) of each sampled token given everything
            before it; NaN where it gave none (`RolloutGroup.teacher_logprobs`).
        topk_ids: G lists, (T_i,) lists of K token ids: the teacher's K most likely tokens at each completion position,
            most likely first; id 0 pads a position with fewer than K entries and fills a token the teacher did not
            score (`RolloutGroup.teacher_topk_ids`). [] when K = 0.
        topk_logprobs: G lists, (T_i,) lists of K floats: the logprobs (nats, temperature 1, over the whole vocabulary)
            of `topk_ids`; NaN at every padded entry (`RolloutGroup.teacher_topk_logprobs`). [] when K = 0.
    """

    logprobs: list[list[float]]
    topk_ids: list[list[list[int]]] = field(default_factory=list)
    topk_logprobs: list[list[list[float]]] = field(default_factory=list)


class _Retryable(Exception):
    """One attempt failed in a way worth retrying; `timeout` tells a time-out from a connection error or a 5xx."""

    def __init__(self, message: str, *, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


class TeacherClient:
    """Async client of a vLLM teacher (`/completions` with ``prompt_logprobs``). Build it, use it and `aclose` it on
    one event loop (its connections and semaphore belong to that loop): `distillation.rollout.TeacherRollout` builds it
    lazily on the orchestrator's loop and closes it there.

    Args:
        base_url: the OpenAI-compatible base URL, ending in ``/v1`` (e.g. http://127.0.0.1:8002/v1); `teacher_url`.
        model: the served model id requests name; None: the server's first model (``GET {base_url}/models``, asked
            once, on the first request).
        timeout_s: the longest one request (one attempt) may take (seconds): `teacher_timeout_s`.
        max_retries: attempts after the first one, after a connection error, a time-out or a 5xx / 429 answer:
            `teacher_max_retries`.
        max_concurrency: requests in flight at once, waiting for a slot outside the time-out: `teacher_max_concurrency`.
        api_key: bearer token; None reads env ASYNC_GRPO_TEACHER_API_KEY (unset or empty: none).
        backoff_s: the wait before the first retry (seconds), doubled for each later one up to MAX_BACKOFF_S.
        topk: K, the teacher's most likely tokens `score_group` also returns at every completion position (requests
            ask ``prompt_logprobs=K``); 0: only the sampled tokens' logprobs (``prompt_logprobs=0``).
            `DistillationConfig.topk`.

    Raises:
        ValueError: `base_url` is not an http(s) URL, a bound is not positive, or `topk` is not an int >= 0.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        max_concurrency: int = 8,
        api_key: str | None = None,
        backoff_s: float = BACKOFF_S,
        topk: int = 0,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"teacher_url={base_url!r} is not an http(s) URL. Fix: e.g. http://127.0.0.1:8002/v1.")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(
                f"TeacherClient: topk={topk!r} must be an int >= 0 (0: no top-k). Fix: set distillation_topk >= 1."
            )
        if not timeout_s > 0 or max_retries < 0 or max_concurrency < 1 or backoff_s < 0:
            raise ValueError(
                f"TeacherClient: timeout_s={timeout_s} must be > 0, max_retries={max_retries} >= 0, "
                f"max_concurrency={max_concurrency} >= 1 and backoff_s={backoff_s} >= 0"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.topk = topk
        key = api_key if api_key is not None else os.environ.get(TEACHER_API_KEY_ENV, "")
        self._http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(self.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.timeout_s)),
            limits=httpx.Limits(max_connections=max_concurrency, keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )
        self._slots = asyncio.Semaphore(max_concurrency)
        self._model_lock = asyncio.Lock()
        self._card: dict | None = None  # the served model's entry of GET /models, once asked

    @classmethod
    def from_config(cls, section: DistillationConfig) -> TeacherClient:
        """The client of the `distillation` section's teacher (`teacher_url`, `teacher_model`, `teacher_timeout_s`,
        `teacher_max_retries`, `teacher_max_concurrency`, `topk`: `distillation_topk` with forward_kl, else 0; the token
        from env ASYNC_GRPO_TEACHER_API_KEY).

        Raises:
            ValueError: `teacher_url` is not set or not an http(s) URL (`teacher_url`).
        """
        return cls(
            teacher_url(section),
            model=section.teacher_model,
            timeout_s=section.teacher_timeout_s,
            max_retries=section.teacher_max_retries,
            max_concurrency=section.teacher_max_concurrency,
            topk=section.topk,
        )

    async def model_id(self) -> str:
        """The served model id requests name: `model`, or the first id of ``GET {base_url}/models`` (`model_card`).

        Raises:
            TeacherError / TeacherTimeout: the server did not list a model.
        """
        if self.model is not None:
            return self.model
        return str((await self.model_card())["id"])

    async def model_card(self) -> dict:
        """The served model's entry of ``GET {base_url}/models`` (the one whose id is `model`, else the first), asked
        once and retried as a scoring request is; vLLM's holds ``max_model_len`` (tokens). Sets `model` when it was
        None; a `model` the listing lacks gets ``{"id": model}`` (no known length).

        Raises:
            TeacherError / TeacherTimeout: the server answered no listing, or an empty one while `model` is None.
        """
        async with self._model_lock:
            if self._card is None:
                body = await self._request("GET", "/models")
                try:
                    cards = [c for c in body["data"] if isinstance(c, dict) and "id" in c]
                    if self.model is None:
                        card = cards[0]
                    else:  # a name the listing lacks (an alias): its length is unknown; the request decides
                        card = next((c for c in cards if str(c["id"]) == self.model), {"id": self.model})
                except (KeyError, TypeError, IndexError) as err:
                    raise TeacherError(
                        f"the teacher at {self.base_url} lists no model (GET /models answered {str(body)[:200]}). "
                        "Fix: check teacher_url, or set teacher_model."
                    ) from err
                self._card = card
                if self.model is None:
                    self.model = str(card["id"])
                    logger.info("teacher at %s serves %s", self.base_url, self.model)
        return self._card

    async def prompt_limit(self) -> int | None:
        """The most tokens one scored sequence may hold: the teacher's ``max_model_len - 1`` (vLLM refuses a prompt
        that leaves no room for the one generated token), or None when the server does not report max_model_len.

        Raises:
            TeacherError / TeacherTimeout: as `model_card`.
        """
        length = (await self.model_card()).get("max_model_len")
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            return None
        return length - 1

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The teacher's logprob of every completion token given everything before it: `score_group`'s `logprobs`.

        Args:
            prompt_ids: (P,) the prompt's token ids, as the student was sent them.
            completion_ids: G lists, (T_i,) the sampled token ids of each completion.

        Returns:
            G lists of T_i floats (nats, temperature 1; NaN where none): `TeacherScores.logprobs`.

        Raises:
            TeacherError / TeacherTimeout: as `score_group`.
        """
        return (await self.score_group(prompt_ids, completion_ids)).logprobs

    async def score_group(self, prompt_ids: Sequence[int], completion_ids: Sequence[Sequence[int]]) -> TeacherScores:
        """The teacher's logprob of every completion token given everything before it, and with `topk` = K > 0 its K
        most likely tokens at every completion position.

        One ``POST {base_url}/completions`` request for the whole group: prompts ``prompt_ids + completion_ids[i]``
        (cut to `prompt_limit` tokens) for each completion with a token left to score, ``max_tokens=1``,
        ``temperature=1.0``, ``prompt_logprobs=K`` (0 without top-k). One request per group: a whole step's groups in
        one request cost the teacher's server 0.91-0.96x the CPU of one request each and no less wall time (measured
        on vLLM 0.32 CPU), not worth holding a group back for.

        Args:
            prompt_ids: (P,) the prompt's token ids, as the student was sent them.
            completion_ids: G lists, (T_i,) the sampled token ids of each completion (tool tokens of a multi-turn
                episode included: the trainer masks them).

        Returns:
            `TeacherScores`: `logprobs`, G lists of T_i floats: log p_teacher(token t | prompt, tokens before t), nats
            at temperature 1; NaN where the teacher returned no finite logprob for the actual token, and for the
            tokens past the teacher's `prompt_limit` (a sequence that fills the whole context); [] for an empty
            completion. With K > 0, `topk_ids` and `topk_logprobs`, G lists of T_i lists of K (`parse_prompt_topk`):
            ids 0 and logprobs NaN for the tokens past `prompt_limit`; [] and [] with K = 0. No request is sent when
            no completion has a token to score.

        Raises:
            TeacherError: a 4xx answer (a K above the server's --max-logprobs among them), a 5xx or connection error
                after every retry, or a malformed answer.
            TeacherTimeout: no answer within teacher_timeout_s on every attempt.
        """
        k = self.topk
        limit = await self.prompt_limit() if any(len(ids) for ids in completion_ids) else None
        out = TeacherScores(
            logprobs=[[math.nan] * len(ids) for ids in completion_ids],
            topk_ids=[[[0] * k for _ in ids] for ids in completion_ids] if k else [],
            topk_logprobs=[[[math.nan] * k for _ in ids] for ids in completion_ids] if k else [],
        )
        sent: list[tuple[int, list[int]]] = []  # (completion index, the sequence sent)
        for i, ids in enumerate(completion_ids):
            sequence = (list(prompt_ids) + list(ids))[:limit]
            if len(sequence) > len(prompt_ids):
                sent.append((i, sequence))
        if not sent:
            return out
        sequences = [sequence for _, sequence in sent]
        try:
            answer = await self._post_prompts(sequences)
            if k:
                scored = parse_prompt_topk(answer, sequences, len(prompt_ids), k)
            else:
                scored = TeacherScores(parse_prompt_logprobs(answer, sequences, len(prompt_ids)))
        except ValueError as err:
            raise TeacherError(f"the teacher at {self.base_url} answered a malformed body: {err}") from err
        for b, (i, _) in enumerate(sent):
            n = len(scored.logprobs[b])
            out.logprobs[i][:n] = scored.logprobs[b]
            if k:
                out.topk_ids[i][:n] = scored.topk_ids[b]
                out.topk_logprobs[i][:n] = scored.topk_logprobs[b]
        return out

    async def _post_prompts(self, prompts: list[list[int]]) -> Any:
        """One ``/completions`` request (with retries) scoring `prompts` (token ids): the decoded answer.

        Raises:
            TeacherError / TeacherTimeout: as `_request`.
        """
        body = {
            "model": await self.model_id(),
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": self.topk,
        }
        return await self._request("POST", "/completions", body)

    async def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request with retries: the decoded JSON answer of the first attempt that got a 200.

        Raises:
            TeacherError: a 4xx answer (429 aside), a non-JSON 200 answer, another `httpx` error, or retryable
                failures on every attempt; TeacherTimeout when the last attempt timed out.
        """
        url = self.base_url + path
        attempts = self.max_retries + 1
        last: _Retryable | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                return await self._attempt(method, url, body)
            except _Retryable as err:
                last = err
                logger.debug(
                    "teacher request %s %s failed (attempt %d of %d): %s", method, url, attempt + 1, attempts, err
                )
        assert last is not None
        error = TeacherTimeout if last.timeout else TeacherError
        raise error(
            f"the teacher at {url} failed {attempts} time(s) (teacher_max_retries={self.max_retries}); last: {last}. "
            "Fix: check that the teacher's vLLM server is up (teacher_url), or raise teacher_timeout_s / "
            "teacher_max_retries."
        )

    async def _attempt(self, method: str, url: str, body: dict | None) -> Any:
        """One attempt, holding one of the `max_concurrency` slots, bounded by `timeout_s` (the wait for a slot is not).

        Raises:
            _Retryable: a time-out, a connection (transport) error, or a 5xx / 429 answer.
            TeacherError: any other non-200 answer, a 200 answer that is not JSON, another `httpx` error.
        """
        async with self._slots:
            try:
                resp = await asyncio.wait_for(self._http.request(method, url, json=body), self.timeout_s)
            except (TimeoutError, httpx.TimeoutException) as err:
                raise _Retryable(
                    f"no answer within teacher_timeout_s={self.timeout_s:g} s ({err!r})", timeout=True
                ) from err
            except httpx.TransportError as err:
                raise _Retryable(f"{type(err).__name__}: {err}") from err
            except httpx.HTTPError as err:
                raise TeacherError(f"the teacher request {method} {url} failed: {err!r}") from err
        if resp.status_code >= 500 or resp.status_code in RETRIED_STATUSES:
            raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:ERROR_BODY_CHARS]}")
        if resp.status_code != 200:
            raise TeacherError(
                f"the teacher at {url} refused the request with HTTP {resp.status_code}: "
                f"{resp.text[:ERROR_BODY_CHARS]}. Fix: a prompt + completion must be shorter than the teacher's "
                "max_model_len, and teacher_model must be a model it serves."
            )
        try:
            return resp.json()
        except ValueError as err:
            raise TeacherError(f"the teacher at {url} answered a body that is not JSON: {resp.text[:200]!r}") from err

    async def aclose(self) -> None:
        """Close the connection pool (on the loop the client was used on)."""
        await self._http.aclose()


def parse_prompt_logprobs(answer: Any, sequences: Sequence[Sequence[int]], prompt_len: int) -> list[list[float]]:
    """The logprobs of each sequence's tokens from position `prompt_len` on, out of a vLLM `/completions` answer with
    ``prompt_logprobs`` (the request's prompts were `sequences`, in order).

    Args:
        answer: the decoded JSON: ``{"choices": [{"index": i, "prompt_logprobs": [None, {"<token id>": {"logprob":
            float, ...}}, ...]}, ...]}``, one choice per prompt (max_tokens=1, n=1), in any order.
        sequences: B token-id prompts, each (P + T_b,): the group's prompt then completion b.
        prompt_len: P, the group prompt's length: the completion's first token is at position P.

    Returns:
        B lists, (T_b,) each: the logprob (nats) the teacher gave the actual token at positions P..P+T_b-1; NaN where
        its entry holds no finite logprob for that token id (vLLM returns only the actual token's with
        prompt_logprobs=0; a top-k entry holds others too, `parse_prompt_topk`).

    Raises:
        ValueError: not B choices, indices that are not 0..B-1, or a choice whose `prompt_logprobs` is not a list of
            one entry per prompt token.
    """
    out = []
    for entries, seq in zip(_prompt_logprob_entries(answer, sequences), sequences, strict=True):
        out.append([_token_logprob(entries[p], seq[p]) for p in range(prompt_len, len(seq))])
    return out


def parse_prompt_topk(answer: Any, sequences: Sequence[Sequence[int]], prompt_len: int, k: int) -> TeacherScores:
    """The teacher's logprob of each sequence's tokens from position `prompt_len` on and its `k` most likely tokens at
    each of those positions, out of a vLLM `/completions` answer with ``prompt_logprobs=k`` (the request's prompts
    were `sequences`, in order).

    vLLM 0.32 gives each position (after the first, which is None) one dict ``{"<token id>": {"logprob": float,
    "rank": int, "decoded_token": str}}`` holding the top-k entries (ranks 1..k) and, when the actual token is not
    among them, the actual token's entry (rank > k). Per position: the entries of an int rank 1..k, ordered by rank
    (when any entry's rank is missing or not an int >= 1: every entry, ordered by logprob, most likely first), at most
    k of them; a logprob that is missing or not finite becomes NaN; a position with fewer than k such entries is
    padded with id 0 and logprob NaN, and a position without a dict (None) is all padding.

    Args:
        answer: the decoded JSON, as `parse_prompt_logprobs` reads it.
        sequences: B token-id prompts, each (P + T_b,): the group's prompt then completion b.
        prompt_len: P, the group prompt's length: the completion's first token is at position P.
        k: K >= 1, the number of top tokens each position keeps (the request's prompt_logprobs).

    Returns:
        `TeacherScores` of B rows: `logprobs` (T_b,) the actual token's logprob from the same position's dict (NaN
        where it holds none finite), `topk_ids` and `topk_logprobs` (T_b,) lists of k each (ids by rank, logprobs in
        nats at temperature 1 over the whole vocabulary).

    Raises:
        ValueError: `k` < 1; the choices are malformed as `parse_prompt_logprobs` says; or a position's dict holds a
            key that is not a token id (an int >= 0) or a value that is neither a logprob entry (a dict) nor a number.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"parse_prompt_topk: k={k!r} must be an int >= 1")
    out = TeacherScores(logprobs=[], topk_ids=[], topk_logprobs=[])
    for b, (entries, seq) in enumerate(zip(_prompt_logprob_entries(answer, sequences), sequences, strict=True)):
        logprobs, ids, values = [], [], []
        for p in range(prompt_len, len(seq)):
            logprobs.append(_token_logprob(entries[p], seq[p]))
            try:
                top_ids, top_values = _topk_entries(entries[p], k)
            except ValueError as err:
                raise ValueError(f"choice {b}, prompt position {p}: {err}") from err
            ids.append(top_ids)
            values.append(top_values)
        out.logprobs.append(logprobs)
        out.topk_ids.append(ids)
        out.topk_logprobs.append(values)
    return out


def _prompt_logprob_entries(answer: Any, sequences: Sequence[Sequence[int]]) -> list[list[Any]]:
    """The `prompt_logprobs` list of each choice of `answer`, in the order of `sequences` (one entry per token).

    Raises:
        ValueError: not one choice per sequence, indices that are not 0..B-1, or a choice whose `prompt_logprobs` is
            not a list of one entry per prompt token.
    """
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"no indexed choices in {str(answer)[:200]}") from err
    if [c["index"] for c in choices] != list(range(len(sequences))):
        raise ValueError(f"choice indices {[c['index'] for c in choices]} for {len(sequences)} prompts")
    out = []
    for choice, seq in zip(choices, sequences, strict=True):
        entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
        if not isinstance(entries, list) or len(entries) != len(seq):
            got = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise ValueError(
                f"choice {choice['index']}: prompt_logprobs has {got} entries for {len(seq)} prompt tokens"
            )
        out.append(entries)
    return out


def _topk_entries(entry: Any, k: int) -> tuple[list[int], list[float]]:
    """The `k` most likely (id, logprob) of one position's ``{"<id>": {"logprob", "rank", ...}}``, as two lists of
    `k` (`parse_prompt_topk` says which and in what order), padded with 0 / NaN.

    Raises:
        ValueError: a key that is not a token id (an int >= 0), or a value neither a dict nor a number.
    """
    ranked: list[tuple[int | None, float, int]] = []  # (rank, logprob, id), in the dict's order
    if isinstance(entry, dict):
        for key, value in entry.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                token = -1
            if isinstance(key, bool) or token < 0:
                raise ValueError(f"the key {key!r} is not a token id")
            if isinstance(value, dict):
                rank, logprob = value.get("rank"), value.get("logprob")
            elif isinstance(value, int | float) and not isinstance(value, bool):
                rank, logprob = None, value
            else:
                raise ValueError(f"token {token}'s entry {str(value)[:100]!r} is not a logprob entry")
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                rank = None
            ranked.append((rank, _finite(logprob), token))
    if all(rank is not None for rank, _, _ in ranked):
        chosen = sorted((e for e in ranked if e[0] <= k), key=lambda e: e[0])
    else:  # no usable ranks: by logprob, NaN last (a stable sort keeps the dict's order among equals)
        chosen = sorted(ranked, key=lambda e: -math.inf if math.isnan(e[1]) else e[1], reverse=True)
    chosen = chosen[:k]
    pad = k - len(chosen)
    return [token for _, _, token in chosen] + [0] * pad, [lp for _, lp, _ in chosen] + [math.nan] * pad


def _finite(value: Any) -> float:
    """`value` as a float when it is a finite number (a bool is not), else NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.nan


def _token_logprob(entry: Any, token_id: int) -> float:
    """The finite logprob `entry` (one position's ``{"<id>": {"logprob": ...}}``) gives `token_id`, else NaN."""
    if not isinstance(entry, dict):
        return math.nan
    value = entry.get(str(token_id))
    if isinstance(value, dict):
        value = value.get("logprob")
    return _finite(value)
