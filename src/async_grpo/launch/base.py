"""One interface for every place a run can execute: this machine, or a Kubernetes cluster.

The KFP `train_grpo` component and the CLI pick a backend by name and call `launch`; everything
backend-specific (subprocesses, Kubernetes objects) stays behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from async_grpo.config import GRPOConfig


@dataclass
class LaunchResult:
    """What a finished run hands back.

    Attributes:
        mlflow_run_id: the MLflow run holding params, metrics and the model artifact.
        tracking_uri: where that run lives.
        model_dir: path (local or on the shared volume) of the final HF checkpoint, if saved.
        metrics: headline numbers, e.g. `eval/reward` before/after (backend-dependent).
    """

    mlflow_run_id: str
    tracking_uri: str
    model_dir: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LaunchBackend(Protocol):
    """Runs one training job to completion.

    Implementations: `async_grpo.launch.local.LocalBackend` (subprocesses on this machine) and the
    Kubernetes backend (vLLM Deployment + headless Service, reward Deployment, PyTorchJob trainer).
    """

    name: str

    def launch(self, config: GRPOConfig, *, timeout_s: float) -> LaunchResult:
        """Start the run, wait for it (at most `timeout_s` seconds) and clean up.

        Raises:
            TimeoutError: the run did not finish in time (resources are still cleaned up).
            RuntimeError: the run failed; the message carries the reason (and logs where available).
        """
        ...
