"""The `tools` section: multi-turn tool calling in rollouts (TRL `tools`, `max_tool_calling_iterations`; verl
`max_tool_response_length`), where tool calls run and their limits, and the cross-field checks that involve it.

Only the spec syntax is checked here (this package imports neither torch nor transformers); whether each tool
imports and has type hints and a docstring is checked by `tools.loading.load_tools` when the run is set up,
before vLLM or any worker starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.user_code import parse_spec


class ToolsConfig(Section):
    """Tool calling: the tools the model may call, how many rounds, and how tool calls are run."""

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call during a rollout (TRL name): `builtin:<name>` "
        "(builtin:calculator), `pkg.module:function` or `path/to/file.py:function`, each a typed function with a "
        "Google-style docstring (its JSON schema comes from transformers.utils.get_json_schema and is rendered by "
        "the chat template). Needs conversational prompts; a dataset column `tools` (a list of names) offers a row "
        "a subset. Empty: single-turn rollouts.",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=1,
        description="Most tool-calling rounds per completion (TRL name): after this many rounds a "
        "further call is not run and the completion ends. None: no limit but max_completion_length.",
    )
    max_tool_response_length: int = Field(
        256,
        ge=1,
        description="A tool's answer longer than this many characters is cut to it and marked "
        "`...(truncated)` (verl name and default).",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Wall-clock limit of one tool call (seconds): past it the worker is killed and "
        "the model reads an error.",
    )
    tool_cpu_seconds: float | None = Field(
        10.0,
        gt=0.0,
        description="CPU-time limit of one tool call (seconds, RLIMIT_CPU in the worker): past it the "
        "worker is killed and the model reads an error. None: no limit.",
    )
    tool_memory_mb: int | None = Field(
        1024,
        ge=64,
        description="Address-space limit of a tool worker process (MiB, RLIMIT_AS): an allocation past "
        "it fails inside the tool (an error the model reads). None: no limit.",
    )
    tool_num_workers: int = Field(
        2,
        ge=1,
        description="Tool worker processes (spawned, like the reward workers). On Kubernetes tool calls run "
        "in the reward service instead, with its workers.",
    )

    @field_validator("tools")
    @classmethod
    def _spec_syntax(cls, specs: list[str]) -> list[str]:
        """Each entry looks like `builtin:<name>`, `pkg.module:function` or `path/file.py:function`; no repeats."""
        for spec in specs:
            parse_spec(spec, what="tools entry", error=ValueError)
        repeated = sorted({s for s in specs if specs.count(s) > 1})
        if repeated:
            raise ValueError(f"tools lists {repeated} more than once. Fix: list each tool once.")
        return specs


def check_tools(config: Any) -> None:
    """Cross-field checks for tool calling (called by `GRPOConfig`'s validator); each error names the fix.

    Raises:
        ValueError: tools with a user `data_producer` (it replaces the rollout that runs the tools).
    """
    if not config.tools.tools:
        return
    if config.producer.data_producer is not None:
        raise ValueError(
            "tools run inside the builtin multi-turn rollout, which data_producer replaces. Fix: unset "
            "data_producer, or run the tools in your own producer and unset tools."
        )
