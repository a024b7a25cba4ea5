"""The policy version moves only once vLLM serves the new weights (regression for shared/repros/bump_before_push.py:
a version bumped before the push stamped groups sent during the push one version too new)."""

from __future__ import annotations

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.trainer.distributed import DistInfo


class RecordingPusher:
    """Stands in for `WeightPusher`: records the version the orchestrator would read while weights load."""

    def __init__(self, recipe: GRPORecipe, fail: bool = False):
        self.recipe, self.fail, self.seen = recipe, fail, []

    def push(self, version: int) -> float:
        self.seen.append((version, self.recipe.version.value))
        if self.fail:
            raise ConnectionError("vLLM went away mid-push")
        return 0.25


def test_the_version_is_bumped_after_the_push_not_before():
    recipe = GRPORecipe(GRPOConfig(), DistInfo())
    recipe.pusher = RecordingPusher(recipe)
    assert recipe.push_weights() == 0.25
    assert recipe.push_weights() == 0.25
    # pushed as v+1 while every reader still saw v (vLLM was serving v until the push finished)
    assert recipe.pusher.seen == [(1, 0), (2, 1)]
    assert recipe.version.value == 2 and recipe.sync_times == [0.25, 0.25]


def test_a_failed_push_leaves_the_version_where_it_was():
    recipe = GRPORecipe(GRPOConfig(), DistInfo())
    recipe.pusher = RecordingPusher(recipe, fail=True)
    with pytest.raises(ConnectionError):
        recipe.push_weights()
    assert recipe.version.value == 0 and recipe.sync_times == []
