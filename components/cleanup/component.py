"""`cleanup`: the pipeline's exit task; runs whether the run succeeded, failed or was stopped.

The backends clean up after themselves on every path they control, but a stopped pipeline kills the
`train_grpo` pod before its `finally` can run; this task then deletes whatever the run left on the
cluster (by run name) and the staged dataset copy on the workspace volume. Outputs (checkpoints,
MLflow data) are never touched.
"""

from typing import Optional

from kfp import dsl

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def cleanup(
    pipeline_status: dsl.PipelineTaskFinalStatus,
    launch_backend: str = "local",
    run_name: str = "",
    pipeline_job_name: str = "",
    work_dir: str = "",
    backend_options: Optional[dict] = None,
) -> str:
    """Delete the run's leftover cluster objects and its staging folder; report what was removed.

    Args:
        pipeline_status: filled in by KFP (state and error of the exit handler's body).
        launch_backend: "local" (nothing outlives the run's own process tree) or "kubernetes"
            (`KubernetesBackend(**backend_options).cleanup(run name)` deletes every object of the run).
        run_name: the run name given to `train_grpo`; empty uses `pipeline_job_name`. Normalised
            exactly as `train_grpo` does (lower case, [a-z0-9-], at most 63 characters).
        pipeline_job_name: the KFP job name (the pipeline passes its placeholder).
        work_dir: the `train_grpo` work_dir; `<work_dir>/<run name>/staging` is deleted.
        backend_options: keyword arguments for the backend's constructor (kubernetes only).

    Returns:
        One line naming the pipeline state and everything removed ("nothing to remove" otherwise).

    Raises:
        ValueError: unknown launch_backend.
        Exception: whatever the Kubernetes API raised while deleting (the task then shows failed).
    """
    import logging
    import re
    import shutil
    from pathlib import Path

    log = logging.getLogger("cleanup")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = re.sub(r"[^a-z0-9-]+", "-", (run_name or pipeline_job_name or "async-grpo").lower())
    name = name.strip("-")[:63].rstrip("-") or "async-grpo"
    log.info("pipeline %s ended %s %s", pipeline_status.pipeline_job_resource_name, pipeline_status.state,
             pipeline_status.error_message or "")

    removed: list[str] = []
    if launch_backend == "kubernetes":
        from async_grpo.launch.kubernetes import KubernetesBackend

        removed += [str(obj) for obj in KubernetesBackend(**(backend_options or {})).cleanup(name)]
    elif launch_backend != "local":
        raise ValueError(f"launch_backend={launch_backend!r} is not one of 'local', 'kubernetes'.")
    if work_dir:
        staging = Path(work_dir) / name / "staging"
        if staging.is_dir():
            shutil.rmtree(staging)
            removed.append(str(staging))
    summary = f"run {name} ({pipeline_status.state}): " + (", ".join(removed) if removed else "nothing to remove")
    log.info(summary)
    return summary
