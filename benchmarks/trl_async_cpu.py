"""TRL's AsyncGRPOTrainer on CPU through its seams.

TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer` is GPU-only as shipped: its packed "tree" attention loads
FlashAttention-3 kernels from the Hub, it reads `torch.cuda.get_device_name` for its MFU metric, and its default
weight transfer is NCCL. On a CPU machine this module runs it through the seams it offers, replacing only those three:

- weight transfer: the trainer's `weight_transfer=` constructor argument (TRL's `WeightTransferProtocol`) gets
  `GlooWeightTransfer`, which pushes through OUR gloo backend (`async_grpo.transports.weights.gloo`, created by vLLM's
  `WeightTransferTrainerFactory`) into a real vLLM CPU server, with pause (`/pause?mode=keep`) and resume on vLLM's
  HTTP control plane (`VLLMControlClient`);
- attention: TRL registers its FA3 kernel under `packing.TREE_ATTENTION` ("tree_fa3") in transformers'
  `AttentionInterface` when the trainer is built; `CPUAsyncGRPOTrainer` registers `sdpa_tree_attention` under the
  same name right after, which the model looks up at each forward (`ATTENTION_STAND_IN`);
- MFU: no seam; `trl.experimental.async_grpo.async_grpo_trainer.get_peak_flops_per_device` is replaced by a stub
  returning None while the trainer is constructed (TRL's own "unknown device" answer: `perf/mfu_*` are not logged),
  and restored after (`MFU_STUB`).

Two adaptations of the workload, not of the trainer: the builtin `add` task's prompts are standard text, while the
rollout worker takes conversational prompts only, so each prompt becomes one user message and the `processing_class`
renders it verbatim (`verbatim_chat_tokenizer`): the model sees the same prompt tokens as the other vs_trl systems.
Two fixes of TRL's shutdown, from outside: `AsyncRolloutWorker.stop()` blocks forever once its child has died (the
child's stop watcher was waiting on the `mp.Event` it sets), so `_FailFast` turns a dead rollout worker into an error
in the main thread; and its child cannot exit while the samples and metrics it queued after the last step fill the
pipes (TRL then waits 15 s and terminates it), so `StopRolloutsAtEnd` stops it at train end while emptying its queues.

Everything else is TRL's: its rollout worker (a spawned process posting `/v1/completions` to the server), rollout
queue, staleness filter, tree packing (`TreeRow`), loss, optimizer and weight-sync schedule. The server is started by
OUR launcher (`build_server_command` / `server_env`), so it runs with the same flags as the async-grpo systems.
`trl_async_step_times` runs it on the vs_trl workload (see benchmarks/vs_trl.py). With CUDA present the trainer runs
as shipped (FA3 from the Hub, NCCL, MFU on): that path is untested here.
"""

from __future__ import annotations

import os
import queue
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, TrainerCallback
from transformers.integrations.flash_attention import get_target_dtype
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as trl_async_module
from trl.experimental.async_grpo.packing import TREE_ATTENTION
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from async_grpo.inference.client import VersionedWeightSyncClient, VLLMControlClient
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.runner.resource_sharing import vllm_cpu_threads
from async_grpo.transports.weights.gloo import GlooTrainerInitInfo
from async_grpo.transports.weights.sync import resolve_backend

ATTENTION_STAND_IN = "sdpa stand-in for FA3 varlen"
MFU_STUB = (
    "stubbed: trl.experimental.async_grpo.async_grpo_trainer.get_peak_flops_per_device -> None during __init__ "
    "(perf/mfu_* not logged)"
)
WEIGHT_TRANSFER = "async-grpo gloo backend via AsyncGRPOTrainer(weight_transfer=GlooWeightTransfer)"
PROMPTS = (
    "the add task's standard prompts, each as one user message rendered verbatim by processing_class "
    "(chat template: the message text alone): the same prompt tokens as the other systems"
)
VERBATIM_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# transformers' response parsing (TRL's `parse_response`): the whole completion is the assistant's content
VERBATIM_RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}


def sdpa_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """CPU stand-in for TRL's `packing.tree_attention` (FA3 `flash_attn_varlen_func` over a packed prefix tree), with
    transformers' attention-function signature.

    Segment s of the packed row (rows `tree_cu_seqlens_q[s]:[s+1]`) attends to the K/V rows
    `tree_kv_index[tree_cu_seqlens_k[s]:[s+1]]` (its root-to-segment path, ending with the segment itself), causally
    aligned bottom-right as FA's `causal=True` is when there are more keys than queries: query i of a segment of Lq
    tokens with a path of Lk sees keys j <= i + Lk - Lq. All segments run as one batched
    `scaled_dot_product_attention` call, padded to the longest segment and path.

    Args:
        module: the attention module (its dtype decides the compute dtype, as in TRL: `get_target_dtype`).
        query: (1, H, N, D) over the N packed tokens; key, value: (1, H_kv, N, D) (grouped-query attention allowed).
        attention_mask: ignored (TRL registers no mask for tree attention: None).
        tree_kv_index: (K,) packed positions of the concatenated paths; tree_cu_seqlens_q, tree_cu_seqlens_k:
            (S + 1,) segment and path boundaries; tree_max_seqlen_q, tree_max_seqlen_k: longest segment and path.
        scaling: softmax scale (None: 1/sqrt(D)).
        sliding_window, softcap: unsupported (the benchmark's Qwen2 uses neither).

    Returns:
        ((1, N, H, D) attention output, None), as transformers' attention functions return.

    Raises:
        NotImplementedError: a sliding window or a logit softcap was asked for.
    """
    if sliding_window or softcap:
        raise NotImplementedError("the SDPA tree-attention stand-in has no sliding window or softcap")
    dtype = get_target_dtype(query, module) or query.dtype
    q_all, k_all, v_all = (x[0].to(dtype) for x in (query, key, value))  # (H, N, D), (H_kv, N, D)
    cu_q, cu_k = tree_cu_seqlens_q.long(), tree_cu_seqlens_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]  # (S,)
    i = torch.arange(int(tree_max_seqlen_q), device=query.device)
    j = torch.arange(int(tree_max_seqlen_k), device=query.device)
    q_valid = i[None, :] < len_q[:, None]  # (S, Lq)
    k_valid = j[None, :] < len_k[:, None]  # (S, Lk)
    q_rows = torch.where(q_valid, cu_q[:-1, None] + i[None, :], 0)
    k_rows = tree_kv_index.long()[torch.where(k_valid, cu_k[:-1, None] + j[None, :], 0)]
    mask = (j[None, None, :] <= i[None, :, None] + (len_k - len_q)[:, None, None]) & k_valid[:, None, :]
    mask |= ~q_valid[:, :, None] & (j == 0)  # a padding query sees key 0: no fully masked row (NaN gradients)
    out = F.scaled_dot_product_attention(
        q_all[:, q_rows].transpose(0, 1),  # (S, H, Lq, D)
        k_all[:, k_rows].transpose(0, 1),  # (S, H_kv, Lk, D)
        v_all[:, k_rows].transpose(0, 1),
        attn_mask=mask[:, None],
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[q_valid].unsqueeze(0), None  # segments are contiguous and in order: packed order


class PairsSource(WeightSource):
    """vLLM `WeightSource` over the `(name, tensor)` pairs of one TRL `send_weights(iterator)` call.

    `load(iterator)` takes the pairs (references to the trainer's detached parameters, no copy); `metadata()` and
    iteration then describe and yield exactly those, in order, until the next `load`.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []

    def load(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Take the pairs of one push (TRL's `_streaming_iter`: base-checkpoint names, full tensors)."""
        self.pairs = list(iterator)

    def metadata(self) -> list[ParamMeta]:
        """(name, dtype, shape) of every loaded pair, in order."""
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The loaded pairs, in order (a fresh pass each call)."""
        return iter(self.pairs)


class GlooWeightTransfer:
    """TRL's `WeightTransferProtocol` (init_weight_transfer, pause, send_weights, resume, destroy) over async-grpo's
    gloo weight-transfer backend, for `AsyncGRPOTrainer(weight_transfer=...)`.

    The pushes are real: `init_weight_transfer` joins the server's workers in a gloo group through vLLM's
    `WeightTransferTrainerFactory` (`GlooTrainerInitInfo`; the server must run with `--weight-transfer-config
    '{"backend":"gloo"}'` and our worker extension, as `build_server_command` starts it), and each `send_weights`
    broadcasts every parameter while the server loads it (start, update, finish on the control plane), tagging the
    server's weight version 1, 2, ... Pause is `/pause?mode=keep` (in-flight requests freeze and continue under the new
    weights), resume is `/resume`.

    Args:
        server_url: vLLM base URL (dev mode on).
        timeout_s: rendezvous, control-plane and broadcast timeout (seconds).
        master_address: address of this process that the vLLM workers reach for the rendezvous.

    Attributes:
        pushes: completed `send_weights` calls; push_s: seconds of each (start to finish, without pause/resume).
    """

    def __init__(self, server_url: str, timeout_s: float = 300.0, master_address: str = "127.0.0.1"):
        self.control = VLLMControlClient(server_url, timeout_s=timeout_s)
        self.client = VersionedWeightSyncClient(server_url, timeout=timeout_s)
        self.source = PairsSource()
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.engine = None
        self.pushes = 0
        self.push_s: list[float] = []

    def init_weight_transfer(self) -> None:
        """Rendezvous with the server's workers (TRL calls it once, on train begin, before the first push).

        Raises:
            requests.HTTPError / RuntimeError: the server rejected the handshake or did not join within timeout_s.
        """
        init_info = GlooTrainerInitInfo(
            master_address=self.master_address,
            master_port=free_port(),
            world_size=1 + self.control.world_size(),
            timeout_s=self.timeout_s,
            rank=0,
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(init_info, client=self.client, source=self.source)

    def pause(self) -> None:
        """`/pause?mode=keep` before the weights are swapped in."""
        self.control.pause(mode="keep")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push the `(name, tensor)` pairs of `iterator` (TRL's `_streaming_iter`) and tag the server's weight version.

        Raises:
            RuntimeError: `init_weight_transfer` has not run; errors of the broadcast or the control plane.
        """
        if self.engine is None:
            raise RuntimeError("init_weight_transfer() must run before send_weights()")
        t0 = time.perf_counter()
        self.source.load(iterator)
        self.client.next_version = str(self.pushes + 1)
        try:
            with torch.no_grad():
                self.engine.send_weights()
        finally:
            self.source.pairs = []
        self.pushes += 1
        self.push_s.append(time.perf_counter() - t0)

    def resume(self) -> None:
        """`/resume` after the weights are updated."""
        self.control.resume()

    def destroy(self) -> None:
        """Drop the transfer group (TRL calls it on train end)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def verbatim_chat_tokenizer(model_path: Path):
    """The model's tokenizer with a chat template that renders the messages' text alone (no role markers, no
    generation prompt) and a response template that reads the whole completion as the assistant's content.

    Through it, a standard prompt wrapped as `[{"role": "user", "content": prompt}]` tokenizes exactly as
    `tokenizer(prompt)` does, and a completion parses to its decoded text (special tokens dropped): the work of a
    standard-prompt task for a trainer that takes conversational prompts only.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = VERBATIM_CHAT_TEMPLATE
    tokenizer.response_template = VERBATIM_RESPONSE_TEMPLATE
    return tokenizer


def as_conversational(dataset):
    """`dataset` (a `datasets.Dataset` with a standard-text `prompt` column) with each prompt as one user message;
    the other columns (the reward functions' `answer`) unchanged."""
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})


class StopRolloutsAtEnd(TrainerCallback):
    """At train end, stop AsyncGRPOTrainer's rollout worker (`RolloutWorkerProtocol.stop`) while a thread empties its
    `rollout_buffer` and `metrics_queue`, so the child flushes its queues and exits at once; TRL's own `stop()` in
    its cleanup then has nothing left to do.

    Args:
        trainer: the `AsyncGRPOTrainer` (its `rollout_worker` is read at train end).
        poll_s: the draining thread's pause when both queues are empty (seconds).
    """

    def __init__(self, trainer: AsyncGRPOTrainer, poll_s: float = 0.05):
        self.trainer = trainer
        self.poll_s = poll_s

    def on_train_end(self, *a, **k):
        worker = self.trainer.rollout_worker
        if worker is None:
            return
        done = threading.Event()

        def drain() -> None:  # the child generates ahead of the trainer: dozens of samples can be queued
            while not done.is_set():
                got = False
                for q in (worker.rollout_buffer, worker.metrics_queue):
                    try:
                        q.get_nowait()
                        got = True
                    except queue.Empty:
                        pass
                if not got:
                    done.wait(self.poll_s)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        try:
            worker.stop()  # bounded: TRL joins 15 s, then terminates and kills
        finally:
            done.set()
            thread.join(timeout=1.0)


class RolloutWorkerFailed(RuntimeError):
    """AsyncGRPOTrainer's rollout worker died (or the run passed its deadline) and training did not end by itself."""


class _FailFast:
    """Context manager around `trainer.train()`: raise `RolloutWorkerFailed` in the main thread when `health` (the
    rollout worker's `check_health`, TRL's `RolloutWorkerProtocol`) has been failing for `grace_s` seconds, or when
    `deadline_s` seconds have passed.

    TRL's trainer notices a dead worker itself and raises, but its cleanup then calls `AsyncRolloutWorker.stop()`,
    which blocks forever in `mp.Event.set()` (a multiprocessing condition waits for the dead child's waiter to
    acknowledge). A polling thread (every `poll_s` seconds) interrupts the main thread with SIGUSR1, whose handler
    raises.
    """

    def __init__(self, health, deadline_s: float, grace_s: float = 30.0, poll_s: float = 2.0):
        self.health = health
        self.deadline_s, self.grace_s, self.poll_s = deadline_s, grace_s, poll_s
        self.reason: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()  # no signal once __exit__ has begun restoring the previous handler

    def _raise(self, signum, frame):
        raise RolloutWorkerFailed(self.reason)

    def _watch(self, main_ident: int) -> None:
        t0, failed_at = time.monotonic(), None
        while not self._done.wait(self.poll_s):
            if failed_at is None:
                try:
                    self.health()
                except Exception as err:  # any failure of the worker is reported the same way
                    failed_at, self.reason = time.monotonic(), f"AsyncGRPOTrainer's rollout worker failed: {err}"
            late = time.monotonic() - t0 > self.deadline_s
            if late or (failed_at is not None and time.monotonic() - failed_at > self.grace_s):
                self.reason = self.reason or f"AsyncGRPOTrainer did not finish within {self.deadline_s:.0f} s"
                with self._lock:
                    if not self._done.is_set():
                        signal.pthread_kill(main_ident, signal.SIGUSR1)
                return

    def __enter__(self) -> _FailFast:
        self._previous = signal.signal(signal.SIGUSR1, self._raise)
        threading.Thread(target=self._watch, args=(threading.main_thread().ident,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done.set()
        signal.signal(signal.SIGUSR1, self._previous)


def _no_peak_flops(accelerator, dtype: str) -> None:
    """Stand-in for TRL's `get_peak_flops_per_device`: peak FLOPs unknown (None), so TRL logs no MFU."""
    return None


class CPUAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` for a CPU machine: same arguments; pass `weight_transfer=GlooWeightTransfer(url)`.

    While `AsyncGRPOTrainer.__init__` runs, its module's `get_peak_flops_per_device` (which calls
    `torch.cuda.get_device_name`) is the `_no_peak_flops` stub (`MFU_STUB`); after it, `sdpa_tree_attention` replaces
    the FA3 kernel TRL registered under `TREE_ATTENTION` (`ATTENTION_STAND_IN`). The replacement is process-wide
    (transformers' attention registry is global) and only models built with `attn_implementation="tree_fa3"` use it.
    """

    def __init__(self, *args, **kwargs):
        with mock.patch.object(trl_async_module, "get_peak_flops_per_device", _no_peak_flops):
            super().__init__(*args, **kwargs)
        AttentionInterface.register(TREE_ATTENTION, sdpa_tree_attention)


def trl_async_step_times(model_path: Path, args, out: Path, deadline_s: float = 1800.0) -> dict:
    """Run AsyncGRPOTrainer on the vs_trl workload beside a vLLM server started by our launcher; time its steps.

    Workload (benchmarks/vs_trl.py's `args`): the builtin `add` task's prompts (`as_conversational`, rendered
    verbatim by `verbatim_chat_tokenizer`) and reward functions, `args.generations` completions per prompt of up to
    `args.max_completion` tokens, `args.prompts` x `args.generations` samples per optimizer step (TRL's fixed-count
    batcher, `token_budget=0`: micro-batches of `args.micro` samples, `gradient_accumulation_steps` of them),
    `args.learning_rate`, float32 weights (bf16 autocast with `args.bf16`), `args.threads` torch threads,
    max_staleness 2 with a weight push after every step, at most one step's samples in flight (as the async-grpo
    systems' `max_inflight_groups`; TRL's worker keeps generating while the trainer computes, up to its queue's 1024
    samples, and the trainer drops the stale ones as it reads them), `args.warmup` + `args.steps` steps.
    The server: `build_server_command` (float32, or bfloat16 with `args.bf16`; max-model-len 512; seed 0; gloo, or
    NCCL with CUDA) and `server_env(1)`, on the OMP threads our launcher gives a vLLM CPU server beside a trainer that
    overlaps it (`vllm_cpu_threads("overlap", args.threads)`) unless OMP_NUM_THREADS is set; stopped in a finally.

    Returns:
        `wall_s` (seconds between consecutive step ends, by a callback), `tokens` (prompt + completion tokens trained
        per step: TRL's logged `sample/forwarded_tokens_mean` x `batch/samples_per_step`, exact with equal
        micro-batches), `completion_tokens` (its `batch/trained_tokens_per_step`), `unique_tokens` (its
        `batch/forwarded_tokens_per_step`, after prefix sharing), `stale_dropped` (its
        `sample/dropped_stale_total`), one entry per step (warm-up included), and `info` (what was replaced, the push
        count and the server's final weight version).

    Raises:
        VLLMStartupError: the server did not come up.
        RolloutWorkerFailed: the rollout worker died, or training passed `deadline_s` seconds (see `_FailFast`).
    """
    from async_grpo.tasks import get_task

    cuda = torch.cuda.is_available()
    backend = resolve_backend("auto")
    task = get_task("add")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = build_server_command(
        str(model_path),
        port=port,
        dtype="bfloat16" if args.bf16 else "float32",
        max_model_len=512,
        weight_transfer_backend=backend,
        seed=0,
    )
    env = server_env(1)
    vllm_threads = None if cuda or "OMP_NUM_THREADS" in os.environ else vllm_cpu_threads("overlap", args.threads)
    if vllm_threads is not None:
        env["OMP_NUM_THREADS"] = str(vllm_threads)
    steps: dict[str, list[float]] = {k: [] for k in ("stamps", "tokens", "completion_tokens", "unique_tokens")}
    steps["stale_dropped"] = []

    class Clock(TrainerCallback):
        """Wall-clock stamps at the first step begin and each step end; the per-step token counts TRL logs."""

        def on_step_begin(self, *a, **k):
            if not steps["stamps"]:
                steps["stamps"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            steps["stamps"].append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "batch/samples_per_step" in logs:
                steps["tokens"].append(logs["sample/forwarded_tokens_mean"] * logs["batch/samples_per_step"])
                steps["completion_tokens"].append(logs["batch/trained_tokens_per_step"])
                steps["unique_tokens"].append(logs["batch/forwarded_tokens_per_step"])
                steps["stale_dropped"].append(logs.get("sample/dropped_stale_total") or 0.0)

    torch.set_num_threads(args.threads)
    config = AsyncGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.micro, token_budget=0,
        gradient_accumulation_steps=args.prompts * args.generations // args.micro, num_generations=args.generations,
        max_completion_length=args.max_completion, temperature=1.0, learning_rate=args.learning_rate,
        max_steps=args.warmup + args.steps, logging_steps=1, report_to="none", use_cpu=not cuda, bf16=args.bf16,
        dtype="float32", save_strategy="no", seed=0, vllm_server_base_url=url, max_staleness=2, weight_sync_steps=1,
        max_inflight_tasks=args.prompts * args.generations, vllm_server_timeout=400.0,
    )  # fmt: skip
    server = VLLMServer(command, env, out / "vllm.log", url, 400.0)
    transfer = None if cuda else GlooWeightTransfer(url)
    try:
        server.launch()  # its start-up overlaps building the trainer
        kwargs = dict(
            model=str(model_path),
            reward_funcs=list(task.reward_funcs.values()),
            args=config,
            train_dataset=as_conversational(task.train_dataset(0)),
            processing_class=verbatim_chat_tokenizer(model_path),
            callbacks=[Clock()],
        )
        # On CUDA, as shipped (FA3 tree attention from the Hub, NCCL weight transfer, MFU): untested here.
        trainer = AsyncGRPOTrainer(**kwargs) if cuda else CPUAsyncGRPOTrainer(**kwargs, weight_transfer=transfer)
        trainer.add_callback(StopRolloutsAtEnd(trainer))
        server.wait_until_healthy()
        # A failed child only: a stale heartbeat is TRL's to judge (it raises itself, and then stops a live child).
        with _FailFast(lambda: trainer.rollout_worker.check_health(float("inf")), deadline_s=deadline_s):
            trainer.train()
        server_version = VLLMControlClient(url).weight_version()
    finally:
        server.stop()
    stamps = steps.pop("stamps")
    info = {
        "prompts": PROMPTS,
        "attention": "FA3 varlen (as shipped)" if cuda else ATTENTION_STAND_IN,
        "mfu": "as shipped" if cuda else MFU_STUB,
        "weight_transfer": "TRL's NCCL WeightTransferClient (as shipped)" if cuda else WEIGHT_TRANSFER,
        "batching": f"fixed count (token_budget=0): {args.prompts * args.generations} samples per step",
        "vllm_omp_threads": vllm_threads,
        "gradient_checkpointing": config.gradient_checkpointing,
        "server_weight_version": server_version,
    }
    if transfer is not None:
        info["weight_pushes"] = transfer.pushes
        info["push_s_median"] = statistics.median(transfer.push_s) if transfer.push_s else None
    return {"wall_s": [b - a for a, b in zip(stamps, stamps[1:])], **steps, "info": info}
