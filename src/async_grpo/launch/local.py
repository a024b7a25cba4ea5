"""The local launch backend: every role on this machine, the run itself in `runner`.

`run_local(config)` joins the trainer ranks (torchrun) if there are several, and on rank 0 runs the GRPO recipe
with a vLLM subprocess it starts (or the server at `vllm_url`), and the run's LLM judge and distillation teacher on
vLLM servers of their own when the config names their models; the other ranks follow rank 0. It turns SIGINT
and SIGTERM into a clean stop, and ends every process it started, by PID, whatever happens.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from async_grpo.config import GRPOConfig
from async_grpo.config.sections.peft import lora_server_args
from async_grpo.errors import RunFailedError
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.inference.replicas import attached_endpoints
from async_grpo.inference.server import (
    ServerWatchdog,
    VLLMServer,
    build_server_command,
    free_port,
    server_env,
)
from async_grpo.launch.base import LaunchResult
from async_grpo.preflight import check_config
from async_grpo.rewards.contract import JUDGE_SPEC
from async_grpo.runner import GRPORecipe, RunSummary
from async_grpo.runner.builders import collective_timeout_s
from async_grpo.runner.checkpoints import StopGuard
from async_grpo.runner.follower import run_follower
from async_grpo.runner.resource_sharing import resolve_for_config, vllm_cpu_threads
from async_grpo.trainer.distributed import check_env, close_distributed, init_distributed
from async_grpo.transports.weights.sync import resolve_backend

logger = logging.getLogger(__name__)

_INTERRUPTED = threading.Event()  # set by our SIGINT/SIGTERM handler
_GUARD: StopGuard | None = None  # the running recipe's, with checkpoint_on_signal: a signal waits for the step's end


def _install_signal_handlers() -> None:
    """Turn SIGINT (Ctrl-C), SIGTERM (pod eviction, KFP cancel) and SIGHUP (the terminal closed) into
    KeyboardInterrupt so `finally` blocks clean up, and remember that it happened: a terminal's Ctrl-C also reaches
    the reward workers (the launched vLLM servers lead sessions of their own, `VLLMServer.launch`), which may fail
    an in-flight call with a secondary error before the KeyboardInterrupt surfaces; `run_local` reports such a run
    as interrupted, not failed.
    With `checkpoint_on_signal` a signal during an optimizer step lets the step end first (`StopGuard`), so the
    run stops between steps and writes a checkpoint."""

    def handler(signum, frame):
        _INTERRUPTED.set()
        if _GUARD is not None and not _GUARD.on_signal(signum):
            return  # the step loop raises KeyboardInterrupt at the step's end
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
            signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass


def run_local(config: GRPOConfig, progress: bool = True, *, skip_checks: Iterable[str] = ()) -> RunSummary | None:
    """Run one async GRPO job on this machine (see the module docstring), after `preflight` (every check of the
    config, dataset, reward functions, folders and services that needs nothing started; `skip_checks` names checks
    not to run).

    Returns:
        The run's summary on rank 0; None on trainer ranks > 0 (rank 0 reports the run).

    Raises:
        PreflightError (a ValueError): the inputs failed preflight; nothing was started.
        ValueError: bad dataset / model / reward spec / launch environment, before anything is started.
        VLLMStartupError: vLLM did not come up.
        TimeoutError: the trainer waited longer than rollout_timeout_s for rollouts.
        RuntimeError: the orchestrator failed (its error is chained).
        KeyboardInterrupt: SIGINT or SIGTERM (every child process has been stopped).
    """
    check_config(config, target="local", skip=skip_checks)
    world_size = check_env()
    if world_size > 1 and config.producer.streaming_min_groups is not None:
        raise ValueError(
            f"streaming_min_groups needs a single trainer rank (WORLD_SIZE={world_size}). "
            "Fix: unset streaming_min_groups."
        )
    for noisy in ("httpx", "httpx2", "openai", "urllib3"):  # one INFO line per request would drown the run's logs
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger(noisy).level))
    if config.compute.torch_num_threads:
        torch.set_num_threads(config.compute.torch_num_threads)
    _INTERRUPTED.clear()
    _install_signal_handlers()
    info = init_distributed(collective_timeout_s(config))
    served: list[tuple[VLLMServer, ServerWatchdog | None]] = []  # each watchdog restarts its server if it dies
    try:
        if not info.is_main:
            run_follower(config, info)
            return None
        # rank 0 scores every group (its reward workers ask the judge) and runs the orchestrator (it asks the teacher)
        for start, name in ((start_judge_server, "the LLM judge"), (start_teacher_server, "the teacher")):
            config, server = start(config)
            if server is not None:
                served.append((server, None))  # closed below even if its watchdog does not start
                served[-1] = (server, ServerWatchdog(server, name).start())
        return _run_main(config, GRPORecipe(config, info, progress=progress))
    finally:
        for server, watchdog in reversed(served):
            if watchdog is not None:
                watchdog.close()
            server.close()
        close_distributed()


def local_server_command(
    config: GRPOConfig,
    model: str | Path,
    port: int,
    extra_args: list[str] | None = None,
    *,
    plain: bool = False,
) -> list[str]:
    """The command of a vLLM server this launcher starts on 127.0.0.1:`port` for `model`, with the run's dtype,
    length, weight-transfer backend and seed (`inference.server.build_server_command`).

    Args:
        plain: a server whose weights never change: no weight-transfer flags, no worker extension.
    """
    inf = config.inference
    return build_server_command(
        str(model),
        port=port,
        dtype=inf.vllm_dtype,
        max_model_len=inf.vllm_max_model_len,
        weight_transfer_backend=None if plain else resolve_backend(config.weight_sync.weight_sync_backend),
        seed=config.seed,
        extra_args=extra_args,
    )


def _start_served_model(config: GRPOConfig, model: str, role: str, cmd: list[str], port: int) -> VLLMServer:
    """Start `cmd` (a vLLM server for `model` on 127.0.0.1:`port`) as the run's `role` ("judge", "teacher"), logging
    to `<output_dir>/vllm-<role>.log`, and wait until it is healthy.

    Raises:
        VLLMStartupError: it did not answer /health within vllm_startup_timeout_s.
    """
    inf = config.inference
    env = {**server_env(inf.vllm_kv_cache_gib), **vllm_thread_env(config)}
    log = Path(config.output_dir) / f"vllm-{role}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(cmd, env, log, f"http://127.0.0.1:{port}", inf.vllm_startup_timeout_s)
    logger.info("starting the %s's vLLM server (%s) on port %d; log: %s", role, model, port, log)
    server.start()
    return server


def start_judge_server(config: GRPOConfig) -> tuple[GRPOConfig, VLLMServer | None]:
    """Serve `judge_model_name_or_path` as the run's LLM judge (`builtin:llm_judge`) on a vLLM server of its own
    (log: `<output_dir>/vllm-judge.log`), and return the config with `judge_url` pointing at it, with the server to
    close after the run (`run_local` watches it with a `ServerWatchdog`, which starts it again if it dies).
    Unchanged config and None when the run has no judge model to serve.

    Raises:
        VLLMStartupError: the judge's server did not answer /health within vllm_startup_timeout_s.
    """
    model = config.rewards.judge_model_name_or_path
    if model is None or JUDGE_SPEC not in config.rewards.reward_funcs:
        return config, None
    port = free_port()
    server = _start_served_model(config, model, "judge", local_server_command(config, model, port), port)
    try:
        served = config.model_copy(
            update={"judge_url": f"{server.url}/v1", "judge_model_name_or_path": None, "judge_model": str(model)}
        )
    except BaseException:
        server.close()
        raise
    return served, server


def start_teacher_server(config: GRPOConfig) -> tuple[GRPOConfig, VLLMServer | None]:
    """Serve `teacher_model_name_or_path` as the run's distillation teacher on a vLLM server of its own (log:
    `<output_dir>/vllm-teacher.log`): a plain server (no weight transfer: the teacher's weights never change) whose
    --max-model-len is the policy's (one more would exceed the position limit of a model whose whole context the
    policy uses; the teacher's client cuts the rare sequence that fills it: `distillation.teacher`), and with
    `--max-logprobs K` when top-k distillation asks for more than vLLM's default of 20 (`DistillationConfig.teacher_serve_args`). Returns
    the config with `teacher_url` pointing at it and `teacher_model` naming the model it serves, with the server to
    close after the run (`run_local` watches it with a `ServerWatchdog`, which starts it again if it dies). Unchanged
    config and None when the run has no teacher model to serve.

    Raises:
        VLLMStartupError: the teacher's server did not answer /health within vllm_startup_timeout_s.
    """
    model = config.distillation.teacher_model_name_or_path
    if model is None:
        return config, None
    port = free_port()
    cmd = local_server_command(config, model, port, config.distillation.teacher_serve_args, plain=True)
    server = _start_served_model(config, model, "teacher", cmd, port)
    try:
        served = config.model_copy(
            update={"teacher_url": f"{server.url}/v1", "teacher_model_name_or_path": None, "teacher_model": str(model)}
        )
    except BaseException:
        server.close()
        raise
    return served, server


def vllm_thread_env(config: GRPOConfig) -> dict[str, str]:
    """OMP_NUM_THREADS for the vLLM CPU servers this run launches (`resource_sharing.vllm_cpu_threads` of the resolved
    `resource_sharing`; e.g. 1 of 2 cores under adaptive); {} on GPU, under time_slice, or when the environment
    already sets OMP_NUM_THREADS (the user's choice wins)."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return {}
    n = vllm_cpu_threads(resolve_for_config(config, launched_here=True), config.compute.torch_num_threads)
    return {} if n is None else {"OMP_NUM_THREADS": str(n)}


def _run_main(config: GRPOConfig, recipe: GRPORecipe) -> RunSummary:
    """Rank 0: the recipe, with a vLLM subprocess started at the right moment of its setup. A stop signal
    ends the run between steps with a checkpoint (`checkpoint_on_signal`) and the MLflow run KILLED."""
    global _GUARD
    servers: list[VLLMServer] = []

    def start_inference(model_path: Path) -> list[InferenceEndpoint]:
        inf = config.inference
        if inf.vllm_url:
            return attached_endpoints(inf.vllm_url, inf.vllm_replicas, inf.vllm_startup_timeout_s)
        endpoints = []
        thread_env = vllm_thread_env(config)
        for i in range(inf.vllm_replicas):  # all launched first: their start-ups overlap each other and the model load
            port = inf.vllm_port + i if inf.vllm_port else free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = local_server_command(config, model_path, port, lora_server_args(config) + config.vllm_serve_args)
            log = Path(config.output_dir) / ("vllm.log" if i == 0 else f"vllm-{i}.log")
            env = {**server_env(inf.vllm_kv_cache_gib, runtime_lora=config.peft.vllm_lora_sync), **thread_env}
            server = VLLMServer(cmd, env, log, url, inf.vllm_startup_timeout_s)
            servers.append(server)
            server.launch()
            endpoints.append(
                InferenceEndpoint(
                    url,
                    served_model=str(model_path),
                    launched=True,
                    wait_ready=server.wait_until_healthy,
                    restart=server.restart_if_down,
                )
            )
        return endpoints

    status = "FAILED"
    _GUARD = recipe.guard if config.checkpoint.checkpoint_on_signal else None
    try:
        recipe.setup(start_inference)
        recipe.train()
        summary = recipe.finish()
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"
        recipe.checkpoint_on_stop()  # only between steps, past setup
        raise
    except Exception as err:
        if _INTERRUPTED.is_set():  # a secondary failure caused by the interrupt (see _install_signal_handlers)
            status = "KILLED"
            recipe.checkpoint_on_stop()
            raise KeyboardInterrupt("interrupted") from err
        if isinstance(err, RunFailedError):  # a dependency failed for good: keep the steps done so far
            path = recipe.checkpoint_on_stop()
            if path is not None:
                err.args = (f"{err} (checkpoint: {path}; resume with resume_from_checkpoint=true once fixed)",)
        raise
    finally:
        _GUARD = None
        recipe.guard.disarm()
        recipe.cleanup(status)
        for server in servers:
            server.close()


class LocalBackend:
    """`LaunchBackend` that runs every role on this machine (`run_local`)."""

    name = "local"

    def launch(self, config: GRPOConfig, *, timeout_s: float | None = None) -> LaunchResult:
        """Run `config` here. `timeout_s` is not enforced beyond the run's own per-wait timeouts."""
        summary = run_local(config, progress=True)
        metrics = {f"before/{k}": v for k, v in summary.eval_before.items()}
        metrics.update({f"after/{k}": v for k, v in summary.eval_after.items()})
        return LaunchResult(summary.run_id, summary.tracking_uri, summary.model_dir, metrics)
