"""The runner: one GRPO recipe (`GRPORecipe`: setup, train, save_checkpoint, cleanup) with explicit
`TrainState`, run by every launch backend on trainer rank 0, and the follower loop of the other ranks."""

from async_grpo.runner.recipe import GRPORecipe
from async_grpo.runner.report import RunSummary
from async_grpo.runner.state import TrainState, load_checkpoint, save_checkpoint

__all__ = ["GRPORecipe", "RunSummary", "TrainState", "load_checkpoint", "save_checkpoint"]
