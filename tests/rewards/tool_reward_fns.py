"""Reward functions that read TRL's conversational completions (tool calls and tool results included)."""

from __future__ import annotations


def conversation_reward(prompts, completions, completion_ids, **kwargs):
    """100 x tool messages + 10 x tool calls + 1 if the last message is an assistant's; fails loudly on a string."""
    out = []
    for prompt, messages in zip(prompts, completions, strict=True):
        assert isinstance(prompt, list) and isinstance(messages, list), (type(prompt), type(messages))
        tools = sum(m["role"] == "tool" for m in messages)
        calls = sum(len(m.get("tool_calls") or []) for m in messages)
        args_ok = all(isinstance(c["function"]["arguments"], dict) for m in messages for c in m.get("tool_calls") or [])
        out.append(100.0 * tools + 10.0 * calls + float(messages[-1]["role"] == "assistant") if args_ok else -1.0)
    return out
