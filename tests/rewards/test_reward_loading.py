"""resolve_reward_func / reward_func_name: every spec form and every bad form."""

from pathlib import Path

import pytest

from async_grpo.rewards.loading import RewardSpecError, resolve_reward_func, reward_func_name
from async_grpo.tasks.reverse import reverse_exact_match

FNS = Path(__file__).with_name("reward_fns.py")


def test_builtin_spec_resolves_to_task_function():
    assert resolve_reward_func("builtin:reverse_exact_match") is reverse_exact_match


def test_module_spec_resolves():
    assert resolve_reward_func("async_grpo.tasks.reverse:reverse_format").__name__ == "reverse_format"


def test_file_spec_resolves_and_is_cached_per_file():
    f1 = resolve_reward_func(f"{FNS}:length_reward")
    f2 = resolve_reward_func(f"{FNS}:length_reward")
    assert f1 is f2
    assert f1(prompts=["p"], completions=["abc"], completion_ids=[[1]]) == [3.0]


def test_relative_file_spec(monkeypatch):
    monkeypatch.chdir(FNS.parent)
    assert resolve_reward_func("reward_fns.py:answer_reward").__name__ == "answer_reward"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("reverse_exact_match", "Did you mean 'builtin:reverse_exact_match'"),
        ("builtin:nope", "no builtin reward 'nope'.*builtin:reverse_exact_match"),
        ("no_such_pkg_xyz.mod:f", "cannot import 'no_such_pkg_xyz.mod'"),
        ("async_grpo.tasks.reverse:nope", "has no attribute 'nope'.*reverse_format"),
        ("/no/such/file.py:f", "does not exist"),
        (f"{FNS}:NOT_CALLABLE", "is a int, not a function"),
        (f"{FNS}:", "is not a function name"),
        ("not a module:f", "neither a module name nor a .py file"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, match):
    with pytest.raises(RewardSpecError, match=match):
        resolve_reward_func(spec)


def test_broken_file_raises_spec_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardSpecError, match="importing .*broken.py.* failed"):
        resolve_reward_func(f"{bad}:f")


def test_reward_func_name():
    assert reward_func_name("builtin:reverse_format") == "reverse_format"
    assert reward_func_name("pkg.mod:score") == "score"
    assert reward_func_name("/a/b/c.py:score") == "score"
    with pytest.raises(RewardSpecError):
        reward_func_name("nocolon")
