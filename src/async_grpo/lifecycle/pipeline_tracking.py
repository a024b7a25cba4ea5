"""One MLflow parent run per pipeline run, with a nested run per step, so MLflow's compare view lines up two
scheduled runs.

This is the layout KFP 2.17's MLflow integration gives a pipeline run (a parent run for the KFP run, a nested run per
task, linked by MLflow's `mlflow.parentRunId` tag), built here with `MlflowClient` for clusters without that plugin
and for `kfp.local`. The parent is found again by its `kfp.run_id` tag, so a retried step never opens a second
parent. It holds what a comparison needs: the resolved config as flat params (the same flat TRL names as the
training run's), the evaluation's `final_eval/*` metrics and the gate's decision, under the same names in every
run. The nested runs hold each step's detail: `train` (every training metric, the dataset input, the logged model),
`evaluate` (the head-to-head comparison and its per-prompt table) and `register` (the version and the promotion).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

logger = logging.getLogger(__name__)

KFP_RUN_ID_TAG = "kfp.run_id"
ROLE_TAG = "async_grpo.role"  # "pipeline" on the parent, the step's name on a nested run
MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit for params
MAX_PARAM_CHARS = 500
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment `name`, created when missing (also when another process creates it at the same moment).

    Raises:
        mlflow.exceptions.MlflowException: the tracking server is unreachable or refuses.
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def open_pipeline_run(
    client: MlflowClient, experiment_id: str, run_name: str, kfp_run_id: str, tags: Mapping[str, str] | None = None
) -> str:
    """The parent run of KFP run `kfp_run_id`: the existing one (tag `kfp.run_id`, role `pipeline`) or a new one
    named `run_name`.

    Args:
        client: the tracking client.
        experiment_id: the experiment the runs live in.
        run_name: the pipeline run's name (also the name of its folder).
        kfp_run_id: the KFP run id; "" (a run outside KFP), or anything but letters, digits, `_`, `.` and `-`,
            always opens a new parent.
        tags: more tags for a new parent.

    Returns:
        the parent run's id.

    Raises:
        mlflow.exceptions.MlflowException: the tracking server is unreachable or refuses.
    """
    if _RUN_ID.fullmatch(kfp_run_id):  # a KFP run id is a UUID; anything else is never put into a filter
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{ROLE_TAG}` = 'pipeline' and tags.`{KFP_RUN_ID_TAG}` = '{kfp_run_id}'",
            max_results=1,
        )
        if found:
            return found[0].info.run_id
    all_tags = {ROLE_TAG: "pipeline", KFP_RUN_ID_TAG: kfp_run_id, **(tags or {})}
    run = client.create_run(experiment_id, run_name=run_name, tags={k: v for k, v in all_tags.items() if v})
    logger.info("MLflow parent run %s (%s) for pipeline run %r", run.info.run_id, run_name, kfp_run_id)
    return run.info.run_id


def open_step_run(client: MlflowClient, parent_run_id: str, step: str, tags: Mapping[str, str] | None = None) -> str:
    """A new run nested under `parent_run_id` (MLflow's `mlflow.parentRunId` tag), named `step`.

    Raises:
        mlflow.exceptions.MlflowException: the parent does not exist, or the server is unreachable.
    """
    parent = client.get_run(parent_run_id)
    run = client.create_run(
        parent.info.experiment_id,
        run_name=step,
        tags={MLFLOW_PARENT_RUN_ID: parent_run_id, MLFLOW_RUN_NAME: step, ROLE_TAG: step, **(tags or {})},
    )
    return run.info.run_id


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, str]) -> None:
    """Log `params` (values cut to MAX_PARAM_CHARS, MLflow's limit), in batches of MLflow's size. A param the run
    already holds with another value is kept (MLflow refuses to change one), with a warning."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        try:
            client.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])
        except MlflowException as err:
            logger.warning("MLflow run %s keeps its earlier params (%s)", run_id, str(err).splitlines()[0])


class PipelineRun:
    """The MLflow runs of one pipeline run's train step: the parent, and its nested `train` run.

    It is also a `launch.kubernetes.RunTracking` (`create_run`, `end_run`), so the Kubernetes backend opens both
    only once the platform policy has accepted the run, and a failure marks both. Nothing is created until
    `create_run`.

    Args:
        tracking_uri: the tracking server.
        experiment: the experiment name (created when missing).
        run_name: the pipeline run's name (the parent's name).
        kfp_run_id: the KFP run id (the parent is found again by it).
        params: the resolved config as flat params (`config.flat_params`), logged on the parent.
        tags: more tags for the parent.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        kfp_run_id: str,
        params: Mapping[str, str],
        tags: Mapping[str, str] | None = None,
    ):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.kfp_run_id = kfp_run_id
        self.params = dict(params)
        self.tags = dict(tags or {})
        self.parent_run_id = ""
        self.train_run_id = ""

    def create_run(self, tracking_uri: str = "", experiment_name: str = "", run_name: str = "") -> str:
        """Open (or find) the parent, log the params on it, and open the nested `train` run; returns the train run's
        id. The arguments of `RunTracking.create_run` are ignored: this object's own are used.

        Raises:
            mlflow.exceptions.MlflowException: the tracking server is unreachable or refuses.
        """
        client = MlflowClient(self.tracking_uri)
        experiment_id = ensure_experiment(client, self.experiment)
        self.parent_run_id = open_pipeline_run(client, experiment_id, self.run_name, self.kfp_run_id, self.tags)
        log_params(client, self.parent_run_id, self.params)
        self.train_run_id = open_step_run(client, self.parent_run_id, "train")
        return self.train_run_id

    def end_run(self, tracking_uri: str, run_id: str, status: str) -> None:
        """Mark `run_id` and the parent terminated with `status` (FAILED, KILLED)."""
        client = MlflowClient(self.tracking_uri)
        for run in {run_id, self.parent_run_id} - {""}:
            client.set_terminated(run, status)
