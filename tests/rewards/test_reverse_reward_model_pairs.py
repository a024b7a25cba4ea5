"""The pairs `examples/reward_model/build_reverse_reward_model.py` trains the demo's reward model on: every rejected
completion differs from the chosen one, and the order negatives hold exactly the right letters in a wrong order
(what the reward model must learn to see, docs/rewards.md)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

BUILDER = Path(__file__).resolve().parents[2] / "examples" / "reward_model" / "build_reverse_reward_model.py"


def _builder():
    spec = importlib.util.spec_from_file_location("build_reverse_reward_model", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_negatives_are_wrong_and_order_negatives_are_permutations_of_the_answer():
    builder = _builder()
    pairs = builder.make_pairs(4000, seed=0, order_fraction=0.7)
    assert len(pairs) >= 3900  # only palindromes are skipped
    kinds = Counter(kind for *_, kind in pairs)
    assert set(kinds) == {"near", *builder.ORDER_KINDS}
    assert 0.65 < sum(kinds[k] for k in builder.ORDER_KINDS) / len(pairs) < 0.75
    for prompt, chosen, rejected, kind in pairs:
        word = prompt.removeprefix("reverse: ").strip()
        assert chosen == word[::-1] and rejected != chosen
        if kind in builder.ORDER_KINDS:
            assert sorted(rejected) == sorted(chosen), (word, rejected, kind)


def test_the_same_seed_gives_the_same_pairs():
    builder = _builder()
    assert builder.make_pairs(200, seed=3) == builder.make_pairs(200, seed=3) != builder.make_pairs(200, seed=4)
