"""The role boundaries of docs/architecture.md, enforced: each package imports only the roles below it. (A module
holds one idea however long it is: there is no line limit.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "async_grpo"

# role -> the roles (top-level modules or packages of async_grpo) it may import; itself is always allowed
ALLOWED = {
    "config": set(),
    "data": {"tasks", "hub"},
    "hub": set(),
    "tasks": set(),
    "tiny_model": set(),
    "algorithms": set(),
    "inference": set(),
    "transports": {"inference"},
    "tools": {"user_code"},
    "rewards": {"config", "user_code", "tasks", "tools", "transports", "__init__"},
    "orchestrator": {"algorithms", "data", "errors", "inference", "rewards", "tools", "transports", "tasks"},
    "trainer": {"algorithms", "transports"},
    "evaluation": {"data", "inference", "orchestrator", "transports"},
    "tracking": {"config"},
    "errors": set(),
    "user_code": set(),
    "preflight": {"config", "hub", "data", "rewards", "tiny_model", "tools", "user_code"},
}


def _role(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imported_roles(path: Path) -> set[str]:
    roles = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "async_grpo":
            names = [
                f"async_grpo.{a.name}" if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file() else "async_grpo"
                for a in node.names
            ]  # a submodule, or a name of the package itself
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "async_grpo":
                roles.add(parts[1] if len(parts) > 1 else "__init__")
    return roles


@pytest.mark.parametrize("role", sorted(ALLOWED))
def test_a_role_imports_only_the_roles_below_it(role):
    files = [SRC / f"{role}.py"] if (SRC / f"{role}.py").is_file() else sorted((SRC / role).rglob("*.py"))
    assert files, f"no source for role {role}"
    bad = {}
    for path in files:
        crossing = _imported_roles(path) - ALLOWED[role] - {role}
        if crossing:
            bad[str(path.relative_to(SRC))] = sorted(crossing)
    assert not bad, f"imports crossing the role boundary of {role!r} (see docs/architecture.md): {bad}"


def test_no_lower_layer_imports_the_runner_trainer_or_launch():
    lower = ("rewards", "algorithms", "transports", "inference", "tools")
    offenders = {
        str(p.relative_to(SRC)): sorted(_imported_roles(p) & {"launch", "runner", "trainer"})
        for role in lower
        for p in (SRC / role).rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}
