"""The builtin `calc` task: multiply two three-digit numbers, with a calculator tool.

A 0.5M-parameter byte-level model cannot multiply 347*912 in its head, but it can learn to copy the operands into
a `calculator` call and copy the tool's answer back: the task needs the tool. Prompts are conversational (one
user message, the expression); the model is expected to answer with a tool call
`calculator(expression="347*912")`, read the result from the tool turn, and reply with the bare number. The
warm-start transcripts are exactly that conversation, rendered by the model's own chat template.
"""

from __future__ import annotations

import random
import string
from typing import Any

from async_grpo.tasks.base import Task, answers_from_kwargs, completion_text, shaped_match

LOW, HIGH = 100, 999
TOOLS = ("builtin:calculator",)


def sample_calc(rng: random.Random) -> tuple[str, str, str]:
    """Draw (key, prompt, answer) for a*b with a, b in 100..999; the key and the prompt are ``"a*b"``."""
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return f"{a}*{b}", f"{a}*{b}", str(a * b)


def calc_transcript(prompt: str, answer: str, rng: random.Random | None = None) -> list[dict]:
    """The reference conversation for one item (TRL's conversational form): the user's expression, an assistant
    turn calling `calculator` on it, the tool's result, and the final answer. It has no random choice, so `rng`
    (`Task.transcript`'s argument) is unused."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": prompt}}}
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def calc_exact_match(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """1.0 where the final assistant message, stripped, equals the product, else 0.0 (TRL reward signature; the
    completion is a message list or a string; needs column `answer`).

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("calc_exact_match", kwargs, len(completions))
    return [float(completion_text(c).strip() == a) for c, a in zip(completions, answers, strict=True)]


def calc_format(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """Shaped partial credit in [0, 1] on the final assistant message (`tasks.base.shaped_match` over digits):
    a guess of the right length earns some, each correct digit position more.

    Raises:
        ValueError: the `answer` column is missing or has the wrong length.
    """
    answers = answers_from_kwargs("calc_format", kwargs, len(completions))
    return [
        shaped_match(completion_text(c).strip(), a, string.digits) for c, a in zip(completions, answers, strict=True)
    ]


def calc_call_match(
    prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
) -> list[float]:
    """Credit in [0, 1] for the first calculator call: 1.0 when its `expression` is the very expression asked, else
    half the partial credit `tasks.base.shaped_match` gives it; 0 without a call (TRL signature; reads the
    conversational completion's tool calls, so it rewards copying the operands right even when the answer is wrong).
    """
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        asked = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        calls = (
            [c for m in completion if isinstance(m, dict) for c in m.get("tool_calls") or []]
            if isinstance(completion, list)
            else []
        )
        args = calls[0].get("function", {}).get("arguments") if calls else None
        expression = args.get("expression") if isinstance(args, dict) else None
        if not isinstance(expression, str):
            out.append(0.0)
        else:
            out.append(
                1.0 if expression.strip() == asked else 0.5 * shaped_match(expression.strip(), asked, "0123456789*")
            )
    return out


TASK = Task(
    name="calc",
    description="Multiply two three-digit numbers with the calculator tool: [user: '347*912'] -> '316464'.",
    sample=sample_calc,
    reward_funcs={"calc_exact_match": calc_exact_match, "calc_format": calc_format, "calc_call_match": calc_call_match},
    train_size=4000,
    eval_size=200,
    chat=True,
    tools=TOOLS,
    transcript=calc_transcript,
)
