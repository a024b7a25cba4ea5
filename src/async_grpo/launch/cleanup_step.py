"""The pipeline's exit step: delete what a run left on the cluster and its staging folder; the body of
`components/cleanup` (whose docstrings tell the design), as a package function.

The run's name carries the KFP run id, so another run given the same name is never touched; outputs (checkpoints,
MLflow data) are never deleted; the staging folder lies on the tenant-writable volume, so a link on the way is
refused, never followed (`async_grpo.shared_volume.remove_tree`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from async_grpo.launch.k8s_policy import check_work_dir, in_cluster_pod
from async_grpo.launch.k8s_settings import DEFAULT_DATA_MOUNT_PATH
from async_grpo.launch.naming import pipeline_run_name
from async_grpo.launch.pipeline_step import check_backend_name
from async_grpo.shared_volume import remove_tree

logger = logging.getLogger(__name__)


def run_cleanup_step(
    *,
    state: str,
    launch_backend: str = "local",
    run_name: str = "",
    pipeline_job_name: str = "",
    pipeline_job_id: str = "",
    work_dir: str = "",
    backend_options: Mapping[str, Any] | None = None,
    trainer_api: str = "",
) -> str:
    """Delete the run's leftover cluster objects (kubernetes) and its staging folder; report what was removed.

    Args:
        state: the pipeline's final state (KFP's `PipelineTaskFinalStatus.state`), for the log.
        launch_backend, run_name, pipeline_job_name, pipeline_job_id, work_dir, backend_options, trainer_api: the
            component's parameters of the same names (`components/cleanup`, whose docstring gives their meaning).

    Returns:
        One line: the run's name, `state`, and what was removed (the deleted cluster objects, then the staging
        folder), or "nothing to remove".

    Raises:
        ValueError: unknown launch_backend.
        PolicyViolation (a ValueError): in a cluster pod, work_dir is not on the workspace volume.
        UnsafeVolumePath (a ValueError): the run's folder or its staging folder is a symbolic link (or not a folder)
            on the shared volume; it is left alone, after the cluster objects were deleted.
        Exception: whatever the Kubernetes API raised while deleting.
    """
    check_backend_name(launch_backend)
    check_work_dir(work_dir)  # in a cluster pod, only a folder on the workspace volume
    name = pipeline_run_name(run_name, pipeline_job_name, pipeline_job_id)
    removed: list[str] = []
    if launch_backend == "kubernetes":
        from async_grpo.launch.k8s_settings import with_trainer_api
        from async_grpo.launch.kubernetes import KubernetesBackend

        options = with_trainer_api(backend_options, trainer_api)
        removed += [str(obj) for obj in KubernetesBackend(settings=options).cleanup(name)]
    if work_dir:  # on the tenant-writable volume: a link on the way is refused, never followed (UnsafeVolumePath)
        staging = Path(work_dir) / name / "staging"
        volume_root = DEFAULT_DATA_MOUNT_PATH if in_cluster_pod() else work_dir
        if remove_tree(staging, root=volume_root):
            removed.append(str(staging))
    summary = f"run {name} ({state}): " + (", ".join(removed) if removed else "nothing to remove")
    logger.info(summary)
    return summary
