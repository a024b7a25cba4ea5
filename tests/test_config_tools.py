"""The `tools` config section: TRL's flat `tools` key and the section, the spec syntax, the refused combinations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from async_grpo.config import FIELDS, GRPOConfig, dump_config, flat_dump, load_config

CALC = ["builtin:calculator"]


def test_tools_loads_flat_nested_dotted_and_round_trips(tmp_path):
    flat = GRPOConfig(tools=CALC, tool_timeout_s=3)
    nested = GRPOConfig(tools={"tools": CALC, "tool_timeout_s": 3})
    dotted = GRPOConfig(**{"tools.tools": CALC, "tools.tool_timeout_s": 3})
    assert flat == nested == dotted and flat.tools.tools == CALC and flat.tools.tool_timeout_s == 3.0
    assert FIELDS["tools"].path == "tools.tools" and flat_dump(flat)["tools"] == CALC
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(flat))
    assert load_config(path) == flat
    path.write_text("tools: [builtin:calculator]\nmax_tool_calling_iterations: 2\n")
    assert load_config(path, ["tool_num_workers=3"]).tools.max_tool_calling_iterations == 2
    assert GRPOConfig().tools.tools == []
    assert flat.model_copy(update={"tools": []}).tools.tools == []


@pytest.mark.parametrize("raw", ["[builtin:calculator]", "[]", "{tools: [builtin:calculator]}", "null", ""])
def test_a_tools_override_equals_the_same_yaml_key(tmp_path, raw):
    """Issue 28: `tools=[builtin:calculator]` on the command line was refused ("a section takes a mapping") while
    `tools: [builtin:calculator]` in YAML is TRL's list; a mapping (or nothing) still means the section."""
    path = tmp_path / "c.yaml"
    path.write_text(f"tools: {raw}\n")
    assert load_config(None, [f"tools={raw}"]) == load_config(path)


def test_a_tools_list_override_keeps_the_files_other_tools_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tools:\n  tools: [builtin:calculator]\n  tool_timeout_s: 3\n")
    assert load_config(path, ["tools=[]"]).tools == load_config(None, ["tools=[]", "tool_timeout_s=3"]).tools
    assert load_config(path, ["tools=null"]) == load_config(path)  # an empty section, as `tools:` in a file
    path.write_text("tools: [builtin:calculator]\n")
    assert load_config(path, ["tools={tool_timeout_s: 3}"]) == load_config(
        None, ["tools=" + str(CALC), "tool_timeout_s=3"]
    )
    assert load_config(path, ["tools=[]"]).tools.tools == []


@pytest.mark.parametrize(
    ("tools", "says"),
    [
        (["calculator"], "Did you mean 'builtin:calculator'"),
        (["x.py:"], "is not a function name"),
        (["a b:f"], "neither a module name nor a .py file"),
        (CALC * 2, "more than once"),
    ],
)
def test_bad_tool_specs_fail_naming_the_entry(tools, says):
    with pytest.raises(ValidationError, match=says):
        GRPOConfig(tools=tools)


def test_limits_are_checked_and_a_data_producer_is_refused():
    for bad in (
        {"max_tool_calling_iterations": 0},
        {"max_tool_response_length": 0},
        {"tool_timeout_s": 0},
        {"tool_cpu_seconds": -1},
        {"tool_memory_mb": 8},
        {"tool_num_workers": 0},
    ):
        with pytest.raises(ValidationError):
            GRPOConfig(tools=CALC, **bad)
    assert GRPOConfig(tools=CALC, tool_cpu_seconds=None, tool_memory_mb=None).tools.tool_memory_mb is None
    with pytest.raises(ValidationError, match="data_producer replaces"):
        GRPOConfig(tools=CALC, data_producer="my.mod:make")
