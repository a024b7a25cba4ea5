"""Parsing tool calls with the tokenizer's response parsing, the start-up checks of the chat template, the tokens of
tool messages (held tokens kept on drift, the minimal-conversation fallback) and the warm-start turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.tiny_model import CHAT_TEMPLATE, build_tiny_tokenizer
from async_grpo.tools.loading import load_tools
from async_grpo.tools.parsing import HERMES_RESPONSE_TEMPLATE, ToolFormatError, parse_turn, response_template
from async_grpo.tools.render import ChatTemplateError, check_chat_template, render_ids, tool_suffix, turn_pairs

PREFIX = "<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
OLD_TINY = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def schemas():
    return [t.schema for t in load_tools(["builtin:calculator"])]


def test_parse_calls_content_and_malformed(tok, schemas):
    template = response_template(tok)
    turn = parse_turn(tok, template, CALL + "<|im_end|>", PREFIX, schemas)
    assert turn.calls == [("calculator", {"expression": "2*3"})] and not turn.malformed and turn.wants_tools
    assert turn.message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}],
    }
    two = parse_turn(tok, template, "let me see" + CALL + CALL.replace("2*3", "4") + "<|im_end|>", PREFIX, schemas)
    assert [a for _, a in two.calls] == [{"expression": "2*3"}, {"expression": "4"}]
    plain = parse_turn(tok, template, "6<|im_end|>", PREFIX, schemas)
    assert plain.message == {"role": "assistant", "content": "6"} and not plain.wants_tools
    for text in (
        CALL[:-14] + "<|im_end|>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
    ):
        bad = parse_turn(tok, template, text, PREFIX, schemas)
        assert bad.malformed and not bad.calls and bad.wants_tools, text
    string_args = parse_turn(
        tok, template, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', PREFIX, schemas
    )
    assert string_args.calls == [("f", {"x": 1})]


def test_response_template_comes_from_the_tokenizer_or_the_hermes_fallback(tok):
    assert response_template(tok) is tok.response_template
    tok.response_template = None
    assert response_template(tok) is HERMES_RESPONSE_TEMPLATE  # the tiny template writes <tool_call> in ChatML
    tok.chat_template = OLD_TINY
    with pytest.raises(ToolFormatError, match="response_template"):
        response_template(tok)


def test_check_chat_template_refuses_what_cannot_carry_tools(tok, schemas):
    check_chat_template(tok, schemas)
    tok.chat_template = OLD_TINY  # renders no tool calls
    with pytest.raises(ChatTemplateError, match="drops parts"):
        check_chat_template(tok, schemas)
    tok.chat_template = CHAT_TEMPLATE.split("{% for message in messages %}", 1)[1]
    tok.chat_template = "{% for message in messages %}" + tok.chat_template  # no tools block
    with pytest.raises(ChatTemplateError, match="does not render the tools"):
        check_chat_template(tok, schemas)
    # a call renders differently once something follows it: not prefix-preserving
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
        "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] or '' }}{% if message['tool_calls'] is defined and message['tool_calls'] %}"
        "{% set mark = 'CALL' if loop.last else 'DONE' %}{% for call in message['tool_calls'] %}<tool_call>{{ mark }} "
        "{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</tool_call>{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="prefix-preserving"):
        check_chat_template(tok, schemas)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no"):
        check_chat_template(tok, schemas)


def test_tool_suffix_appends_exactly_the_templates_tokens_and_keeps_drifted_held_ids(tok, schemas):
    conv = [
        {"role": "user", "content": "2*3"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
            ],
        },
    ]
    tool = [{"role": "tool", "name": "calculator", "content": "6"}]
    held = render_ids(tok, conv, schemas, add_generation_prompt=False)[:-1]  # up to <|im_end|>, as sampled
    suffix = tool_suffix(tok, conv, tool, schemas, held)
    assert not suffix.drift and not suffix.fallback
    assert held + suffix.ids == render_ids(tok, conv + tool, schemas, add_generation_prompt=True)
    compact = tok.encode(CALL.replace(": ", ":").replace(", ", ",")) + [258]  # the model wrote compact JSON
    held = render_ids(tok, conv[:1], schemas, add_generation_prompt=True) + compact
    suffix = tool_suffix(tok, conv, tool, schemas, held)
    assert suffix.drift and not suffix.fallback  # re-render differs from the held ids: they are kept, drift counted
    assert tok.decode(suffix.ids) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
    # a template that drops an assistant's content once a tool message follows: the minimal conversation is used
    tok.chat_template = CHAT_TEMPLATE.replace(
        "(message['content'] or '')",
        "((message['content'] or '') if loop.last or message['role'] != 'assistant' else '')",
    )
    conv[1]["content"] = "thinking"
    held = render_ids(tok, conv, schemas, add_generation_prompt=False)[:-1]
    suffix = tool_suffix(tok, conv, tool, schemas, held)
    assert suffix.fallback and suffix.drift
    assert tok.decode(suffix.ids) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"


def test_turn_pairs_train_each_assistant_turn_on_its_context(tok, schemas):
    conv = [
        {"role": "user", "content": "2*3"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    (ctx1, turn1), (ctx2, turn2) = turn_pairs(tok, conv, schemas)
    assert ctx1 == render_ids(tok, conv[:1], schemas, add_generation_prompt=True)
    assert tok.decode(turn1) == CALL + "<|im_end|>" and tok.decode(turn2) == "6<|im_end|>"
    assert tok.decode(ctx2).endswith("<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")
    assert ctx2 == ctx1 + turn1 + tok.encode("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3_training"])
def test_qwen_templates_pass_the_checks_and_use_the_hermes_parser(tok, schemas, family):
    """The GPU example's family (examples/tools_gpu.yaml), with the real chat templates TRL ships (no weights needed):
    the start-up checks pass, calls in Qwen's format parse, and tool results are appended as Qwen renders them."""
    tok.chat_template = trl_template(family)
    tok.response_template = None
    check_chat_template(tok, schemas)
    template = response_template(tok)
    assert template is HERMES_RESPONSE_TEMPLATE
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call><|im_end|>'
    turn = parse_turn(tok, template, text, PREFIX, schemas)
    assert turn.calls == [("calculator", {"expression": "2*3"})] and not turn.malformed
    conv = [{"role": "user", "content": "2*3"}, turn.message]
    held = render_ids(tok, conv[:1], schemas, add_generation_prompt=True) + tok.encode(text.replace("<|im_end|>", ""))
    held += [tok.convert_tokens_to_ids("<|im_end|>")]
    suffix = tool_suffix(tok, conv, [{"role": "tool", "name": "calculator", "content": "6"}], schemas, held)
    assert tok.decode(suffix.ids) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert not suffix.fallback


def test_qwen3s_own_template_is_refused_as_not_prefix_preserving(tok, schemas):
    """Qwen3's released template re-renders earlier turns (TRL swaps in qwen3_training.jinja for the same reason)."""
    tok.chat_template = trl_template("qwen3")
    with pytest.raises(ChatTemplateError, match="not prefix-preserving"):
        check_chat_template(tok, schemas)
