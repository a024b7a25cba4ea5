"""`cleanup`: the pipeline's exit task; runs whether the run succeeded, failed or was stopped.

The backends clean up after themselves on every path they control, but a stopped pipeline kills the
`train_grpo` pod before its `finally` can run; this task then deletes whatever the run left on the
cluster (selected by the run's label, each object by its uid) and the staged dataset copy on the
workspace volume. The run's name carries the KFP run id, so another run given the same name is never
touched. Outputs (checkpoints, MLflow data) are never deleted.
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
    pipeline_job_id: str = "",
    work_dir: str = "",
    backend_options: Optional[dict] = None,
    trainer_api: str = "",
) -> str:
    """Delete the run's leftover cluster objects and its staging folder; report what was removed.

    Args:
        pipeline_status: filled in by KFP (state and error of the exit handler's body).
        launch_backend: "local" (nothing outlives the run's own process tree) or "kubernetes"
            (`KubernetesBackend(settings=backend_options).cleanup(run name)` deletes the objects that carry
            the run's label).
        run_name: the run name given to `train_grpo`; the full name is derived exactly as there
            (`async_grpo.launch.naming.pipeline_run_name`, with the KFP run id).
        pipeline_job_name: the KFP job name (the pipeline passes its placeholder).
        pipeline_job_id: the KFP run id (the pipeline passes its placeholder).
        work_dir: the `train_grpo` work_dir; `<work_dir>/<run name>/staging` is deleted.
        backend_options: `ClusterSettings` fields (kubernetes only).
        trainer_api: the kubernetes backend's `trainer_api`, merged into `backend_options` as `train_grpo` does
            (under `trainjob` the run's TrainJob is deleted too); "" leaves `backend_options` to decide.

    Returns:
        One line naming the pipeline state and everything removed ("nothing to remove" otherwise).

    Raises:
        ValueError: unknown launch_backend.
        PolicyViolation (a ValueError): in a cluster pod, work_dir is not on the workspace volume.
        UnsafeVolumePath (a ValueError): the run's folder or its staging folder is a symbolic link (or not a folder)
            on the shared volume; it is left alone, after the cluster objects were deleted (`async_grpo.shared_volume`).
        Exception: whatever the Kubernetes API raised while deleting (the task then shows failed).
    """
    import logging

    from async_grpo.launch.cleanup_step import run_cleanup_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cleanup").info(
        "pipeline %s ended %s %s",
        pipeline_status.pipeline_job_resource_name,
        pipeline_status.state,
        pipeline_status.error_message or "",
    )
    return run_cleanup_step(
        state=pipeline_status.state, launch_backend=launch_backend, run_name=run_name,
        pipeline_job_name=pipeline_job_name, pipeline_job_id=pipeline_job_id, work_dir=work_dir,
        backend_options=backend_options, trainer_api=trainer_api,
    )  # fmt: skip
