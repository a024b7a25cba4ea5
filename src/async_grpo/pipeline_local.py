"""Run the whole KFP pipeline on this machine: `kfp.local` with `SubprocessRunner(use_venv=False)`, the `local`
launch backend and a sqlite MLflow store under the output folder.

The pipeline is compiled first and the compiled IR is what runs, so a local run executes the same
file a cluster would get, only with the Kubernetes settings ignored and without the KFP run times the
dataset step takes for `{date}` (kfp 2.17's local runner cannot resolve them; the step uses the clock's UTC
date instead: `build_pipeline(for_kfp_local=True)`); the MLflow store is then read
back to report the run, its held-out reward and the registered model version. Runs may share an
output folder and even a run_name, at the same time: each gets its own kfp.local root, and the
pipeline names its folder and MLflow run with the run id, so neither touches the other's.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import re
import secrets
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "runs/pipeline"
RUN_NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def find_repo_root() -> Path:
    """The async-grpo checkout holding `pipelines/` and `components/` (they are not part of the wheel).

    Looks beside the installed package first (an editable install lives in the checkout), then in the
    working directory and its parents.

    Raises:
        FileNotFoundError: no checkout found; the message says to run from one.
    """
    here = Path(__file__).resolve()
    for candidate in (here.parents[2], Path.cwd(), *Path.cwd().parents):
        if (candidate / "pipelines" / "grpo_pipeline.py").is_file() and (candidate / "components").is_dir():
            return candidate
    raise FileNotFoundError(
        "pipelines/grpo_pipeline.py not found beside the installed package or above the working directory. "
        "Fix: run from a checkout of async-grpo (pip install -e .)."
    )


def import_pipeline_module() -> ModuleType:
    """Import `pipelines.grpo_pipeline` from the checkout (putting the checkout on sys.path if needed)."""
    root = str(find_repo_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("pipelines.grpo_pipeline")


def pipeline_parameters(package_path: str | Path) -> dict[str, dict[str, Any]]:
    """The root input parameters of a compiled pipeline: name -> {"parameterType", "defaultValue", ...}.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a compiled KFP pipeline.
    """
    docs = list(yaml.safe_load_all(Path(package_path).read_text()))
    try:
        return dict(docs[0]["root"]["inputDefinitions"]["parameters"])
    except (IndexError, KeyError, TypeError):
        raise ValueError(f"{package_path} is not a compiled KFP pipeline (no root.inputDefinitions).") from None


KFP_TIME_PLACEHOLDERS = ("{{$.pipeline_job_schedule_time_utc}}", "{{$.pipeline_job_create_time_utc}}")


def check_local_package(package_path: str | Path) -> None:
    """Refuse a compiled pipeline that kfp.local cannot run: one holding the KFP run-time placeholders
    (KFP_TIME_PLACEHOLDERS, as `kfp.dsl` spells them), which kfp 2.17's local runner fails on with an IndexError.

    Raises:
        ValueError: the package holds them; the message names the fix.
    """
    text = Path(package_path).read_text()
    found = [p for p in KFP_TIME_PLACEHOLDERS if p in text]
    if found:
        raise ValueError(
            f"{package_path} passes the KFP run times {found} to its steps, which kfp.local cannot resolve. Fix: "
            "compile it for kfp.local (compile_pipeline(..., for_kfp_local=True)), or let run-local compile it."
        )


@dataclass
class LocalPipelineResult:
    """What a local pipeline run produced; `wall_s` is seconds for the whole pipeline.

    `model_version` is None when the registration gate said no (`decision` says why);
    `champion_version` is the registry's best version after the run (None when there is none).
    """

    run_name: str  # the pipeline's name for the run: the given run_name plus the run id
    mlflow_run_id: str
    tracking_uri: str
    experiment_name: str
    eval_reward: float | None
    decision: str
    registered_model_name: str
    model_version: str | None
    champion_version: str | None
    wall_s: float
    pipeline_root: str
    package_path: str

    @property
    def mlflow_ui_command(self) -> str:
        """The command that opens this store in the MLflow UI."""
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"


def new_invocation_dir(output_dir: str | Path) -> Path:
    """A fresh folder `<output_dir>/kfp-local/<time>-<random>` for one local pipeline run: its compiled IR
    and kfp.local's outputs, so runs sharing `output_dir`, even at the same time, never share a file."""
    path = Path(output_dir).resolve() / "kfp-local" / f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    path.mkdir(parents=True)
    return path


def run_local_pipeline(
    arguments: dict[str, Any] | None = None,
    output_dir: str | Path = DEFAULT_OUTPUT_DIR,
    package_path: str | Path | None = None,
    invocation_dir: str | Path | None = None,
) -> LocalPipelineResult:
    """Compile the CPU pipeline (unless `package_path` is given) and run it with kfp.local on this machine.

    Args:
        arguments: pipeline arguments (see `pipelines/grpo_pipeline.py`); missing ones take the
            pipeline defaults, i.e. the embedded demo config. `work_dir`, `mlflow_tracking_uri` and
            `run_name` default to `output_dir`, `sqlite:///<output_dir>/mlflow.db` and `local-<time>`.
        output_dir: folder for the run folders, the MLflow store (`mlflow.db`, `mlartifacts/`), the
            compiled IR and kfp.local's outputs (`kfp-local/<invocation>/`); reused across runs, also
            concurrent ones, so the registry keeps every version and each run's gate compares against the
            previous champion.
        package_path: a compiled pipeline to run instead of compiling one.
        invocation_dir: this run's folder from `new_invocation_dir` (None: a new one).

    Returns:
        LocalPipelineResult, read back from the MLflow store.

    Raises:
        ValueError: launch_backend other than "local", a run_name that is not a DNS-1123 label, or a package
            compiled for a cluster (`check_local_package`).
        RuntimeError: a pipeline task failed (kfp.local names it; its log is above).
        LookupError: the pipeline finished but its train step left no outputs, or MLflow holds no such run.
    """
    import mlflow
    from kfp import components, local

    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pipeline_root = Path(invocation_dir) if invocation_dir is not None else new_invocation_dir(out)
    if package_path is None:
        package_path = import_pipeline_module().compile_pipeline(
            pipeline_root / "grpo_pipeline_cpu.yaml", gpu=False, for_kfp_local=True
        )
    check_local_package(package_path)
    params = pipeline_parameters(package_path)
    args = dict(arguments or {})
    if args.setdefault("launch_backend", "local") != "local":
        raise ValueError(f"launch_backend={args['launch_backend']!r}: a local pipeline run uses the local backend.")
    args.setdefault("work_dir", str(out))
    args.setdefault("mlflow_tracking_uri", f"sqlite:///{out / 'mlflow.db'}")
    args.setdefault("run_name", "local-" + datetime.now().strftime("%Y%m%d-%H%M%S"))
    if not RUN_NAME_PATTERN.match(args["run_name"]):
        raise ValueError(
            f"run_name={args['run_name']!r} must be lower-case letters, digits and '-', at most 63. "
            "Fix: e.g. run_name=tiny-demo-1."
        )
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ValueError(f"unknown pipeline parameters {unknown}. Fix: use names from {package_path}.")
    experiment = str(args.get("mlflow_experiment_name", params["mlflow_experiment_name"].get("defaultValue")))
    from async_grpo.lifecycle.pipeline_tracking import ensure_experiment
    from async_grpo.tracking import open_store

    tracking_uri = str(args["mlflow_tracking_uri"])
    mlflow.set_tracking_uri(tracking_uri)
    with _exclusive(out / ".mlflow-init.lock"):  # a fresh sqlite store is created (migrated) by one run at a time
        open_store(tracking_uri)  # ... and published whole, so an `mlflow ui` opened on it meanwhile cannot race it
        if tracking_uri.startswith("sqlite:") and mlflow.get_experiment_by_name(experiment) is None:
            # keep artifacts beside the store, not in ./mlruns of whatever folder the command ran from
            ensure_experiment(mlflow.MlflowClient(tracking_uri), experiment, (out / "mlartifacts").as_uri())

    # one kfp.local root per invocation: the train step's outputs found there are this run's, whatever
    # other runs write into the same output folder at the same time
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root), raise_on_error=True)
    pipeline = components.load_component_from_file(str(package_path))
    logger.info("running %s locally as %r (outputs under %s)", package_path, args["run_name"], out)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # the image and GPU settings are the cluster's; the local runner says so for every task
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        pipeline(**args)
    wall_s = time.perf_counter() - start
    return _read_back(
        tracking_uri,
        experiment,
        train_outputs(pipeline_root),
        str(args.get("registered_model_name", params["registered_model_name"].get("defaultValue"))),
        wall_s,
        str(pipeline_root),
        str(package_path),
    )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (created if missing) for the block."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def train_outputs(pipeline_root: str | Path) -> dict[str, Any]:
    """The train step's output parameters (run_name, mlflow_run_id, ...) from its KFP executor output under
    `pipeline_root` (one pipeline run's root).

    Raises:
        LookupError: no train step output, or several (the root holds more than one pipeline run).
    """
    found = sorted(Path(pipeline_root).glob("*/train-grpo/executor_output.json"))
    if len(found) != 1:
        raise LookupError(f"expected one train-grpo executor output under {pipeline_root}, found {len(found)}.")
    return dict(json.loads(found[0].read_text()).get("parameterValues", {}))


def _read_back(
    tracking_uri: str,
    experiment: str,
    outputs: dict[str, Any],
    model_name: str,
    wall_s: float,
    pipeline_root: str,
    package_path: str,
) -> LocalPipelineResult:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri)
    run_id, run_name = outputs.get("mlflow_run_id"), outputs.get("run_name", "")
    try:
        run = client.get_run(run_id) if run_id else None
    except MlflowException:
        run = None
    if run is None:
        raise LookupError(
            f"no MLflow run {run_id!r} (run {run_name!r}) in experiment {experiment!r} at {tracking_uri}."
        )
    versions = [v for v in client.search_model_versions(f"run_id = '{run.info.run_id}'") if v.name == model_name]
    try:
        champion = str(client.get_model_version_by_alias(model_name, "champion").version)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        champion = None
    return LocalPipelineResult(
        run_name=run_name, mlflow_run_id=run.info.run_id, tracking_uri=tracking_uri, experiment_name=experiment,
        eval_reward=run.data.metrics.get("final_eval/reward"), decision=run.data.tags.get("final_eval.decision", ""),
        registered_model_name=model_name, model_version=str(versions[0].version) if versions else None,
        champion_version=champion,
        wall_s=wall_s, pipeline_root=pipeline_root, package_path=package_path,
    )  # fmt: skip
