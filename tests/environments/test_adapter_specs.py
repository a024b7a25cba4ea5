"""Adapter specs without the adapters' packages: the prefix split, the syntax checks, and preflight naming a missing
package with the fix (these run whether or not verifiers and openenv-core are installed)."""

from __future__ import annotations

import sys

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.preflight.inputs import check_environment
from async_grpo.user_code import check_adapter_spec, split_adapter


def test_the_prefix_is_split_and_other_specs_are_left_alone():
    assert split_adapter("openenv:pkg.mod:make") == ("openenv", "pkg.mod:make")
    assert split_adapter("verifiers:user-sim") == ("verifiers", "user-sim")
    for spec in ("builtin:guess", "pkg.mod:make", "envs/e.py:make", None):
        assert split_adapter(spec) == (None, spec)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("openenv:", "nothing after openenv:"),
        ("openenv:make", "is not one of"),
        ("openenv:builtin:guess", "an adapter wraps user code"),
        ("verifiers:builtin:guess", "an adapter wraps user code"),
    ],
)
def test_malformed_adapter_specs_are_refused_with_the_forms(spec, words):
    with pytest.raises(ValueError, match=words):
        check_adapter_spec(spec, error=ValueError)
    with pytest.raises(ValueError, match="environment spec"):
        GRPOConfig(model_name_or_path="m", dataset="builtin:guess", environment=spec)


@pytest.mark.parametrize(("package", "spec"), [("openenv", "openenv:mypkg.envs:make"), ("verifiers", "verifiers:x")])
def test_preflight_names_a_missing_package_and_the_fix(monkeypatch, package, spec):
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "mypkg", None)
    monkeypatch.setitem(sys.modules, "mypkg.envs", type(sys)("mypkg.envs"))
    sys.modules["mypkg.envs"].make = lambda: None
    config = GRPOConfig(model_name_or_path="m", dataset="builtin:guess", environment=spec)
    problems, _ = check_environment(config, local=True, row={"prompt": [{"role": "user", "content": "hi"}]})
    text = str(problems)
    assert len(problems) == 1 and "environments.environment" in text and "Fix: install" in text, text
