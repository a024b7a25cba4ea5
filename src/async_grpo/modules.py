"""Loading user code from a `.py` file (reward functions, tools, data producers), one stable module per file."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module_file(file_name: str, *, prefix: str, what: str, error: type[Exception]) -> ModuleType:
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
        raise error(f"{what}: file {str(path)!r} does not exist. Fix: give a path to an existing .py file "
                    "(relative to the working directory, or absolute).")
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
