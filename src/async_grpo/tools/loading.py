"""Tool specs -> Python functions and their JSON schemas, checked before anything starts.

A tool is a typed Python function with a Google-style docstring, named in the config by a spec string:
`builtin:<name>` (see `tools.builtin`), `pkg.module:function` or `path/to/file.py:function`. Its JSON schema
comes from `transformers.utils.get_json_schema` (the schema `apply_chat_template(tools=...)` renders), so a
function without type hints or docstring is refused here, with the reason transformers gives, before any process
starts. Specs are plain strings so that each tool worker process resolves its own copy: user code is never
pickled and may hold unpicklable state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from async_grpo.user_code import CodeSpec, import_target, parse_spec

BUILTIN_PREFIX = "builtin:"
WHAT = "tool spec"


class ToolSpecError(ValueError):
    """A tool spec is malformed, does not resolve, or names a function that cannot be a tool (the message names
    the spec and the fix)."""


def parse_tool_spec(spec: Any) -> CodeSpec:
    """`user_code.parse_spec` with this module's error type (imports nothing).

    Raises:
        ToolSpecError: the spec is malformed.
    """
    return parse_spec(spec, what=WHAT, error=ToolSpecError)


def absolute_spec(spec: str) -> str:
    """`spec` with a file target made absolute, so worker processes resolve it whatever their working directory."""
    return parse_tool_spec(spec).absolute()


def resolve_tool(spec: str) -> Callable[..., Any]:
    """Import and return the function a tool spec names (no schema check; see `load_tools`).

    Raises:
        ToolSpecError: malformed spec, unknown builtin, missing file or module, missing or non-callable attribute.
    """
    parsed = parse_tool_spec(spec)
    target, name = parsed.target, parsed.name
    if parsed.kind == "builtin":
        from async_grpo.tools.builtin import BUILTIN_TOOLS

        if name not in BUILTIN_TOOLS:
            raise ToolSpecError(
                f"tool spec {spec!r}: no builtin tool {name!r}. Fix: use one of "
                f"{[BUILTIN_PREFIX + n for n in sorted(BUILTIN_TOOLS)]}."
            )
        return BUILTIN_TOOLS[name]
    module = import_target(parsed, what=WHAT, error=ToolSpecError, prefix="_async_grpo_tool")
    func = getattr(module, name, None)
    if func is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ToolSpecError(f"tool spec {spec!r}: {target} has no attribute {name!r}. Fix: use one of {public}.")
    if not callable(func):
        raise ToolSpecError(
            f"tool spec {spec!r}: {name!r} is a {type(func).__name__}, not a function. "
            "Fix: point at a typed function with a Google-style docstring."
        )
    return func


@dataclass(frozen=True)
class Tool:
    """One declared tool.

    Attributes:
        name: the function's name, what the model calls (`schema["function"]["name"]`).
        spec: the spec as given in the config.
        worker_spec: the spec a worker process resolves (file paths made absolute).
        schema: the OpenAI-style JSON schema from `transformers.utils.get_json_schema`
            ({"type": "function", "function": {"name", "description", "parameters", ...}}).
    """

    name: str
    spec: str
    worker_spec: str
    schema: dict

    @property
    def parameters(self) -> dict:
        """The schema's `parameters` object ({"type": "object", "properties": {...}, "required": [...]})."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_schema(spec: str, func: Callable[..., Any]) -> dict:
    """The JSON schema of `func` from `transformers.utils.get_json_schema`.

    Raises:
        ToolSpecError: transformers cannot build the schema (no type hints, no docstring, an undocumented
            argument); the message carries transformers' reason and the fix. An `async def` tool is described like
            a plain one (its worker awaits it: `tools.executor`).
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as err:  # TypeHintParsingException / DocstringParsingException (both plain Exceptions)
        raise ToolSpecError(
            f"tool spec {spec!r}: transformers.utils.get_json_schema cannot describe {getattr(func, '__name__', func)}: "
            f"{err}. Fix: give every argument a type hint and a Google-style docstring with an `Args:` line per "
            "argument (https://huggingface.co/docs/transformers/chat_extras#passing-tools)."
        ) from None


def signature_schema(func: Callable[..., Any]) -> dict:
    """A minimal schema from the signature alone (argument names, which are required; no types or descriptions),
    for a process without transformers (the reward image) that only runs calls: the trainer side, which renders
    prompts and checks argument types, always has the full `tool_schema`."""
    params = [
        p for p in inspect.signature(func).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return {
        "type": "function",
        "function": {
            "name": func.__name__,
            "description": (inspect.getdoc(func) or "").split("\n")[0],
            "parameters": {
                "type": "object",
                "properties": {p.name: {} for p in params},
                "required": [p.name for p in params if p.default is p.empty],
            },
        },
    }


def load_tools(specs: Sequence[str], *, describe: bool = True) -> list[Tool]:
    """Resolve and check every tool spec: importable, typed and documented, names unique.

    Args:
        specs: the `tools` entries.
        describe: build each JSON schema with transformers (`tool_schema`, the default); False builds only
            `signature_schema`, for a process that runs calls but renders no prompt (the reward service).

    Returns:
        The tools in spec order.

    Raises:
        ToolSpecError: the first bad spec (see `resolve_tool`, `tool_schema`), or two tools with one name.
    """
    if isinstance(specs, str):
        raise ToolSpecError(f"tools={specs!r} must be a list of specs. Fix: e.g. tools: [builtin:calculator].")
    tools: list[Tool] = []
    for spec in specs:
        func = resolve_tool(spec)
        schema = tool_schema(spec, func) if describe else signature_schema(func)
        tools.append(Tool(schema["function"]["name"], spec, absolute_spec(spec), schema))
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolSpecError(
            f"tools: several tools are named {duplicates}; the model could not tell them apart. "
            "Fix: give each tool function a distinct name."
        )
    return tools
