"""The HTTP contract between the reward service (`server`) and its client (`remote`): paths, bodies, errors.

Both sides import this module and nothing of each other, so the reward image needs no client code and the
trainer needs no server code. Rewards travel as JSON numbers with null for NaN (strict JSON has no NaN), and
failures as `{"reason", "function", "message"}` so the client re-raises the very RewardError subclass the
local pool would have raised, and the orchestrator counts it under the same reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from async_grpo.transports.drops import DropReason
from async_grpo.transports.scorer import RewardBadOutput, RewardError, RewardTimeout, ScoredGroup

REWARD_URL_ENV = "ASYNC_GRPO_REWARD_URL"  # the reward service URL, set in the trainer pod by the kubernetes launcher
HEALTH_PATH = "/health"
FUNCTIONS_PATH = "/v1/reward_functions"
SCORE_PATH = "/v1/score"
# Env var holding the service's bearer token: the server requires `Authorization: Bearer <it>` on every route
# but /health when it is set, and the client sends it (on Kubernetes it comes from the run's tokens Secret).
AUTH_TOKEN_ENV = "ASYNC_GRPO_REWARD_TOKEN"
# Seconds a score request may take beyond reward_timeout_s: JSON, the network, and a short wait for a free
# worker. The server stops waiting after timeout_s + margin; the client waits that long plus the margin again.
REQUEST_MARGIN_S = 10.0

ERRORS: dict[DropReason, type[RewardError]] = {
    cls.reason: cls for cls in (RewardError, RewardBadOutput, RewardTimeout)
}  # the error body's reason -> the RewardError subclass the client re-raises (counted under that reason)


class ScoreRequest(BaseModel):
    """Body of POST /v1/score: one group of G completions (Orchestrator -> Reward service).

    Attributes:
        prompts: G prompts (strings, or message lists for conversational prompts).
        completions: G completions (strings or message lists).
        completion_ids: G lists of completion token ids.
        columns: the dataset's other columns, each a list of G values (keyword arguments of the functions).
        trainer_state: the `trainer_state` fields (`contract.RewardTrainerState`); None: the pool's.
    """

    model_config = ConfigDict(extra="forbid")

    prompts: list[Any] = Field(description="G prompts.")
    completions: list[Any] = Field(description="G completions.")
    completion_ids: list[list[int]] = Field(description="G lists of completion token ids.")
    columns: dict[str, list[Any]] = Field(default_factory=dict, description="Dataset columns, G values each.")
    trainer_state: dict[str, int] | None = Field(None, description="trainer_state fields (global_step, max_steps).")

    @model_validator(mode="after")
    def _check_lengths(self) -> ScoreRequest:
        """Every list holds one entry per completion, and there is at least one completion."""
        g = len(self.completions)
        if g == 0:
            raise ValueError("completions is empty. Fix: send a group of G >= 1 completions.")
        lengths = {
            "prompts": len(self.prompts),
            "completion_ids": len(self.completion_ids),
            **{f"columns.{k}": len(v) for k, v in self.columns.items()},
        }
        bad = {k: n for k, n in lengths.items() if n != g}
        if bad:
            raise ValueError(
                f"{', '.join(f'{k} has {n} entries' for k, n in bad.items())} but completions has {g}. "
                f"Fix: send one entry per completion in every list."
            )
        return self


def encode_rewards(rows: Sequence[Sequence[float]]) -> list[list[float | None]]:
    """(G, F) floats -> JSON-safe rows: NaN (an abstaining function) becomes None (JSON null)."""
    return [[None if math.isnan(v) else v for v in row] for row in rows]


def encode_scored(scored: ScoredGroup) -> dict[str, Any]:
    """A 200 score response's body: {"rewards": G x F numbers or null, "extra": {column: G values},
    "metrics": {name: [values]}, "seconds": {function name: seconds}} (what the functions logged, values
    JSON-encoded, str as the fallback; and each function's wall-clock seconds on the service, `ScoredGroup.seconds`).
    """
    logged = {"extra": dict(scored.extra), "metrics": dict(scored.metrics)}
    seconds = {str(name): float(s) for name, s in scored.seconds.items()}
    return {"rewards": encode_rewards(scored.rows), **json.loads(json.dumps(logged, default=str)), "seconds": seconds}


def decode_scored(body: dict[str, Any], g: int, f: int) -> ScoredGroup:
    """A 200 score response -> `ScoredGroup`. An older service without "extra"/"metrics" logs nothing, one without
    "seconds" measured nothing (`seconds` {}); a "seconds" entry that is not a finite number is left out.

    Raises:
        RewardError: the rewards are not `g` rows of `f` numbers or nulls (see `decode_rewards`).
    """
    extra, metrics = body.get("extra"), body.get("metrics")
    return ScoredGroup(
        decode_rewards(body["rewards"], g, f),
        extra if isinstance(extra, dict) else {},
        metrics if isinstance(metrics, dict) else {},
        decode_seconds(body.get("seconds")),
    )


def decode_seconds(data: Any) -> dict[str, float]:
    """A score response's `seconds` -> {function name: seconds}: its entries with a string key and a finite number
    (not a bool) value; {} when `data` is absent (an older service) or not an object. Never raises: the timings
    are informational (episode traces), so a malformed one must not fail the group."""
    if not isinstance(data, dict):
        return {}
    return {
        name: float(s)
        for name, s in data.items()
        if isinstance(name, str) and isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
    }


def decode_rewards(data: Any, g: int, f: int) -> list[list[float]]:
    """A score response's `rewards` -> (G, F) floats, null back to NaN.

    Raises:
        RewardError: not a list of `g` rows of `f` numbers or nulls (a client/server version mismatch).
    """
    ok = (
        isinstance(data, list)
        and len(data) == g
        and all(
            isinstance(row, list)
            and len(row) == f
            and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in row)
            for row in data
        )
    )
    if not ok:
        raise RewardError(
            f"the reward service answered rewards that are not {g} rows of {f} numbers: {data!r:.200}. "
            "Fix: run the same async-grpo version in the trainer and the reward image."
        )
    return [[math.nan if v is None else float(v) for v in row] for row in data]


def error_body(err: RewardError) -> dict[str, Any]:
    """The JSON body of a failed score request: {"reason", "function", "message"}."""
    return {"reason": err.reason, "function": err.function, "message": str(err)}


def error_from_body(body: Any) -> RewardError | None:
    """The RewardError (subclass chosen by `reason`) an error body describes; None when `body` is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str) or body.get("reason") not in ERRORS:
        return None
    function = body.get("function")
    return ERRORS[body["reason"]](body["message"], function if isinstance(function, str) else None)
