"""Declaring tools: builtin, module and file specs; bad tools refused before anything starts; the calculator."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.tools.builtin import calculator
from async_grpo.tools.loading import ToolSpecError, load_tools, resolve_tool, signature_schema

FNS = Path(__file__).with_name("tool_fns.py")


def test_three_spec_forms_and_transformers_schemas():
    tools = load_tools(["builtin:calculator", f"{FNS}:add"])
    assert [t.name for t in tools] == ["calculator", "add"]
    add = tools[1].schema["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first."},
        "b": {"type": "integer", "description": "the second."},
    }
    assert add["parameters"]["required"] == ["a", "b"]
    assert tools[1].worker_spec == f"{FNS.resolve()}:add"
    assert resolve_tool("async_grpo.tools.builtin:calculator") is calculator


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("untyped", "missing a type hint"),
        ("undocumented", "no docstring"),
        ("NOT_A_FUNCTION", "not a function"),
        ("missing", "no attribute 'missing'"),
    ],
)
def test_bad_tools_are_refused_naming_the_spec_and_the_fix(name, says):
    with pytest.raises(ToolSpecError) as err:
        load_tools([f"{FNS}:{name}"])
    assert says in str(err.value) and name in str(err.value) and "Fix" in str(err.value)


def test_unresolvable_specs_and_duplicates_are_refused():
    for spec, says in (
        ("calculator", "Did you mean 'builtin:calculator'"),
        ("builtin:abacus", "no builtin tool"),
        ("no_such_pkg.mod:f", "cannot import"),
        ("/nope/tools.py:f", "does not exist"),
    ):
        with pytest.raises(ToolSpecError, match=says):
            load_tools([spec])
    with pytest.raises(ToolSpecError, match="several tools are named"):
        load_tools(["builtin:calculator", "async_grpo.tools.builtin:calculator"])


def test_signature_schema_needs_no_transformers():
    schema = signature_schema(resolve_tool(f"{FNS}:add"))
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"a": {}, "b": {}},
        "required": ["a", "b"],
    }
    assert [t.schema for t in load_tools([f"{FNS}:add"], describe=False)] == [schema]


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347*912", "316464"),
        (" 2 + 3*4 ", "14"),
        ("7/2", "3.5"),
        ("8/2", "4"),
        ("-(3-5)**3", "8"),
        ("17//5%3", "0"),
    ],
)
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("", "non-empty"),
        ("1/0", "division by zero"),
        ("__import__('os')", "unsupported syntax"),
        ("2**1000", "exponent"),
        ("(10**60)**4", "more than 200 digits"),
        ("9" * 201, "longer than 200"),
        ("1+", "cannot parse"),
    ],
)
def test_calculator_refuses(expression, says):
    with pytest.raises(ValueError, match=says):
        calculator(expression)
