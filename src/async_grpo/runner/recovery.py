"""Recovering a lost inference server in the middle of a run (issue 14: "a dead vLLM").

The orchestrator marks the server lost when a generation request fails at the transport level; the runner's waits
then raise `InferenceLost`, and a weight push that fails for any reason means the same. `recover` brings the server
back (`ReplicaPusher.recover_all` -> `InferenceEndpoint.recover`: the local backend restarts its process; a
Kubernetes Deployment restarts its pod and we wait for `/health`), re-initialises the weight transfer, pushes the
trainer's current weights (a new policy version: the server may hold a half-loaded update or its base weights) and
opens the gate again, so the groups the orchestrator parked meanwhile are generated again instead of being lost.
With several replicas this is the case where none is left: one lost replica among live ones is recovered in the
background by the pusher (`transports.weights.replicas`) and never reaches this module. After
`max_inference_restarts` recoveries the next loss fails the run with a clear message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from async_grpo.errors import RunFailedError
from async_grpo.inference.health import InferenceLost

if TYPE_CHECKING:
    from async_grpo.runner.recipe import GRPORecipe

logger = logging.getLogger(__name__)

T = TypeVar("T")


class InferenceFailedError(RunFailedError):
    """The inference server was lost more than `max_inference_restarts` times, or could not be brought back."""


def surviving_inference_loss(recipe: GRPORecipe, fn: Callable[[], T]) -> T:
    """`fn()`, recovering the server and calling it again each time it raises `InferenceLost` (its waits poll the
    gate; a `StepStream` replays the chunks it already consumed, so a step interrupted this way is redone
    exactly).

    Raises:
        InferenceFailedError: see `recover`.
    """
    while True:
        try:
            return fn()
        except InferenceLost as err:
            recover(recipe, str(err))


def push_surviving_inference_loss(recipe: GRPORecipe) -> float:
    """`recipe.push_weights()`; when the push fails (the server died, or a broadcast or control call failed), the
    server is recovered, which pushes the same weights again. Returns the seconds of the push that succeeded.

    Raises:
        InferenceFailedError: see `recover`.
    """
    try:
        return recipe.push_weights()
    except Exception as err:
        return recover(recipe, f"a weight push failed: {err!r}")


def recover(recipe: GRPORecipe, reason: str) -> float:
    """Bring the lost server back and push the current weights (see the module docstring); returns the push's
    seconds. Logs `inference/restarts`, `inference/recovery_seconds` and `inference/regenerated_groups`.

    Raises:
        InferenceFailedError: this loss is one more than `max_inference_restarts`, or the server did not come back
            (the cause is chained); the message names the server, the reason and the fix.
    """
    config, health = recipe.config, recipe.health
    health.mark_lost(reason)
    limit = config.inference.max_inference_restarts
    url = recipe.replicas.urls
    if health.restarts >= limit:
        raise InferenceFailedError(
            f"the vLLM server at {url} was lost again after {health.restarts} recoveries "
            f"(max_inference_restarts={limit}): {health.reason}. Fix: read {recipe.out_dir / 'vllm.log'} (or the "
            "vLLM pod's log) for the cause, or raise max_inference_restarts"
        )
    t0 = time.perf_counter()
    try:
        recipe.pusher.recover_all(config.inference.vllm_recovery_timeout_s)  # restart / wait, new transfer groups
        seconds = recipe.push_weights()
    except Exception as err:
        raise InferenceFailedError(
            f"the vLLM server at {url} could not be brought back after: {health.reason}. Fix: read "
            f"{recipe.out_dir / 'vllm.log'} (or the vLLM pod's log); raise vllm_recovery_timeout_s if it is only "
            "slow to start"
        ) from err
    health.restored()
    took = time.perf_counter() - t0
    logger.warning(
        "vLLM recovered in %.1f s (recovery %d of at most %d); policy version %d pushed",
        took,
        health.restarts,
        limit,
        recipe.version.value,
    )
    recipe.tracker.log_metrics(
        {
            "inference/restarts": float(health.restarts),
            "inference/recovery_seconds": took,
            "inference/regenerated_groups": float(health.parked_groups),
        },
        step=recipe.step,
    )
    return seconds
