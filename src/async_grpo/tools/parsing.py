"""Tool calls out of a generated assistant turn, with transformers' own response parsing.

`tokenizer.parse_response` (transformers >= 5.13, "chat response parsing") reads a model family's output format
from the tokenizer's `response_template`. Where a tokenizer ships none, the Hermes / Qwen format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside a ChatML turn, used by Qwen2.5, Qwen3 and
Hermes models) is used when the chat template itself writes `<tool_call>`; any other family needs its
`response_template` set (the error says how). A turn whose calls do not parse is kept as plain text, and each
unusable call is reported as malformed, so the rollout can tell the model and count it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# ChatML turn with Hermes tool calls (Qwen2.5 / Qwen3 / Hermes, and the tiny model): the JSON inside each
# <tool_call> ... </tool_call> is one {"name", "arguments"} object; the text before <|im_end|> is the content.
HERMES_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


class ToolFormatError(ValueError):
    """The tokenizer's output format for tool calls is unknown (the message says how to declare it)."""


def response_template(tokenizer: Any) -> dict:
    """The response template that parses this tokenizer's assistant turns: its own `response_template`, else
    `HERMES_RESPONSE_TEMPLATE` when its chat template writes `<tool_call>`.

    Raises:
        ToolFormatError: neither; the message gives the fix.
    """
    own = getattr(tokenizer, "response_template", None)
    if own:
        return own
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "<tool_call>" in template and "<|im_start|>" in template:
        return HERMES_RESPONSE_TEMPLATE
    raise ToolFormatError(
        "tools: the tokenizer has no `response_template` (transformers chat response parsing) and its chat template "
        "is not Hermes/Qwen style (<tool_call>...</tool_call> in ChatML), so tool calls cannot be parsed. Fix: add a "
        "`response_template` for your model family to the model folder's tokenizer_config.json (see "
        "https://huggingface.co/docs/transformers/main/en/chat_response_parsing), or use a Qwen/Hermes-style model."
    )


@dataclass
class ParsedTurn:
    """One assistant turn, parsed.

    Attributes:
        message: the assistant message in TRL's conversational form: {"role": "assistant", "content": str} plus
            "tool_calls": [{"type": "function", "function": {"name", "arguments"}}] when it called tools.
        calls: the well-formed calls, in order, as (name, arguments).
        malformed: one description per call that could not be used (unparseable JSON, no name, ...).
    """

    message: dict
    calls: list[tuple[str, Any]] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        """True when the turn tried to call at least one tool (well-formed or not)."""
        return bool(self.calls or self.malformed)


def _strip_specials(text: str, specials: list[str]) -> str:
    changed = True
    while changed:
        changed = False
        for tok in specials:
            if tok and text.endswith(tok):
                text, changed = text[: -len(tok)], True
    return text.strip()


def _one_call(call: Any) -> tuple[str, Any] | str:
    """(name, arguments) of one parsed call, or why it is malformed."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return f"a tool call must be a JSON object with a string 'name' and an 'arguments' object, got {fn!r:.80}"
    args = fn.get("arguments", {})
    if isinstance(args, str):  # some formats carry the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"the arguments of {fn['name']} are not JSON: {args!r:.80}"
    return fn["name"], args


def parse_turn(tokenizer: Any, template: dict, text: str, prefix_text: str, tools: list[dict] | None) -> ParsedTurn:
    """Parse one generated assistant turn.

    Args:
        tokenizer: the policy's tokenizer (its `parse_response` does the parsing).
        template: the response template (`response_template(tokenizer)`).
        text: the turn decoded with special tokens kept (e.g. ending in `<|im_end|>`).
        prefix_text: decoded text just before the turn (holds the template's start anchor, e.g.
            `<|im_start|>assistant\\n`).
        tools: the JSON schemas offered (argument types are cast with them), or None.

    Returns:
        A `ParsedTurn`; never raises for what the model wrote.
    """
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    try:
        parsed = tokenizer.parse_response(text, schema=template, prefix=prefix_text, tools=tools or None)
    except (ValueError, TypeError, KeyError) as err:  # unparseable JSON in a tool-call region, typically
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return ParsedTurn(
            {"role": "assistant", "content": _strip_specials(text, specials)},
            malformed=[f"could not parse the tool call: {reason}"],
        )
    message: dict = {"role": "assistant", "content": _strip_specials(str(parsed.get("content") or ""), specials)}
    if parsed.get("reasoning_content"):
        message["reasoning_content"] = parsed["reasoning_content"]
    turn = ParsedTurn(message)
    raw_calls = parsed.get("tool_calls") or []
    for call in raw_calls:
        one = _one_call(call)
        if isinstance(one, str):
            turn.malformed.append(one)
        else:
            turn.calls.append(one)
    if turn.calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in turn.calls]
    return turn
