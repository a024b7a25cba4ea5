"""Preflight of the on-policy distillation teacher (the `distillation` section): it must share the student's tokenizer,
and a served teacher must answer and hold a whole sequence, or the run exits 2 before any vLLM server starts.

The teacher scores the student's own token ids (prompt logprobs of prompt + completion), so the ids must mean the
same tokens on both sides: a teacher of another vocabulary would score other words, with no error anywhere.

- teacher (all targets): `teacher_model_name_or_path` is a saved model folder (config.json) or a hub id; its
  tokenizer and the student's have the same vocabulary (token -> id) and the same special tokens (bos, eos, unk and
  every other special token; a pad token alone is not compared: padding is never scored). Compared where both load here: a folder on this
  machine, a hub id in the HF cache; on a cluster a folder on the workspace volume is checked where it runs.
- teacher_url (local: where the trainer runs): the server answers `GET {teacher_url}/models` within a few seconds;
  `teacher_model`, when given, is among the models it serves; its `max_model_len` (vLLM reports it) holds the
  student's vllm_max_model_len (a prompt plus a completion; the teacher's client cuts the last token of a sequence
  that fills it, `distillation.teacher`); and its tokenizer, asked through vLLM's `/tokenize` (at the server
  root, beside /v1) on a probe text holding the student's special tokens and a spread of its vocabulary, gives the
  ids and token strings the student's gives. The bearer token, if any, is env ASYNC_GRPO_TEACHER_API_KEY. A probe is
  not the whole vocabulary: a teacher whose tokenizer only adds tokens the probe does not hold (or makes another of
  the same tokens its eos) passes; the folder check compares everything. With top-k distillation
  (`distillation_loss: forward_kl`, K = `distillation_topk`), one tiny `/completions` request (a few prompt tokens,
  ``max_tokens`` 1) must come back with ``prompt_logprobs=K``'s K entries a position: vLLM refuses a K above its
  ``--max-logprobs`` (default 20, `VLLM_DEFAULT_MAX_LOGPROBS`) with HTTP 400. A teacher the launcher serves gets
  ``--max-logprobs K`` for a K above that default (`DistillationConfig.teacher_serve_args`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from async_grpo import hub
from async_grpo.config import GRPOConfig
from async_grpo.config.sections.distillation import TEACHER_API_KEY_ENV, VLLM_DEFAULT_MAX_LOGPROBS
from async_grpo.preflight.report import Problem

MODEL_FIELD = "distillation.teacher_model_name_or_path"
URL_FIELD = "distillation.teacher_url"
TOPK_FIELD = "distillation.distillation_topk"
TOPK_PROBE_PROMPT = "3 + 4 = 7"  # the top-k request's prompt: a few tokens in any vocabulary
TEACHER_TIMEOUT_S = 5.0  # longest preflight waits for one answer of a served teacher
PROBE_VOCAB_SAMPLE = 256  # vocabulary entries spread over the student's ids, in the /tokenize probe
PROBE_TEXT = "The teacher scores every token: 3 + 4 = 7.\n\tÉtoile, naïve, 東京 🙂  done."
SHOWN = 3  # differing tokens quoted in a message
_SAME_TOKENIZER_FIX = (
    "use a teacher of the student's model family, saved with the student's tokenizer (token ids are compared one "
    "to one), or distill into a student that shares the teacher's tokenizer"
)


# ------------------------------------------------------------------------------------------------ tokenizers
def student_tokenizer(config: GRPOConfig, local: bool) -> Any | None:
    """The student's tokenizer when it is at hand here: builtin:tiny, a local model folder (`inputs.load_tokenizer`),
    or a hub id whose snapshot is in the HF cache (nothing is fetched); else None."""
    from async_grpo.preflight.inputs import load_tokenizer

    tokenizer = load_tokenizer(config, local)
    if tokenizer is not None or not hub.looks_like_repo_id(config.model_name_or_path):
        return tokenizer
    folder = _cached_folder(config.model_name_or_path)
    if folder is None or (config.trust_remote_code and not local):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=config.trust_remote_code)


def _cached_folder(repo_id: str) -> Path | None:
    from async_grpo.preflight.reward_models import _cached_folder as cached

    return cached(repo_id)


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens of `tokenizer`: its bos, eos and unk tokens, and the sorted list of all its special tokens."""
    roles = {role: getattr(tokenizer, f"{role}_token", None) for role in ("bos", "eos", "unk")}
    return {**roles, "special tokens": sorted(set(tokenizer.all_special_tokens))}


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why `teacher` is not `student`'s tokenizer (one sentence quoting a few differing tokens), or None when their
    vocabularies (token -> id, added tokens included) and special tokens (`special_tokens`) are the same. A pad token
    alone is not compared: padding is masked, never scored (a pad that is also eos counts as eos)."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differing = sorted(
            (t for t in student_vocab.keys() | teacher_vocab.keys() if student_vocab.get(t) != teacher_vocab.get(t)),
            key=lambda t: (min(i for i in (student_vocab.get(t), teacher_vocab.get(t)) if i is not None), t),
        )
        shown = ", ".join(
            f"{token!r} is {student_vocab.get(token, 'absent')} in the student's and "
            f"{teacher_vocab.get(token, 'absent')} in the teacher's"
            for token in differing[:SHOWN]
        )
        return (
            f"the teacher's vocabulary differs from the student's ({len(teacher_vocab)} against {len(student_vocab)} "
            f"tokens, {len(differing)} differing: {shown})"
        )
    ours, theirs = special_tokens(student), special_tokens(teacher)
    shown = [
        f"{role}: {ours[role]!r} in the student's, {theirs[role]!r} in the teacher's"
        for role in ("bos", "eos", "unk")
        if ours[role] != theirs[role]
    ]
    pads = {student.pad_token, teacher.pad_token}
    odd = sorted((set(ours["special tokens"]) ^ set(theirs["special tokens"])) - pads)
    if odd:
        shown.append(
            f"special tokens: {ours['special tokens']} in the student's, {theirs['special tokens']} in the teacher's"
        )
    if shown:
        return f"the teacher's special tokens differ from the student's ({'; '.join(shown)})"
    return None


def check_teacher_model(config: GRPOConfig, local: bool) -> tuple[list[Problem], list[str]]:
    """`teacher_model_name_or_path` (module docstring): a saved model folder or a hub id, whose tokenizer is the
    student's. Returns (problems, skip notes)."""
    name = config.distillation.teacher_model_name_or_path
    if name is None:
        return [], []
    if name.startswith(("builtin:", "models:/")):
        return [
            Problem(
                MODEL_FIELD,
                f"{name!r} names no model folder: the teacher is served by vLLM, which loads a saved Hugging Face "
                "model",
                "save the teacher (save_pretrained, with its tokenizer) and give its folder, or a hub id (org/name)",
            )
        ], []
    if hub.looks_like_repo_id(name):
        folder = _cached_folder(name)
        if folder is None:
            return [], [f"teacher: {name!r} is a hub id not in the HF cache; its tokenizer is compared at launch"]
    else:
        folder = Path(name).expanduser()
        if not local and not folder.exists():
            return [], [f"teacher: {name!r} is not on this machine; it is checked where it runs"]
        if not (folder / "config.json").is_file():
            what = "does not exist" if not folder.exists() else "is not a Hugging Face model folder (no config.json)"
            return [
                Problem(
                    MODEL_FIELD,
                    f"{name!r} {what}",
                    "point it at a folder saved with save_pretrained (model and tokenizer), or give a hub id",
                )
            ], []
    student = student_tokenizer(config, local)
    if student is None:
        return [], ["teacher: the student's tokenizer is not available here; the tokenizers are compared at launch"]
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(folder, trust_remote_code=config.trust_remote_code and local)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a missing/broken tokenizer
        return [
            Problem(
                MODEL_FIELD,
                f"the teacher's tokenizer does not load from {str(folder)!r} ({type(err).__name__}: {str(err)[:200]})",
                "save the tokenizer into the teacher's folder (tokenizer.save_pretrained)",
            )
        ], []
    why = tokenizer_mismatch(student, teacher)
    if why:
        return [Problem(MODEL_FIELD, f"{name!r}: {why}", _SAME_TOKENIZER_FIX)], []
    return [], []


# ------------------------------------------------------------------------------------------------ a served teacher
def server_root(teacher_url: str) -> str:
    """The server's root URL, where vLLM answers /tokenize and /health: `teacher_url` without its trailing /v1."""
    url = teacher_url.rstrip("/")
    return url.removesuffix("/v1")


def auth_headers() -> dict[str, str]:
    """The teacher's bearer token (env ASYNC_GRPO_TEACHER_API_KEY) as an Authorization header; {} without one."""
    token = os.environ.get(TEACHER_API_KEY_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def probe_text(tokenizer: Any) -> str:
    """The /tokenize probe: PROBE_TEXT, each of the student's special tokens between words, and PROBE_VOCAB_SAMPLE
    vocabulary entries spread evenly over its ids (decoded one by one)."""
    size = len(tokenizer)
    step = max(1, size // PROBE_VOCAB_SAMPLE)
    sample = [tokenizer.decode([i]) for i in range(0, size, step)][:PROBE_VOCAB_SAMPLE]
    specials = " ".join(f"a{token}b" for token in tokenizer.all_special_tokens)
    return f"{PROBE_TEXT} {specials} {' '.join(sample)}"


def check_teacher_url(
    config: GRPOConfig,
    local: bool = True,
    *,
    timeout_s: float = TEACHER_TIMEOUT_S,
    client: httpx.Client | None = None,
) -> tuple[list[Problem], list[str]]:
    """A served teacher at `teacher_url` (module docstring): it answers, serves `teacher_model`, holds the student's
    longest sequence, tokenizes as the student does, and (top-k distillation) answers ``prompt_logprobs`` of
    `distillation_topk`. Every request waits at most `timeout_s` seconds.

    Args:
        client: the HTTP client to use (tests); None: a fresh one, closed on return.

    Returns:
        (problems, skip notes).
    """
    url = config.distillation.teacher_url
    if url is None:
        return [], []
    if not url.startswith(("http://", "https://")):
        return [Problem(URL_FIELD, f"{url!r} is not an http(s) URL", "give e.g. http://127.0.0.1:8002/v1")], []
    own = client is None
    client = client or httpx.Client(timeout=timeout_s, follow_redirects=False)
    try:
        return _check_served_teacher(config, local, url, client, timeout_s)
    finally:
        if own:
            client.close()


def _check_served_teacher(
    config: GRPOConfig, local: bool, url: str, client: httpx.Client, timeout_s: float
) -> tuple[list[Problem], list[str]]:
    headers = auth_headers()
    try:
        answer = client.get(f"{url.rstrip('/')}/models", headers=headers, timeout=timeout_s)
        answer.raise_for_status()
        models = [m for m in answer.json().get("data", []) if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return [
            Problem(
                URL_FIELD,
                f"the teacher at {url} did not answer GET /models within {timeout_s:g} s ({why})",
                f"start the teacher's vLLM server (its bearer token, if any, in {TEACHER_API_KEY_ENV}) or correct "
                "teacher_url; or give teacher_model_name_or_path and the launcher serves it",
            )
        ], []
    served = [str(m.get("id")) for m in models]
    wanted = config.distillation.teacher_model
    if wanted is not None and wanted not in served:
        return [
            Problem(
                "distillation.teacher_model",
                f"{wanted!r} is not served by the teacher at {url} (it serves {served})",
                "give one of the served model ids, or leave teacher_model unset for the first",
            )
        ], []
    if not served:
        return [Problem(URL_FIELD, f"the teacher at {url} serves no model", "start it with a model")], []
    model = wanted or served[0]
    card = models[served.index(model)]
    problems = []
    needed = config.inference.vllm_max_model_len
    length = card.get("max_model_len")
    if isinstance(length, int) and length < needed:
        problems.append(
            Problem(
                URL_FIELD,
                f"the teacher {model!r} at {url} holds max_model_len={length} tokens, but it scores a prompt plus a "
                f"completion of up to vllm_max_model_len={needed} tokens as one prompt",
                f"serve the teacher with --max-model-len {needed} or more, or lower vllm_max_model_len",
            )
        )
    k = config.distillation.topk
    if k:
        problem = _topk_problem(client, url, model, k, headers, timeout_s)
        problems += [problem] if problem else []
    student = student_tokenizer(config, local)
    if student is None:
        return problems, ["teacher_url: the student's tokenizer is not available here; the tokenizers are not compared"]
    problem = _tokenize_problem(client, url, model, student, headers, timeout_s)
    return problems + ([problem] if problem else []), []


def _topk_problem(
    client: httpx.Client, url: str, model: str, k: int, headers: dict[str, str], timeout_s: float
) -> Problem | None:
    """One ``/completions`` request with ``prompt_logprobs=k`` and ``max_tokens=1`` on TOPK_PROBE_PROMPT: None when
    the teacher answers it with at least `k` entries at each prompt position after the first (vLLM's top-k, plus the
    actual token's when it is not among them); a `distillation_topk` problem when it refuses the request (a k above
    its --max-logprobs), a `teacher_url` one when it does not answer or answers something else."""
    body = {"model": model, "prompt": TOPK_PROBE_PROMPT, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}
    fix = (
        f"serve the teacher with --max-logprobs {k} (or more), or lower distillation_topk to what it serves (vLLM's "
        f"default is {VLLM_DEFAULT_MAX_LOGPROBS})"
    )
    try:
        answer = client.post(f"{url.rstrip('/')}/completions", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as err:
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return Problem(
            URL_FIELD,
            f"the teacher at {url} did not answer a /completions request with prompt_logprobs={k} within "
            f"{timeout_s:g} s ({why}), which distillation_topk={k} needs",
            "check that the teacher's vLLM server is up and answers /completions",
        )
    if 400 <= answer.status_code < 500:
        return Problem(
            TOPK_FIELD,
            f"the teacher {model!r} at {url} (teacher_url) refused the top-k request of distillation_topk={k} "
            f"(POST /completions with prompt_logprobs={k}: HTTP {answer.status_code}, {answer.text[:200]})",
            fix,
        )
    try:
        answer.raise_for_status()
        entries = answer.json()["choices"][0]["prompt_logprobs"]
        widths = [len(entry) for entry in entries[1:]]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        return Problem(
            URL_FIELD,
            f"the teacher at {url} answered no prompt logprobs to a /completions request with prompt_logprobs={k} "
            f"({type(err).__name__}: {str(err)[:200]}), which distillation_topk={k} needs",
            "serve the teacher with vLLM (its /completions answers prompt_logprobs), or give "
            "teacher_model_name_or_path",
        )
    if not widths or min(widths) < k:
        return Problem(
            TOPK_FIELD,
            f"the teacher {model!r} at {url} (teacher_url) answered prompt_logprobs={k} with {widths} entries per "
            f"position, not the top {k}",
            fix,
        )
    return None


def _tokenize_problem(
    client: httpx.Client, url: str, model: str, student: Any, headers: dict[str, str], timeout_s: float
) -> Problem | None:
    """The teacher's /tokenize of `probe_text` against the student's ids and token strings (None: the same)."""
    text = probe_text(student)
    body = {"model": model, "prompt": text, "add_special_tokens": False, "return_token_strs": True}
    try:
        answer = client.post(f"{server_root(url)}/tokenize", json=body, headers=headers, timeout=timeout_s)
        answer.raise_for_status()
        reply = answer.json()
        ids = [int(i) for i in reply["tokens"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
        return Problem(
            URL_FIELD,
            f"the teacher at {url} did not tokenize the probe at {server_root(url)}/tokenize "
            f"({type(err).__name__}: {str(err)[:200]}), so its tokenizer cannot be compared with the student's",
            "serve the teacher with vLLM (which answers /tokenize beside /v1), or give teacher_model_name_or_path",
        )
    expected = student.encode(text, add_special_tokens=False)
    strings = reply.get("token_strs")
    expected_strings = student.convert_ids_to_tokens(expected)
    if ids == expected and (strings is None or list(strings) == expected_strings):
        return None
    if ids == expected:
        at = _first_difference(list(strings), expected_strings)
        theirs = strings[at] if at < len(strings) else "nothing"
        detail = f"token {expected[at]} is {expected_strings[at]!r} for the student and {theirs!r} for the teacher"
    else:
        at = _first_difference(ids, expected)
        detail = (
            f"the probe is {len(expected)} tokens for the student and {len(ids)} for the teacher; they part at token "
            f"{at} ({expected[at : at + SHOWN]} against {ids[at : at + SHOWN]})"
        )
    return Problem(
        URL_FIELD,
        f"the teacher {model!r} at {url} does not tokenize as the student does: {detail}",
        _SAME_TOKENIZER_FIX,
    )


def _first_difference(a: list, b: list) -> int:
    """The first index where `a` and `b` differ (the shorter one's length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
