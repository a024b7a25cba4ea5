"""Drop reasons (`transports/drops.py`): one list, the counter refuses anything else, and every place in the
source that drops a group names a listed reason (a static check standing in for a type checker)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from async_grpo.rewards.wire import ERRORS
from async_grpo.runner.report import pipeline_metrics, prompts_lost
from async_grpo.transports.drops import DROP_REASONS, NOT_LAUNCHED_DROPS, DropCounter
from async_grpo.transports.scorer import RewardBadOutput, RewardError, RewardTimeout

SRC = Path(__file__).resolve().parents[2] / "src" / "async_grpo"


def test_the_reasons_are_the_metric_names_in_use():
    # the MLflow metrics dropped_groups/<reason>: renaming one breaks dashboards and resumed runs' counts
    assert DROP_REASONS == (
        "stale", "queue_timeout", "shutdown", "unconsumed_at_end", "prompt_too_long", "aborted",
        "tool_service_error", "inference_unavailable", "generation_error", "rollout_error", "zero_std",
        "reward_error", "reward_bad_output", "reward_timeout", "teacher_error", "teacher_timeout", "agent_no_call",
        "agent_no_shared_prompt",
    )  # fmt: skip
    assert set(NOT_LAUNCHED_DROPS) <= set(DROP_REASONS)


def test_the_counter_refuses_an_unlisted_reason():
    drops = DropCounter()
    with pytest.raises(ValueError, match=r"'stael' is not one of .*Fix"):
        drops.add("stael")
    assert drops.snapshot() == {}


def test_metrics_and_ledger_read_the_same_counts():
    drops = DropCounter()
    drops.add("stale", 2)
    drops.add("prompt_too_long", 5)  # counted at load time: not a launched group
    metrics = pipeline_metrics(
        [0], version=0, depth=0, waited_s=0.0, step_s=0.0, generation_rounds=0, world_size=1, drops=drops.snapshot()
    )
    assert metrics["dropped_groups/stale"] == 2.0 and metrics["dropped_groups/prompt_too_long"] == 5.0
    assert metrics["dropped_groups/total"] == 7.0
    assert prompts_lost(10, 8, drops.snapshot()) == 0


def test_reward_errors_carry_listed_reasons():
    assert {cls.reason for cls in (RewardError, RewardBadOutput, RewardTimeout)} <= set(DROP_REASONS)
    assert set(ERRORS) <= set(DROP_REASONS)


def _string_reasons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, reason) of every literal reason a drop is counted or raised under in one module: `*.add("r", ...)`
    on a drop counter, `*.drain("r")`, `RolloutDropped("r", ...)`, and `reason = "r"` in exception classes
    (RewardError and its subclasses)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            is_drop_add = (
                name == "add" and isinstance(func, ast.Attribute) and "drops" in ast.unparse(func.value).split(".")
            )
            if is_drop_add or name in ("drain", "RolloutDropped"):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Error") for b in node.bases):
            for item in node.body:
                target = item.target if isinstance(item, ast.AnnAssign) else None
                if isinstance(item, ast.Assign) and len(item.targets) == 1:
                    target = item.targets[0]
                value = getattr(item, "value", None)
                if isinstance(target, ast.Name) and target.id == "reason" and isinstance(value, ast.Constant):
                    found.append((item.lineno, value.value))
    return found


def test_every_drop_in_the_source_names_a_listed_reason():
    seen, bad = set(), []
    for path in sorted(SRC.rglob("*.py")):
        for line, reason in _string_reasons(ast.parse(path.read_text())):
            seen.add(reason)
            if reason not in DROP_REASONS:
                bad.append(f"{path.relative_to(SRC)}:{line}: {reason!r}")
    assert not bad, f"drop reasons missing from transports.drops.DropReason: {bad}"
    # the scan finds the drops it should (a guard against a scan that silently matches nothing)
    assert {"stale", "shutdown", "zero_std", "aborted", "reward_timeout", "prompt_too_long"} <= seen
