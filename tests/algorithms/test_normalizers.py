"""The normalizer table (`algorithms/normalizers.py`): one row per loss_type, read by every loss path and by the
trainer's streamed step; and the algorithms package's imports run one way (no cycle through LossSettings)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from async_grpo.algorithms import LOSS_NORMALIZERS, LOSS_TYPES, LossSettings
from async_grpo.algorithms.normalizers import sequence_mean, token_mean, token_sum, token_sum_over_max_length

ALGORITHMS = Path(__file__).resolve().parents[2] / "src" / "async_grpo" / "algorithms"


def test_the_table_has_one_row_per_loss_type_with_its_source():
    assert LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")  # TRL 1.16 names, in this order
    assert tuple(LOSS_NORMALIZERS) == LOSS_TYPES
    for loss_type, row in LOSS_NORMALIZERS.items():
        assert "TRL 1.16" in row.source and f"'{loss_type}'" in row.source, loss_type
        assert LossSettings(loss_type=loss_type, epsilon_high=5.0).normalizer is row
    assert [k for k, row in LOSS_NORMALIZERS.items() if row.divides_by_tokens] == ["dapo", "cispo"]
    assert [k for k, row in LOSS_NORMALIZERS.items() if not row.cut_invariant] == ["bnpo"]


def test_aggregations_by_hand():
    # lengths 1 and 3 (T = 4), per-token loss -A_i with A = [1, 2]; L = 8
    per_token = torch.tensor([[-1.0], [-2.0]]).expand(2, 4)
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    assert sequence_mean(per_token, mask, 8).item() == pytest.approx(-1.5)
    assert token_mean(per_token, mask, 8).item() == pytest.approx(-7 / 4)
    assert token_sum_over_max_length(per_token, mask, 8).item() == pytest.approx(-7 / 16)
    assert token_sum(per_token, mask, 8).item() == pytest.approx(-7.0)
    rows = {k: row.aggregate for k, row in LOSS_NORMALIZERS.items()}
    assert rows == {
        "grpo": sequence_mean,
        "bnpo": token_mean,
        "dr_grpo": token_sum_over_max_length,
        "dapo": token_sum,
        "cispo": token_sum,
        "sapo": sequence_mean,
    }


@pytest.mark.parametrize(
    "loss_type, expected",
    [("dapo", 1 / 40), ("cispo", 1 / 40), ("grpo", 1 / 4), ("bnpo", 1 / 4), ("dr_grpo", 1 / 4), ("sapo", 1 / 4)],
)
def test_streamed_scale(loss_type, expected):
    row = LOSS_NORMALIZERS[loss_type]
    assert row.streamed_scale(40.0, 4) == expected
    assert row.streamed_scale(0.0, 0) == 1.0  # clamped at 1, as grpo_loss clamps num_items


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_streamed_metrics_rescale_the_token_sum_policy_loss_only(loss_type):
    metrics = {"policy_loss": 6.0, "kl": 2.0}
    out = LOSS_NORMALIZERS[loss_type].streamed_metrics(metrics, 3.0)
    assert metrics == {"policy_loss": 6.0, "kl": 2.0}  # a new dict
    assert out == {"policy_loss": 2.0 if loss_type in ("dapo", "cispo") else 6.0, "kl": 2.0}


def _imports(path: Path) -> set[str]:
    """The sibling modules `path` imports (relative imports, TYPE_CHECKING blocks included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("async_grpo.algorithms."):
            names.add(node.module.split(".")[2])
    return names


def test_algorithms_modules_import_one_way():
    graph = {p.stem: _imports(p) for p in ALGORITHMS.glob("*.py") if p.stem != "__init__"}
    # the records every loss path shares import no loss module
    for shared in ("settings", "inputs", "normalizers"):
        assert not graph[shared] & {"losses", "fused", "objective"}, (shared, graph[shared])
    seen: dict[str, str] = {}

    def visit(module: str, path: tuple[str, ...]) -> None:
        if seen.get(module) == "done":
            return
        assert seen.get(module) != "open", f"import cycle: {' -> '.join((*path, module))}"
        seen[module] = "open"
        for dep in graph.get(module, ()):
            visit(dep, (*path, module))
        seen[module] = "done"

    for module in graph:
        visit(module, ())
