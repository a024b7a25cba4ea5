"""Real math tasks: GSM8K / MATH rows as prompt + answer, and the rewards that grade them.

Rows: `to_prompt_rows` turns GSM8K rows (`question`, `answer` ending in `#### 72`) and MATH rows (`problem`,
`solution` with a final `\\boxed{...}`) into TRL's prompt format: `prompt` (the question), `answer` (the final
answer alone) and `solution` (what math-verify parses as the gold: the final answer for GSM8K, the worked
solution for MATH, so TRL's own `trl.rewards.accuracy_reward` works on these rows too).

Rewards (TRL's signature; `builtin:<name>`): `math_accuracy` (math-verify equivalence of the completion's
answer with the gold, boxed or plain), `think_answer_format` (`<think>...</think><answer>...</answer>`),
`soft_overlong_penalty` (DAPO's soft overlong punishment, arXiv 2503.14476 eq. 13, with verl's penalty factor).
Completions may be strings or TRL's conversational message lists; math-verify is imported on first use, so
importing this module stays cheap.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_ANSWER = re.compile(r"^\s*<think>(?!.*<think>).*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is; a conversational completion (a list of messages, TRL's
    `[{"role": "assistant", "content": ...}]`) joined over its assistant messages' contents."""
    if isinstance(completion, str):
        return completion
    parts = [
        m.get("content") or ""
        for m in completion
        if isinstance(m, Mapping) and m.get("role", "assistant") == "assistant"
    ]
    return "".join(p if isinstance(p, str) else str(p) for p in parts)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def gsm8k_final_answer(answer: str) -> str:
    """GSM8K's reference answer ("... #### 1,234") -> "1234" (the text after the last ####, commas removed)."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def row_format(columns: Sequence[str]) -> str | None:
    """ "gsm8k" for question/answer columns, "math" for problem/solution, None otherwise (or with a prompt)."""
    cols = set(columns)
    if "prompt" in cols:
        return None
    if {"question", "answer"} <= cols:
        return "gsm8k"
    if {"problem", "solution"} <= cols:
        return "math"
    return None


def to_prompt_rows(ds: datasets.Dataset) -> datasets.Dataset:
    """GSM8K or MATH rows -> rows with `prompt`, `answer` and `solution` (the module docstring); other columns are
    kept (GSM8K's `answer` is replaced by its final answer).

    Raises:
        ValueError: the dataset has neither layout (the message lists its columns and the fix).
    """
    kind = row_format(ds.column_names)
    if kind == "gsm8k":

        def convert(row: dict) -> dict:
            final = gsm8k_final_answer(row["answer"])
            return {"prompt": row["question"], "answer": final, "solution": final}
    elif kind == "math":

        def convert(row: dict) -> dict:
            return {"prompt": row["problem"], "answer": last_boxed(row["solution"]) or "", "solution": row["solution"]}
    else:
        raise ValueError(
            f"dataset columns {ds.column_names} are neither question/answer (GSM8K) nor "
            "problem/solution (MATH). Fix: give a `prompt` column."
        )
    return ds.map(convert)


# ------------------------------------------------------------------ rewards
def _timeouts() -> tuple[int | None, int | None]:
    """math-verify's timeouts use signal.alarm, which only works in a main thread (as TRL's accuracy_reward)."""
    main = threading.current_thread() is threading.main_thread()
    return (10, 5) if main else (None, None)


def math_accuracy(
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    *,
    answer: list | None = None,
    solution: list | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold answer under math-verify, else 0.0; None (abstain,
    TRL) when the gold does not parse.

    The gold is the `answer` column (else `solution`). The completion's answer is the text inside its last
    `<answer>...</answer>` when present, else the whole text; math-verify then takes a `\\boxed{}` first, then
    LaTeX, then the last plain number or expression (Hugging Face math-verify 0.9: `parse` with LaTeX and
    expression extraction, `verify`).

    Raises:
        ValueError: neither an `answer` nor a `solution` column.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError(
            "math_accuracy needs an `answer` (or `solution`) dataset column. Fix: prepare the rows with "
            "prepare_dataset / to_prompt_rows, or add the column."
        )
    parse_s, verify_s = _timeouts()
    extract = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    rewards: list[float | None] = []
    for completion, ref in zip(completions, gold, strict=True):
        gold_parsed = parse(
            str(ref) if "$" in str(ref) or "\\" in str(ref) else f"${ref}$",
            extraction_config=extract,
            parsing_timeout=parse_s,
        )
        if not gold_parsed:
            rewards.append(None)
            continue
        text = completion_text(completion)
        tagged = _ANSWER_TAG.findall(text)
        pred = parse(tagged[-1] if tagged else text, extraction_config=extract, parsing_timeout=parse_s)
        rewards.append(float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=verify_s)))
    return rewards


def think_answer_format(
    prompts: list, completions: list, completion_ids: list | None = None, **kwargs: Any
) -> list[float]:
    """1.0 when the completion is `<think>...</think>` then `<answer>...</answer>` (one think block, whitespace
    around allowed; DeepSeek-R1's format reward), else 0.0."""
    return [1.0 if _THINK_ANSWER.match(completion_text(c)) else 0.0 for c in completions]


def soft_overlong_penalty(
    prompts: list,
    completions: list,
    completion_ids: list,
    *,
    max_completion_length: int,
    overlong_buffer_len: int,
    overlong_penalty_factor: float = 1.0,
    **kwargs: Any,
) -> list[float]:
    """DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13; verl's `overlong_buffer` with its penalty factor).

    With L = max_completion_length, B = overlong_buffer_len and |y| the completion's tokens:
    0 when |y| <= L - B; -(|y| - (L - B)) / B x overlong_penalty_factor when L - B < |y| <= L;
    -overlong_penalty_factor beyond L. The run binds the three parameters from its config.
    """
    expected = max_completion_length - overlong_buffer_len
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= expected:
            out.append(0.0)
        elif n <= max_completion_length:
            out.append(-(n - expected) / overlong_buffer_len * overlong_penalty_factor)
        else:
            out.append(-overlong_penalty_factor)
    return out


REWARD_FUNCS = {
    "math_accuracy": math_accuracy,
    "think_answer_format": think_answer_format,
    "soft_overlong_penalty": soft_overlong_penalty,
}
