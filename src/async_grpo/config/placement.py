"""Where generation runs relative to training: how many vLLM servers, and whether they share the trainer's cores
or GPU. Fields of the `inference` section; their own module only to keep `sections.py` short. `inference.replicas`
and `runner.scheduling` implement them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ResourceSharing = Literal["auto", "overlap", "time_slice", "adaptive"]


class InferencePlacementFields(BaseModel):
    """Replicas and resource sharing (mixed into `InferenceConfig`)."""

    vllm_replicas: int = Field(
        1,
        ge=1,
        description="vLLM servers generating for the run (the vLLM Deployment's replicas on Kubernetes; this "
        "many local servers otherwise). Each request goes to the live replica with the fewest requests in flight; "
        "every weight push reaches every replica; a replica that dies is excluded, recovered and rejoins with the "
        "current weights while the others serve.",
    )
    resource_sharing: ResourceSharing = Field(
        "auto",
        description="How generation and training share the machine. `overlap`: vLLM generates the next "
        "groups while the trainer computes (what pays when each has its own GPUs or cores). `time_slice`: vLLM is "
        "paused (mode keep: requests freeze, nothing is lost) while the trainer runs an optimizer step, so each "
        "gets every core in turn instead of both fighting over them; groups are still generated ahead, between "
        "steps, and scored meanwhile (verl's colocated hybrid engine makes the same trade on one GPU). `adaptive` "
        "(CPU): vLLM is never paused; the vLLM CPU servers this run launches compute on half the cores "
        "(OMP_NUM_THREADS), and the trainer's torch threads follow vLLM's activity: the other half while a "
        "generation request is in flight, every core while vLLM is idle, checked before each decoder layer's "
        "forward and backward (metric trainer/reduced_threads_s). `auto`: adaptive when this run launched its vLLM "
        "servers on its own CPU machine and the trainer uses every core (torch_num_threads unset or >= the cores), "
        "else overlap (a trainer held to fewer threads leaves vLLM the other cores; attached servers, Kubernetes "
        "pods and GPUs have their own resources). streaming_min_groups cannot be combined with time_slice.",
    )
