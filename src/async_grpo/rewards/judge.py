"""An LLM judge as a reward function (`builtin:llm_judge`): a served instruct model reads the prompt, the completion
and a rubric, and answers with a score.

The judge is any OpenAI-compatible chat endpoint (`judge_url`: a vLLM server, locally or as a Deployment beside
the policy's), reached through the `openai` client, which retries connection errors, timeouts and 5xx answers
`judge_max_retries` times with backoff. Each completion is one chat request (the rubric with `{prompt}` and
`{completion}` filled in), sent concurrently, up to `judge_max_concurrency` at a time per reward worker. The answer's
last `Score: <number>` is the score, divided by `judge_max_score` (so a reward in [0, 1]); an answer with no score,
or one outside [0, judge_max_score], is a parse failure: that completion's reward is None (left out of the
advantage, as TRL does for a function that does not apply), counted, never fatal. With `judge_guided_score`, vLLM's
structured outputs constrain the answer to the score format (`structured_outputs.regex`), so there are no parse
failures (vLLM servers only).

Answers are cached per reward worker, keyed by (judge model, rubric, prompt, completion, sampling): a completion
that recurs (the same answer to the same prompt, common once a policy converges) is not judged again. With a
temperature above 0 the cache keeps the first sampled verdict.

A judge that cannot be reached after its retries raises, and the run's reward-failure rules apply as for any
reward function that fails (the group is dropped and counted; `reward_failure_timeout_s` ends a run whose every
group fails). Per group it logs (`log_metric`, averaged over the step): `judge/seconds` (mean wall seconds of the
requests sent), `judge/parse_failures` (answers with no usable score, per completion), `judge/cache_hits` (per
completion) and `judge/requests` (requests sent per completion).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from async_grpo.config.sections.rewards import DEFAULT_JUDGE_RUBRIC, MAX_GUIDED_JUDGE_SCORE

API_KEY_ENV = "ASYNC_GRPO_JUDGE_API_KEY"  # the judge server's bearer token, when it needs one
DEFAULT_RUBRIC = DEFAULT_JUDGE_RUBRIC
SCORE_PATTERN = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
MAX_GUIDED_SCORE = MAX_GUIDED_JUDGE_SCORE


class JudgeUnavailable(RuntimeError):
    """The judge did not answer a request after its retries (connection error, timeout, or an error status)."""


_cache: OrderedDict[str, str] = OrderedDict()  # key -> the judge's answer text, least recently used first
_cache_lock = threading.Lock()
_clients: dict[tuple[str, float, int], Any] = {}


def text_of(message: Any) -> str:
    """The text of a prompt or completion as reward functions get it: a string, or conversational messages (the
    last message's content for a completion, every message as `role: content` lines for a prompt)."""
    if isinstance(message, str):
        return message
    if isinstance(message, Sequence) and message and all(isinstance(m, dict) for m in message):
        if len(message) == 1:
            return str(message[0].get("content", ""))
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in message)
    return str(message)


def parse_score(answer: str, max_score: float) -> float | None:
    """The judge's score in `answer` divided by `max_score`: the last `Score: <number>` (any case, `=` or `:`,
    markdown bold allowed). None when there is none or it lies outside [0, max_score]."""
    found = SCORE_PATTERN.findall(answer or "")
    if not found:
        return None
    value = float(found[-1])
    if not 0.0 <= value <= max_score:
        return None
    return value / max_score


def guided_regex(max_score: float) -> str:
    """The answer format `judge_guided_score` forces: `Score: ` and an integer from 0 to `max_score`.

    Raises:
        ValueError: `max_score` is not an integer from 1 to MAX_GUIDED_SCORE (field `judge_max_score`).
    """
    if max_score != int(max_score) or not 1 <= max_score <= MAX_GUIDED_SCORE:
        raise ValueError(
            f"judge_max_score={max_score:g} with judge_guided_score: the scale must be whole numbers from 0 to at "
            f"most {MAX_GUIDED_SCORE}. Fix: set judge_max_score to an integer, or judge_guided_score: false."
        )
    return "Score: (" + "|".join(str(v) for v in range(int(max_score), -1, -1)) + ")"


_RUBRIC_PLACEHOLDER = re.compile(r"\{(prompt|completion)\}")


def render_rubric(rubric: str, prompt: str, completion: str) -> str:
    """The rubric with `{prompt}` and `{completion}` replaced in one pass over the rubric: braces elsewhere in the
    rubric are kept, and the inserted texts are never searched again (a prompt holding "{completion}" stays as
    written; two chained replacements would put the completion inside it)."""
    texts = {"prompt": prompt, "completion": completion}
    return _RUBRIC_PLACEHOLDER.sub(lambda match: texts[match.group(1)], rubric)


def check_rubric(rubric: str) -> None:
    """Raises ValueError unless the rubric holds both `{prompt}` and `{completion}` (field `judge_rubric`)."""
    missing = [p for p in ("{prompt}", "{completion}") if p not in rubric]
    if missing:
        raise ValueError(f"judge_rubric has no {' or '.join(missing)}. Fix: put both placeholders in the rubric.")


def _client(url: str, timeout_s: float, max_retries: int) -> Any:
    """One `openai.OpenAI` client per (url, timeout, retries) in this process (its connection pool is reused)."""
    key = (url, timeout_s, max_retries)
    if key not in _clients:
        import openai

        _clients[key] = openai.OpenAI(
            base_url=url,
            api_key=os.environ.get(API_KEY_ENV) or "EMPTY",
            timeout=timeout_s,
            max_retries=max_retries,
        )
    return _clients[key]


def _cache_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _cached(key: str) -> str | None:
    with _cache_lock:
        answer = _cache.get(key)
        if answer is not None:
            _cache.move_to_end(key)
        return answer


def _remember(key: str, answer: str, size: int) -> None:
    with _cache_lock:
        _cache[key] = answer
        _cache.move_to_end(key)
        while len(_cache) > size:
            _cache.popitem(last=False)


def clear_cache() -> None:
    """Forget every cached answer of this process."""
    with _cache_lock:
        _cache.clear()


def llm_judge(
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    *,
    judge_url: str,
    judge_model: str | None = None,
    judge_rubric: str = DEFAULT_RUBRIC,
    judge_max_score: float = 10.0,
    judge_max_tokens: int = 32,
    judge_temperature: float = 0.0,
    judge_max_retries: int = 2,
    judge_timeout_s: float = 60.0,
    judge_max_concurrency: int = 16,
    judge_cache_size: int = 10_000,
    judge_guided_score: bool = False,
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Score each completion with the judge at `judge_url` (module docstring). The run binds the `judge_*`
    arguments from its config (`contract.bound_kwargs`).

    Args:
        prompts, completions: one per completion (strings, or conversational messages).
        judge_url: OpenAI-compatible base URL, e.g. http://judge:8000/v1.
        judge_model: served model id; None: the server's first model (`GET /models`).

    Returns:
        One reward in [0, 1] per completion, or None where the answer held no usable score.

    Raises:
        JudgeUnavailable: the judge could not answer after `judge_max_retries` retries (connection error, timeout,
            error status; the openai error chained).
        ValueError: a rubric without both placeholders.
    """
    import openai

    if not judge_url or not judge_url.startswith(("http://", "https://")):
        raise ValueError(
            f"judge_url={judge_url!r} is not an http(s) URL. Fix: set judge_url, e.g. http://judge:8000/v1."
        )
    check_rubric(judge_rubric)
    client = _client(judge_url, judge_timeout_s, judge_max_retries)
    try:
        model = judge_model or client.models.list().data[0].id
    except openai.APIError as err:
        raise JudgeUnavailable(
            f"the LLM judge at {judge_url} did not list its models: {type(err).__name__}: {err}. Fix: check the "
            "judge server and judge_url, or set judge_model"
        ) from err
    sampling = {"max_tokens": judge_max_tokens, "temperature": judge_temperature}
    extra = {"structured_outputs": {"regex": guided_regex(judge_max_score)}} if judge_guided_score else None
    texts = [(text_of(p), text_of(c)) for p, c in zip(prompts, completions, strict=True)]
    keys = [_cache_key(model, judge_rubric, p, c, sampling, judge_guided_score) for p, c in texts]
    answers: list[str | None] = [_cached(k) for k in keys]
    todo = [i for i, a in enumerate(answers) if a is None]
    seconds: list[float] = []

    def ask(i: int) -> str:
        t0 = time.perf_counter()
        try:
            response = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": render_rubric(judge_rubric, *texts[i])}],
                extra_body=extra,
                **sampling,
            )
        except openai.APIError as err:
            raise JudgeUnavailable(
                f"the LLM judge at {judge_url} did not answer after {judge_max_retries} retries: "
                f"{type(err).__name__}: {err}. Fix: check the judge server and judge_url, or raise judge_timeout_s "
                "or judge_max_retries"
            ) from err
        seconds.append(time.perf_counter() - t0)
        return response.choices[0].message.content or ""

    if todo:
        with ThreadPoolExecutor(max_workers=min(judge_max_concurrency, len(todo))) as pool:
            for i, answer in zip(todo, pool.map(ask, todo), strict=True):
                answers[i] = answer
                _remember(keys[i], answer, judge_cache_size)
    scores = [parse_score(a or "", judge_max_score) for a in answers]
    if log_metric is not None and scores:
        n = len(scores)
        log_metric("judge/parse_failures", sum(s is None for s in scores) / n)
        log_metric("judge/cache_hits", (n - len(todo)) / n)
        log_metric("judge/requests", len(todo) / n)
        if seconds:
            log_metric("judge/seconds", sum(seconds) / len(seconds))
    return scores
