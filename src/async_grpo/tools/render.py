"""The chat template's side of tool calling: rendering, the start-up checks, and the tokens of tool messages.

The multi-turn rollout never re-tokenizes what it holds: it appends to the held token ids exactly the tokens the
chat template writes for the new tool messages (and the next assistant header). Those tokens are the difference
between two renderings, with and without the tool messages, which is only meaningful when the template is
prefix-preserving (adding a message never changes how the earlier ones render). `check_chat_template` verifies
that, and that the template renders tool calls and tool results at all, before anything starts (the same two
properties TRL checks with `supports_tool_calling` and `is_chat_template_prefix_preserving`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SENTINELS = ("tool_name_q7x", "arg_key_q7x", "arg_value_q7x", "tool_result_q7x")


class ChatTemplateError(ValueError):
    """The chat template cannot carry a tool-calling conversation (the message names the problem and the fix)."""


def render_ids(
    tokenizer: Any, messages: Sequence[Mapping], tools: list[dict] | None, *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (`tools` rendered into it; None: none)."""
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools or None,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
    )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(i) for i in out]


def _cut_after(ids: list[int], end_token: int | None) -> int:
    """Length of `ids` up to and including the last `end_token` (the turn's stop token), else len(ids)."""
    if end_token is not None:
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == end_token:
                return i + 1
    return len(ids)


@dataclass
class Suffix:
    """The tokens to append after an assistant turn: its tool messages and the next assistant header.

    Attributes:
        ids: the token ids to append.
        drift: True when the re-rendered conversation up to the turn differs from the held tokens (the held ones
            are kept; counted as `tools/template_drift`).
        fallback: True when this conversation broke the prefix property, so the tokens come from the minimal
            conversation of the start-up check (TRL GRPOTrainer's way) instead.
    """

    ids: list[int]
    drift: bool = False
    fallback: bool = False


def _difference(
    tokenizer: Any, before: list[dict], after: list[dict], tools: list[dict] | None, end_token: int | None
) -> tuple[list[int], list[int]] | None:
    """(before rendered and cut after its last `end_token`, the tokens `after` adds), or None when `after`'s
    rendering does not start with that cut (the template is not prefix-preserving here)."""
    base = render_ids(tokenizer, before, tools, add_generation_prompt=False)
    full = render_ids(tokenizer, after, tools, add_generation_prompt=True)
    cut = _cut_after(base, end_token)
    if full[:cut] != base[:cut]:
        return None
    return base[:cut], full[cut:]


def tool_suffix(
    tokenizer: Any, conversation: list[dict], tool_messages: list[dict], tools: list[dict] | None, held: list[int]
) -> Suffix:
    """The tokens of `tool_messages` (and the next generation prompt) after the held tokens.

    Args:
        tokenizer: the policy's tokenizer.
        conversation: the prompt messages and every turn so far, ending with the assistant turn that called tools.
        tool_messages: that turn's tool results ({"role": "tool", "name", "content"} each, in call order).
        tools: the JSON schemas the prompt was rendered with.
        held: every token id so far (prompt and turns); its last one is the turn's stop token.

    Returns:
        A `Suffix`.

    Raises:
        ChatTemplateError: not even the minimal conversation yields a clean difference (the start-up check passed,
            so only a template that depends on the tool results' content can get here).
    """
    end = held[-1] if held else None
    diff = _difference(tokenizer, conversation, conversation + tool_messages, tools, end)
    if diff is not None:
        base, ids = diff
        return Suffix(ids, drift=base != held)
    dummy = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}}
                for m in tool_messages
            ],
        },
    ]
    diff = _difference(tokenizer, dummy, dummy + tool_messages, None, end)
    if diff is None:
        raise ChatTemplateError(
            "the chat template renders these tool messages differently depending on what comes "
            "before them. Fix: use a prefix-preserving chat template."
        )
    return Suffix(diff[1], drift=True, fallback=True)


def check_chat_template(tokenizer: Any, tools: list[dict]) -> None:
    """Refuse a chat template that cannot carry tool calling (run before anything starts).

    Checks that (1) a user -> assistant (tool call) -> tool conversation renders the tool's name, argument key and
    value and the tool result, and that the offered tools' names appear in the prompt; (2) the template is
    prefix-preserving: the generation prompt is a prefix of the rendered assistant turn, and the rendered
    assistant turn (cut after its last end-of-turn token) is a prefix of the conversation with the tool message
    appended.

    Raises:
        ChatTemplateError: the first property that fails, with the fix.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "tools need a chat template (tool schemas and results are rendered by it), but the "
            "tokenizer has none. Fix: use a chat model's tokenizer."
        )
    name, key, value, result = _SENTINELS
    call = {"type": "function", "function": {"name": name, "arguments": {key: value}}}
    user = [{"role": "user", "content": "hi"}]
    turn = user + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    conv = turn + [{"role": "tool", "name": name, "content": result}]
    try:
        text = tokenizer.apply_chat_template(conv, tokenize=False)
        prompt_text = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja TemplateError and friends: the template rejects the tool roles
        raise ChatTemplateError(
            f"the chat template cannot render a tool-calling conversation ({err}). Fix: use a "
            "model whose chat template supports tools (e.g. Qwen2.5/Qwen3 instruct)."
        ) from None
    lost = [s for s in _SENTINELS if s not in text]
    if lost:
        raise ChatTemplateError(
            f"the chat template drops parts of a tool-calling conversation (missing {lost}: it "
            "ignores tool_calls or tool messages). Fix: use a model whose chat template "
            "supports tools (e.g. Qwen2.5/Qwen3 instruct)."
        )
    unseen = [t["function"]["name"] for t in tools if t["function"]["name"] not in prompt_text]
    if unseen:
        raise ChatTemplateError(
            f"the chat template does not render the tools {unseen} into the prompt, so the "
            "model would not know them. Fix: use a chat template that renders `tools`."
        )
    prompt_ids = render_ids(tokenizer, user, None, add_generation_prompt=True)
    turn_ids = render_ids(tokenizer, turn, None, add_generation_prompt=False)
    if turn_ids[: len(prompt_ids)] != prompt_ids:
        raise ChatTemplateError(
            "the chat template is not prefix-preserving: the generation prompt is not a prefix "
            "of the rendered assistant turn. Fix: use a prefix-preserving chat template (TRL's "
            "training templates are)."
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    end = next((i for i in reversed(turn_ids[len(prompt_ids) :]) if i in _end_tokens(tokenizer, eos)), None)
    if _difference(tokenizer, turn, conv, None, end) is None:
        raise ChatTemplateError(
            "the chat template is not prefix-preserving: appending a tool message changes how "
            "the assistant turn before it renders. Fix: use a prefix-preserving chat template "
            "(TRL's training templates are)."
        )


def _end_tokens(tokenizer: Any, eos: int | None) -> set[int]:
    """Ids that may end an assistant turn: eos and the special tokens other than pad/bos."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids -= {getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "pad_token_id", None)} - {eos}
    if eos is not None:
        ids.add(eos)
    return ids


def turn_pairs(tokenizer: Any, conversation: list[dict], tools: list[dict] | None) -> list[tuple[list[int], list[int]]]:
    """Supervised (context ids, assistant-turn ids) pairs of a reference conversation, one per assistant message:
    the context is everything before the turn rendered with the generation prompt (tool results included, never
    trained on), the turn its tokens through its end-of-turn token. For a multi-turn warm start.

    Raises:
        ChatTemplateError: a turn's context is not a prefix of the rendered turn (the template is not
            prefix-preserving).
    """
    pairs = []
    end_tokens = _end_tokens(tokenizer, getattr(tokenizer, "eos_token_id", None))
    for k, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        context = render_ids(tokenizer, conversation[:k], tools, add_generation_prompt=True)
        full = render_ids(tokenizer, conversation[: k + 1], tools, add_generation_prompt=False)
        if full[: len(context)] != context:
            raise ChatTemplateError(
                "the chat template is not prefix-preserving: a turn's context does not render as "
                "a prefix of the turn. Fix: use a prefix-preserving chat template."
            )
        turn = full[len(context) :]
        end = next((i for i in range(len(turn) - 1, -1, -1) if turn[i] in end_tokens), len(turn) - 1)
        pairs.append((context, turn[: end + 1]))
    return pairs
