"""Tool calling: declaring tools, running calls safely, parsing calls out of generated text, and the chat
template's side (rendering, start-up checks, the tokens of tool messages).

    loading   tool specs -> functions and JSON schemas (transformers.utils.get_json_schema), refused early
    builtin   builtin tools (`builtin:calculator`, `builtin:python`)
    sandbox   the bubblewrap sandbox `builtin:python` runs model-written code in, and its set-up check
    failures  the failure kinds of a tool call, and `ToolFailure` (a tool failing with one of them)
    executor  spawned worker processes with per-call timeout, CPU-seconds and memory limits; `ToolOutcome`
    remote    the same calls on the reward service (Kubernetes)
    parsing   tool calls out of an assistant turn (the tokenizer's response parsing; Hermes/Qwen fallback)
    render    chat-template rendering, the prefix-preserving check, tool-message tokens, warm-start turns

Tool calling is one kind of environment (`environments.tools.ToolEnvironment`), driven by the environment rollout
(`orchestrator.env_rollout.EnvironmentRollout`). Importing this package pulls in neither torch nor transformers
(tool workers import it).
"""

from async_grpo.tools.executor import FAILURE_KINDS, ToolBackend, ToolExecutor, ToolOutcome
from async_grpo.tools.failures import ToolFailure
from async_grpo.tools.loading import Tool, ToolSpecError, load_tools, resolve_tool

__all__ = [
    "FAILURE_KINDS",
    "Tool",
    "ToolBackend",
    "ToolExecutor",
    "ToolFailure",
    "ToolOutcome",
    "ToolSpecError",
    "load_tools",
    "resolve_tool",
]
