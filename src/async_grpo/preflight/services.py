"""Preflight checks of the services a local run talks to: the MLflow tracking server and the reward service.

Each answers within `SERVICE_TIMEOUT_S` (a few seconds), instead of the minutes a run would wait for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import httpx

from async_grpo.config import GRPOConfig
from async_grpo.preflight.report import Problem
from async_grpo.preflight.static import writable_folder_problem
from async_grpo.rewards.wire import HEALTH_PATH, REWARD_URL_ENV

SERVICE_TIMEOUT_S = 5.0


def _unreachable(url: str, timeout_s: float) -> str | None:
    """None when `url` answers HTTP at all (any status: a login page or a 404 still means it is there);
    else why not."""
    try:
        httpx.get(url, timeout=timeout_s, follow_redirects=False)
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return None


def check_mlflow(config: GRPOConfig, timeout_s: float = SERVICE_TIMEOUT_S) -> list[Problem]:
    """The MLflow tracking URI in effect (`mlflow_tracking_uri`, else MLFLOW_TRACKING_URI): an http(s) server must
    answer within `timeout_s`; a `sqlite:///` or `file:` store must be in a writable folder."""
    if config.tracking.report_to != "mlflow":
        return []
    uri = config.tracking_uri
    field = (
        "tracking.mlflow_tracking_uri" if config.tracking.mlflow_tracking_uri else "MLFLOW_TRACKING_URI (environment)"
    )
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        why = _unreachable(uri.rstrip("/") + HEALTH_PATH, timeout_s)
        if why:
            return [
                Problem(
                    field,
                    f"the MLflow server {uri} did not answer within {timeout_s:g} s ({why})",
                    "start the MLflow server or correct the URI; unset it to log to sqlite under output_dir",
                )
            ]
        return []
    if scheme == "sqlite" and uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent if uri != "sqlite:///:memory:" else None
    elif scheme == "file":
        folder = Path(urlparse(uri).path)
    elif scheme == "" and uri:
        folder = Path(uri)
    else:
        return []
    problem = writable_folder_problem(folder, field) if folder is not None else None
    return [problem] if problem else []


def reward_service_url(config: GRPOConfig) -> str | None:
    """The reward service a local run would use: reward_url, else env ASYNC_GRPO_REWARD_URL, else None."""
    return config.rewards.reward_url or os.environ.get(REWARD_URL_ENV) or None


def check_reward_url(config: GRPOConfig, timeout_s: float = SERVICE_TIMEOUT_S) -> list[Problem]:
    """The reward service of `reward_url` must answer /health within `timeout_s` (the run itself would wait 120 s
    before failing). ASYNC_GRPO_REWARD_URL alone is not probed: the kubernetes launcher sets it for a reward
    Deployment that may still be starting when the trainer does (the run waits for it)."""
    url = config.rewards.reward_url
    if url is None:
        return []
    field = "rewards.reward_url"
    if not url.startswith(("http://", "https://")):
        return [Problem(field, f"{url!r} is not an http(s) URL", "give e.g. http://my-run-reward:8080")]
    why = _unreachable(url.rstrip("/") + HEALTH_PATH, timeout_s)
    if why:
        return [
            Problem(
                field,
                f"the reward service at {url} did not answer within {timeout_s:g} s ({why})",
                "start it (python -m async_grpo.rewards.server CONFIG) or correct the URL; unset it to "
                "score in a local process pool",
            )
        ]
    return []
