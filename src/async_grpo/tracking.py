"""MLflow tracking: params, the resolved config, per-step metrics, sample tables and the final model.

A thin layer over `mlflow` (the store is MLflow's own: sqlite under the run folder by default, or
any tracking server). It exists only to name things consistently and to flatten the config.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlflow

from async_grpo.config import GRPOConfig, dump_config

logger = logging.getLogger(__name__)

MAX_PARAM_CHARS = 500


class Tracker:
    """One MLflow run for one training job.

    Args:
        config: the resolved config (logged as params and as `config.yaml`).
        run_id: resume this MLflow run instead of starting a new one (e.g. from a pipeline step).
    """

    def __init__(self, config: GRPOConfig, run_id: str | None = None):
        mlflow.set_tracking_uri(config.tracking_uri)
        if config.mlflow_tracking_uri is None and mlflow.get_experiment_by_name(config.mlflow_experiment_name) is None:
            # keep artifacts beside the sqlite store, not in ./mlruns of whatever folder we were started from
            artifacts = (Path(config.output_dir).resolve() / "mlartifacts").as_uri()
            mlflow.create_experiment(config.mlflow_experiment_name, artifact_location=artifacts)
        mlflow.set_experiment(config.mlflow_experiment_name)
        self.run = mlflow.start_run(run_id=run_id, run_name=config.run_name)
        self.run_id = self.run.info.run_id
        self.tracking_uri = config.tracking_uri
        params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in config.model_dump(mode="json").items()}
        mlflow.log_params(params)
        mlflow.log_text(dump_config(config), "config.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log numeric metrics at `step` (non-finite values are skipped)."""
        clean = {k: float(v) for k, v in metrics.items() if v == v and abs(float(v)) != float("inf")}
        mlflow.log_metrics(clean, step=step)

    def log_completions(self, rows: list[dict], step: int) -> None:
        """A table of sample completions (prompt, completion, reward, advantage...) at `step`."""
        if rows:
            table = {k: [r[k] for r in rows] for k in rows[0]}
            mlflow.log_table(table, artifact_file=f"completions/step_{step:06d}.json")

    def log_text(self, text: str, name: str) -> None:
        """A text artifact."""
        mlflow.log_text(text, name)

    def log_model_dir(self, path: Path) -> None:
        """Upload a saved HF model folder as the `model` artifact."""
        mlflow.log_artifacts(str(path), artifact_path="model")

    def end(self, status: str = "FINISHED") -> None:
        """Close the run with `status` (FINISHED, FAILED or KILLED)."""
        mlflow.end_run(status=status)
