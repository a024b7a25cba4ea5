"""The `tracking` section: MLflow: whether the run is tracked (`report_to`, TRL's list forms accepted), where it is
logged (tracking URI, experiment, run name), how often metrics and tables of sample completions are written, and
system metrics."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import policy_list, tenant


class TrackingConfig(Section):
    """MLflow: where the run is logged, and how often."""

    # Which tracker, completion tables and system metrics (TRL / transformers names)
    report_to: Literal["mlflow", "none"] = Field(
        "mlflow",
        description="Where metrics go (transformers name): `mlflow`, or `none` (no tracking; not with "
        "the pipeline, which registers the model from the MLflow run). TRL's list form is accepted: [] or "
        "['none'] is none, ['mlflow'] or 'all' is mlflow; other trackers are refused.",
        json_schema_extra=tenant(),
    )
    log_completions: bool = Field(
        True,
        description="Log a table of sample completions every log_completions_steps "
        "steps (TRL name; TRL's default is false).",
        json_schema_extra=tenant(),
    )
    log_system_metrics: bool = Field(
        False,
        description="Also record CPU, memory, disk, network and GPU use in the MLflow run (MLflow system "
        "metrics; needs psutil, and pynvml for GPUs). MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true turns it on too.",
        json_schema_extra=tenant(),
    )
    # Where the run is logged, and how often
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; None: the MLFLOW_TRACKING_URI environment variable, else "
        "`sqlite:///<output_dir>/mlflow.db`. MLFLOW_RUN_ID in the environment makes the run log into that run.",
        json_schema_extra=policy_list("mlflow_tracking_uris"),
    )
    mlflow_experiment_name: str = Field(
        "async-grpo",
        description="MLflow experiment; at this default the MLFLOW_EXPERIMENT_NAME environment variable wins.",
        json_schema_extra=tenant(),
    )
    run_name: str | None = Field(None, description="MLflow run name.", json_schema_extra=tenant())
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.", json_schema_extra=tenant())
    log_completions_steps: int = Field(
        10, ge=1, description="Log a table of sample completions every N steps.", json_schema_extra=tenant()
    )
    num_completions_to_print: int = Field(
        8, ge=1, description="Rows in each sample-completions table (TRL name).", json_schema_extra=tenant()
    )
    log_traces_steps: int = Field(
        0,
        ge=0,
        description="Every this many steps, log episodes of the step's groups as MLflow traces linked to the run "
        "(one trace per sampled episode: its generation turns with token counts and the policy version, its tool "
        "calls and environment steps with their arguments, results and errors, each reward function's value, and "
        "the group's advantage; the Traces tab of the run), written on the tracker's writer thread; 0 (default): "
        "none. The rollouts record spans only when it is on.",
        json_schema_extra=tenant(),
    )
    log_traces_per_step: int = Field(
        1,
        ge=1,
        description="Groups of a traced step logged as traces (the first ones of the step batch); each gives "
        "num_generations traces, one per episode.",
        json_schema_extra=tenant(),
    )
    log_plots_steps: int = Field(
        50,
        ge=0,
        description="Every this many steps, draw the staleness histogram of the groups trained since the last one "
        "(policy versions between sampling and training, the max_staleness bound marked) as the MLflow artifact "
        "plots/staleness/step_<step>.png, on the tracker's writer thread; 0: none. The end-of-run summary figure "
        "(reward, KL, entropy, staleness and the step's time split against the step) is drawn at the end of every "
        "run as <output_dir>/summary.png and the artifact plots/summary.png.",
        json_schema_extra=tenant(),
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_from_trl(cls, value: Any) -> Any:
        """TRL's forms: a list of integrations, "all", "none", None -> "mlflow" or "none"; others refused."""
        items = [value] if isinstance(value, str) or value is None else list(value)
        names = {str(v).lower() for v in items if v is not None} - {"none"}
        if not names:
            return "none"
        if names <= {"mlflow", "all"}:
            return "mlflow"
        raise ValueError(
            f"report_to={value!r}: only mlflow (or none) is supported, not {sorted(names - {'mlflow', 'all'})}. "
            "Fix: report_to: mlflow."
        )
