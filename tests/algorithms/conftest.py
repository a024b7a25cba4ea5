"""Make ``src/`` importable when the package is not installed in the environment."""

import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[2] / "src"
try:
    import async_grpo  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_SRC))
