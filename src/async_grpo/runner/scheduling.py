"""Time-slicing one machine between generation and training (`resource_sharing`).

When the trainer and vLLM share cores (one CPU machine) or one GPU, running both at once makes each slower than
taking turns: on 2 cores a trainer step that takes 8.2 s alone took 14-16 s beside a generating vLLM (oversubscribed
threads wait on each other; issue 9). `TimeSlice` pauses every live vLLM replica (`/pause?mode=keep`: requests in
flight freeze and continue later, nothing is dropped) for the duration of an optimizer step and resumes them after,
so the trainer gets every core while it computes and vLLM gets them while the trainer waits for the next batch.
Groups are still generated ahead (max_staleness) and scored during the step by the reward workers. A paused vLLM
CPU server still uses about 0.16 of a core (measured, tiny model), against 1.2-1.5 cores while it generates.
"""

from __future__ import annotations

import logging
import os
import time

import requests

from async_grpo.inference.client import VLLMControlClient
from async_grpo.inference.replicas import ReplicaSet

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0  # one pause / resume call


def resolve_resource_sharing(mode: str, *, launched_here: bool, streaming: bool, trainer_threads: int | None = None,
                             cores: int | None = None, cuda: bool = False) -> str:
    """The mode `auto` stands for; explicit modes are returned as they are.

    `auto` is `time_slice` only when the trainer would compute on the cores vLLM generates on: this run launched its
    vLLM servers on its own CPU machine (no CUDA), does not stream groups into the step, and the trainer uses every
    core (`trainer_threads` None or >= `cores`). A trainer held to fewer threads (`torch_num_threads`, e.g. 1 on 2
    cores: the vLLM CPU worker is pinned to core 0) already leaves vLLM its own core, and overlap wins there (the
    tiny demo: 1.95 steps/s overlapped against 1.51 time-sliced on 2 cores). GPU runs overlap: vLLM and the trainer
    hold separate GPU memory; set `time_slice` yourself when both compute on one GPU.
    """
    if mode != "auto":
        return mode
    cores = cores or len(os.sched_getaffinity(0))
    shares_cores = trainer_threads is None or trainer_threads >= cores
    return "time_slice" if launched_here and not streaming and not cuda and shares_cores else "overlap"


class TimeSlice:
    """A context manager around one optimizer step: pause the live replicas on entry, resume them on exit.

    Args:
        replicas: the run's vLLM replicas.
        enabled: False makes it a no-op (`resource_sharing` resolved to overlap).

    Attributes:
        paused_s: seconds the replicas were paused by the last step (0 when disabled); logged as
            `inference/paused_for_training_s`.
    """

    def __init__(self, replicas: ReplicaSet, enabled: bool):
        self.replicas = replicas
        self.enabled = enabled
        self.paused_s = 0.0
        self._paused: list[VLLMControlClient] = []
        self._t0 = 0.0

    @classmethod
    def for_run(cls, config, replicas: ReplicaSet, launched_here: bool) -> TimeSlice:
        """The run's time slice: enabled when `resource_sharing` resolves to time_slice (logged once)."""
        import torch

        mode = resolve_resource_sharing(config.inference.resource_sharing, launched_here=launched_here,
                                        streaming=config.producer.streaming_min_groups is not None,
                                        trainer_threads=config.optim.torch_num_threads, cuda=torch.cuda.is_available())
        logger.info("resource_sharing=%s -> %s", config.inference.resource_sharing, mode)
        return cls(replicas, mode == "time_slice")

    def __enter__(self) -> TimeSlice:
        if not self.enabled:
            return self
        self._t0 = time.perf_counter()
        for replica in self.replicas.live():
            control = VLLMControlClient(replica.url, timeout_s=CONTROL_TIMEOUT_S)
            try:
                control.pause(mode="keep")
                self._paused.append(control)
            except requests.RequestException as err:  # a dead server is found by the next request or push
                logger.info("time slice: could not pause vLLM at %s: %r", replica.url, err)
        return self

    def __exit__(self, *exc) -> None:
        """Resume every replica paused on entry, whatever the step did (never leaves generation paused)."""
        for control in self._paused:
            try:
                control.resume()
            except requests.RequestException as err:
                logger.warning("time slice: could not resume vLLM at %s: %r", control.base_url, err)
        self._paused = []
        self.paused_s = time.perf_counter() - self._t0 if self.enabled else 0.0
