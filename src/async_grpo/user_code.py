"""Specs that name user code, parsed once for reward functions, tools and data producers.

A spec is a plain string in one of three forms:

    builtin:<name>              code shipped in this package (image code)
    pkg.module:function         a module importable where the spec is resolved (image code on a cluster)
    path/to/file.py:function    a submitter's file (submitter code)

`parse_spec` splits and validates it (the callers keep their own error types: `RewardSpecError`,
`ToolSpecError`). Where submitter code may run (the local target, the reward pods) `import_target` imports it.
Where it must never run (the launcher pod of a cluster run, which holds MLflow credentials and a ServiceAccount
token) `check_file_statically` reads the file with `ast` and never executes a line of it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

FORMS = "`builtin:<name>`, `pkg.module:function` or `path/to/file.py:function`"
MAX_STATIC_CHECK_BYTES = 10 * 1024 * 1024  # a submitter file larger than this is refused by the static check

SpecKind = Literal["builtin", "module", "file"]


@dataclass(frozen=True)
class CodeSpec:
    """A parsed spec.

    Attributes:
        text: the spec as written.
        kind: "builtin", "module" (a dotted module name) or "file" (a target ending in `.py`).
        target: what precedes the last colon: "builtin", the module name, or the file path as written.
        name: the function (or factory) name after the last colon; a Python identifier.
    """

    text: str
    kind: SpecKind
    target: str
    name: str

    @property
    def is_file(self) -> bool:
        """True for a submitter's `.py` file."""
        return self.kind == "file"

    def absolute(self) -> str:
        """The spec with a file target made absolute (worker processes resolve it whatever their directory)."""
        return f"{Path(self.target).resolve()}:{self.name}" if self.is_file else self.text


def parse_spec(spec: object, *, what: str, error: type[Exception]) -> CodeSpec:
    """Split and check a spec without importing anything.

    Args:
        spec: the config value.
        what: how messages name the spec's kind, e.g. "reward function spec".
        error: the exception type raised (a ValueError subclass of the caller's).

    Raises:
        error: not a string, no colon, an empty target, a name that is no identifier, or a module target that is
            not a dotted name; the message names the spec and the forms.
    """
    if not isinstance(spec, str) or ":" not in spec:
        hint = f" Did you mean 'builtin:{spec}'?" if isinstance(spec, str) and spec.isidentifier() else ""
        raise error(f"{what} {spec!r} is not one of {FORMS}.{hint}")
    target, name = spec.rsplit(":", 1)
    if not target or not name.isidentifier():
        raise error(f"{what} {spec!r}: {name!r} is not a function name. Fix: write it as {FORMS}.")
    if target == "builtin":
        return CodeSpec(spec, "builtin", target, name)
    if target.endswith(".py"):
        return CodeSpec(spec, "file", target, name)
    if not all(part.isidentifier() for part in target.split(".")):
        raise error(f"{what} {spec!r}: {target!r} is neither a module name nor a .py file. Fix: write it as {FORMS}.")
    return CodeSpec(spec, "module", target, name)


ENVIRONMENT_ADAPTERS = ("openenv", "verifiers")


def split_adapter(spec: object) -> tuple[str | None, object]:
    """Split an environment spec's adapter prefix: `openenv:pkg.module:factory` -> ("openenv", "pkg.module:factory"),
    `verifiers:<taskset-id>` -> ("verifiers", "<taskset-id>"); any other value -> (None, spec). Imports nothing."""
    if isinstance(spec, str):
        head, sep, rest = spec.partition(":")
        if sep and head in ENVIRONMENT_ADAPTERS:
            return head, rest
    return None, spec


def check_adapter_spec(spec: str, *, error: type[Exception]) -> None:
    """Check an adapter spec's syntax (imports nothing): `openenv:` takes a module or file spec, `verifiers:` a
    taskset id (`<env-id>+<taskset-id>` too) or a module or file spec.

    Raises:
        error: an empty remainder, or a remainder that is not a valid module or file spec; names the forms.
    """
    adapter, inner = split_adapter(spec)
    forms = (
        "openenv:pkg.module:factory, openenv:path/to/file.py:factory, verifiers:<taskset-id>, "
        "verifiers:<env-id>+<taskset-id> or verifiers:pkg.module:Name"
    )
    if not inner:
        raise error(f"environment spec {spec!r}: nothing after {adapter}:. Fix: write it as one of {forms}.")
    if adapter == "verifiers" and ":" not in str(inner):
        return
    parsed = parse_spec(inner, what=f"environment spec {spec!r}: the part after {adapter}:", error=error)
    if parsed.kind == "builtin":
        raise error(f"environment spec {spec!r}: an adapter wraps user code, not a builtin. Fix: write {forms}.")


def is_file_spec(spec: object) -> bool:
    """True when `spec` names a submitter's `.py` file (False for anything else, malformed included)."""
    return isinstance(spec, str) and ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def import_target(spec: CodeSpec, *, what: str, error: type[Exception], prefix: str) -> ModuleType:
    """Import the module a "module" or "file" spec names (this runs its code).

    Args:
        prefix: module-name prefix of loaded files (e.g. `_async_grpo_reward`), see `load_file`.

    Raises:
        error: the module is not installed, the file does not exist, or importing raised (chained).
    """
    if spec.is_file:
        return load_file(spec.target, prefix=prefix, what=f"{what} {spec.text!r}", error=error)
    try:
        return importlib.import_module(spec.target)
    except ModuleNotFoundError as err:
        raise error(
            f"{what} {spec.text!r}: cannot import {spec.target!r} ({err}). Fix: install the package or put "
            "it on PYTHONPATH, or use path/to/file.py:function."
        ) from err
    except Exception as err:  # the module itself is broken (SyntaxError, an error at import time)
        raise error(f"{what} {spec.text!r}: importing {spec.target!r} failed: {err!r}") from err


def import_callable(spec: CodeSpec, *, what: str, error: type[Exception], prefix: str, returns: str) -> Callable:
    """Import a "module" or "file" spec's target (this runs its code) and return the callable it names.

    Args:
        what: how messages name the spec's kind (e.g. "data_producer").
        returns: what the callable should return, for the fix (e.g. "a DataProducer").

    Raises:
        error: as `import_target`, or the module has no such attribute or it is not callable (the message lists
            the public callables there).
    """
    module = import_target(spec, what=what, error=error, prefix=prefix)
    found = getattr(module, spec.name, None)  # the user's module: probing it is the point
    if not callable(found):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        kind = "no attribute" if found is None else f"a {type(found).__name__}, not a callable, at"
        raise error(
            f"{what} {spec.text!r}: {spec.target} has {kind} {spec.name!r}. Fix: point at a function or class that "
            f"returns {returns} (callables there: {public})."
        )
    return found


def load_file(file_name: str, *, prefix: str, what: str, error: type[Exception]) -> ModuleType:
    """Import the Python file `file_name` as module `<prefix>_<stem>_<hash of its path>`: one stable name per file,
    so loading it again reuses the module and pickling by reference works in the process that loaded it.

    Args:
        file_name: a path, relative to the working directory or absolute.
        prefix: module-name prefix naming the kind of code (e.g. `_async_grpo_reward`).
        what: how error messages name the spec (e.g. "reward function spec 'f.py:fn'").
        error: the exception type raised (the caller's spec error, a ValueError subclass).

    Raises:
        error: the file does not exist, is not loadable as Python, or raised while it was imported (chained).
    """
    path = Path(file_name).resolve()
    if not path.is_file():
        raise error(
            f"{what}: file {str(path)!r} does not exist. Fix: give a path to an existing .py file "
            "(relative to the working directory, or absolute)."
        )
    module_name = f"{prefix}_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what}: cannot load {str(path)!r} as Python.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise error(f"{what}: importing {str(path)!r} failed: {err!r}") from err
    return module


def top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level: functions, classes, assignments, imports (`as` names included)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def check_file_statically(spec: CodeSpec, *, what: str) -> str | None:
    """Check a "file" spec without running it: the file is a regular file reached through no symbolic link, at most
    MAX_STATIC_CHECK_BYTES, parses as Python (`ast.parse`) and binds `spec.name` at its top level. Nothing of the
    file is executed, and a problem never quotes its content (a link could point at a secret).

    Returns:
        None when the checks pass, else the problem (one sentence ending in "Fix: ...").
    """
    path = Path(spec.target)
    absolute = os.path.abspath(spec.target)
    if os.path.realpath(absolute) != absolute:
        return (
            f"{what} {spec.text!r}: {spec.target!r} is or passes through a symbolic link. Fix: copy the file "
            "itself there."
        )
    if not path.is_file():
        return f"{what} {spec.text!r}: {spec.target!r} is not a regular file. Fix: copy the .py file there."
    size = path.stat().st_size
    if size > MAX_STATIC_CHECK_BYTES:
        return (
            f"{what} {spec.text!r}: {spec.target!r} is {size} bytes, larger than {MAX_STATIC_CHECK_BYTES}. "
            "Fix: keep reward, tool and producer files small (import large code from an installed package)."
        )
    try:
        tree = ast.parse(path.read_bytes(), filename=spec.target)
    except SyntaxError as err:
        return f"{what} {spec.text!r}: {spec.target!r} is not valid Python (line {err.lineno}). Fix: correct the file."
    except ValueError:  # NUL bytes
        return f"{what} {spec.text!r}: {spec.target!r} is not a Python source file. Fix: correct the file."
    if spec.name not in top_level_names(tree):
        defined = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        return (
            f"{what} {spec.text!r}: {spec.target!r} defines no {spec.name!r} at its top level. Fix: use one of "
            f"its functions {defined}."
        )
    return None
