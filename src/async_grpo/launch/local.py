"""The main job on one machine: vLLM subprocess + reward worker pool + orchestrator thread + trainer.

`run_training(config)` validates everything cheap first (datasets, tokenizer, reward specs), then
starts vLLM, overlapping its ~30 s startup with the optional supervised warm start, and runs the
async loop: the orchestrator fills the rollout queue while the trainer consumes it and pushes
weights every `vllm_sync_interval` steps. Every child process is ended in `finally`, also on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from async_grpo.config import GRPOConfig, dump_config
from async_grpo.data import encode_prompt, load_prompt_dataset, prompt_columns
from async_grpo.evaluation import evaluate_reward
from async_grpo.inference.client import AsyncVLLMClient, VLLMControlClient
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.orchestrator.batch_shaping import ReplayBuffer, RerollQueue
from async_grpo.orchestrator.orchestrator import Orchestrator, PromptItem, SamplingSettings, cycle_prompts
from async_grpo.orchestrator.producer import ProducerConfig, VLLMProducer, load_data_producer
from async_grpo.rewards.remote import make_reward_pool
from async_grpo.tracking import Tracker
from async_grpo.trainer.distributed import (DataParallelLearner, broadcast_parameters, check_env,
                                            close_distributed, follow, init_distributed, save_pretrained)
from async_grpo.trainer.trainer import GRPOLearner, LossSettings
from async_grpo.transports.messages import TrainBatch
from async_grpo.transports.queue import DropCounter, PolicyVersion, RolloutQueue
from async_grpo.transports.weights.sync import WeightPusher

logger = logging.getLogger(__name__)

PROGRESS_LOG_INTERVAL_S = 15.0  # progress-bar refresh when stderr is a log file or a pipeline step, not a terminal


@dataclass
class RunSummary:
    """What a finished run reports (also printed by the CLI).

    Times are seconds; rates are per second.
    """

    run_id: str
    tracking_uri: str
    output_dir: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    steps: int
    wall_s: float
    train_s: float
    steps_per_s: float
    generation_tokens_per_s: float
    weight_sync_s_mean: float
    weight_syncs: int
    trainer_idle_fraction: float
    dropped_groups: dict[str, int] = field(default_factory=dict)
    model_dir: str | None = None


def _load_items(tokenizer, spec: str, split: str, seed: int, max_prompt_length: int, drops: DropCounter,
                limit: int | None = None) -> list[PromptItem]:
    ds = load_prompt_dataset(spec, split=split, seed=seed)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    items = []
    for row in ds:
        ids = encode_prompt(tokenizer, row["prompt"])
        if len(ids) > max_prompt_length:
            drops.add("prompt_too_long")
            continue
        items.append(PromptItem(row["prompt"], ids, prompt_columns(row)))
    if not items:
        raise ValueError(f"dataset {spec!r} ({split}): no usable prompts (all longer than max_prompt_length?)")
    return items


def _resolve_model_path(config: GRPOConfig) -> Path:
    if config.model_name_or_path == "builtin:tiny":
        from async_grpo.tiny_model import ensure_tiny_model

        return ensure_tiny_model(Path(config.output_dir) / "tiny-model", seed=config.seed)
    path = Path(config.model_name_or_path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model_name_or_path={config.model_name_or_path!r} is not a local HF model folder (no config.json). "
            "Fix: point it at a saved model, or use builtin:tiny."
        )
    return path


def _warm_start(config: GRPOConfig, model, tokenizer) -> float | None:
    if config.warmup_sft_steps == 0:
        return None
    if not config.dataset.startswith("builtin:"):
        raise ValueError("warmup_sft_steps > 0 needs a builtin dataset (it trains on the task's answers). "
                         "Fix: set warmup_sft_steps=0.")
    from async_grpo.tasks import get_task
    from async_grpo.trainer.sft import supervised_warm_start

    task = get_task(config.dataset.removeprefix("builtin:"))
    pairs = [(encode_prompt(tokenizer, p), tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id])
             for p, c in task.sft_examples(config.seed, 4096)]
    return supervised_warm_start(model, pairs, steps=config.warmup_sft_steps,
                                 learning_rate=config.warmup_sft_learning_rate,
                                 pad_token_id=tokenizer.pad_token_id, seed=config.seed)


def _completion_rows(batch, decode_prompt, n: int) -> list[dict]:
    rows = []
    for grp in batch.groups:
        for text, reward, adv in zip(grp.completions, grp.rewards, grp.advantages, strict=True):
            rows.append({"prompt": decode_prompt(grp), "completion": text, "reward": reward, "advantage": adv,
                         "policy_version": grp.policy_version})
            if len(rows) >= n:
                return rows
    return rows


def rendezvous_address(vllm_url: str) -> str:
    """Address the vLLM workers use to reach this trainer's weight-transfer rendezvous.

    For a server on this host (loopback URL) it is 127.0.0.1. Otherwise it is the pod IP (`POD_IP`,
    set from the downward API in the PyTorchJob) or, failing that, this host's resolved hostname.
    """
    import os
    import socket
    from urllib.parse import urlparse

    host = urlparse(vllm_url).hostname or ""
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return "127.0.0.1"
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


_INTERRUPTED = threading.Event()  # set by our SIGINT/SIGTERM handler


def _install_signal_handlers() -> None:
    """Turn SIGINT (Ctrl-C) and SIGTERM (pod eviction, KFP cancel) into KeyboardInterrupt so `finally`
    blocks clean up, and remember that it happened: a terminal's Ctrl-C also reaches the vLLM server,
    which may die first and make the in-flight call fail with a secondary error (e.g. connection refused)
    before the KeyboardInterrupt surfaces; `run_training` reports such a run as interrupted, not failed."""

    def handler(signum, frame):
        _INTERRUPTED.set()
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass


def run_training(config: GRPOConfig, progress: bool = True) -> RunSummary:
    """Run one async GRPO job end to end (see module docstring).

    Raises:
        ValueError: bad dataset / model / reward spec, before anything is started.
        VLLMStartupError: vLLM did not come up.
        TimeoutError: the trainer waited longer than rollout_timeout_s for rollouts.
        RuntimeError: the orchestrator failed (its error is chained).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world_size = check_env()
    if world_size > 1 and config.streaming_min_groups is not None:
        raise ValueError(f"streaming_min_groups needs a single trainer rank (WORLD_SIZE={world_size}). "
                         "Fix: unset streaming_min_groups.")
    if world_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        return _run_follower(config)
    for noisy in ("httpx", "urllib3"):  # one INFO line per generation request would drown the run's own logs
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger(noisy).level))
    t_start = time.perf_counter()
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.resolved.yaml").write_text(dump_config(config))
    torch.manual_seed(config.seed)
    if config.torch_num_threads:
        torch.set_num_threads(config.torch_num_threads)
    _INTERRUPTED.clear()
    _install_signal_handlers()

    # ---- cheap validation first: model folder, tokenizer, datasets, reward functions
    model_path = _resolve_model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    drops = DropCounter()
    train_items = _load_items(tokenizer, config.dataset, "train", config.seed, config.max_prompt_length, drops)
    eval_spec = config.eval_dataset or (config.dataset if config.dataset.startswith("builtin:") else None)
    eval_items = (_load_items(tokenizer, eval_spec, "eval", config.seed, config.max_prompt_length, drops,
                              limit=config.eval_num_prompts) if eval_spec else [])
    reward_pool = make_reward_pool(config)  # the reward service when reward_url / $ASYNC_GRPO_REWARD_URL is set

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    server = None
    tracker = None
    orchestrator = None
    queue = None
    pusher = None
    learner = None
    status = "FAILED"
    info = init_distributed(_collective_timeout_s(config))
    try:
        # ---- start vLLM (or attach), overlapping its startup with the warm start
        if config.vllm_url:
            url = config.vllm_url.rstrip("/")
        else:
            port = config.vllm_port or free_port()
            url = f"http://127.0.0.1:{port}"
            from async_grpo.transports.weights.sync import resolve_backend

            cmd = build_server_command(model_path, port=port, dtype=config.vllm_dtype,
                                       max_model_len=config.vllm_max_model_len,
                                       weight_transfer_backend=resolve_backend(config.weight_sync_backend),
                                       seed=config.seed, extra_args=config.vllm_extra_args)
            server = VLLMServer(cmd, server_env(config.vllm_kv_cache_gib), out_dir / "vllm.log", url,
                                config.vllm_startup_timeout_s)
            server.launch()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        sft_loss = _warm_start(config, model, tokenizer)
        model.to(info.device)
        broadcast_parameters(model)  # every rank starts from rank 0's (warm-started) weights
        learner = build_learner(config, model, tokenizer.pad_token_id)  # shards the model under fsdp
        if info.world_size > 1:
            learner = DataParallelLearner(learner, info)
        if server is not None:
            server.wait_until_healthy()
        served_name = str(model_path) if server is not None else VLLMControlClient(url).models()[0]

        def make_client() -> AsyncVLLMClient:
            return AsyncVLLMClient(url, served_name, timeout_s=config.vllm_request_timeout_s)

        tracker = Tracker(config)
        tracker.log_text(dump_config(config), "config.resolved.yaml")
        version = PolicyVersion(0)
        pusher = WeightPusher(model, url, backend=config.weight_sync_backend, timeout_s=config.weight_sync_timeout_s,
                              master_address=rendezvous_address(url))
        pusher.setup()

        def push(weight_version: int) -> float:
            if isinstance(learner, DataParallelLearner):
                return learner.push_weights(pusher, weight_version)
            return pusher.push(weight_version)

        sync_times: list[float] = []
        if sft_loss is not None:
            tracker.log_metrics({"warmup/sft_loss": sft_loss}, step=0)
        if sft_loss is not None or server is None:
            # serve exactly the trainer's starting weights as version 0 (warm-started, or an attached server
            # whose current weights are unknown)
            sync_times.append(push(version.value))

        # ---- held-out reward before training
        eval_kwargs = dict(max_tokens=config.max_completion_length, num_generations=config.num_generations_eval,
                           temperature=config.temperature if config.eval_temperature is None else config.eval_temperature,
                           seed=config.seed)
        eval_before: dict[str, float] = {}
        if eval_items:
            eval_before, rows = evaluate_reward(make_client(), eval_items, decode, reward_pool, **eval_kwargs)
            tracker.log_metrics(eval_before, step=0)
            tracker.log_completions(rows[: config.num_completions_to_print], step=0)

        # ---- the async loop
        producer_config = ProducerConfig.from_config(config)
        groups_per_step = config.groups_per_step * info.world_size  # TRL: per-device batch x accumulation x ranks
        if config.data_producer:
            producer = load_data_producer(config.data_producer, config, tokenizer)
            producer_config = producer.config
        else:
            chunks_per_step = groups_per_step // (config.streaming_min_groups or groups_per_step)
            queue = RolloutQueue(config.prefetch_depth * config.steps_per_generation * chunks_per_step,
                                 config.max_staleness, drops)
            orchestrator = Orchestrator(
                client_factory=make_client, prompts=cycle_prompts(train_items, config.seed), decode=decode,
                sampling=SamplingSettings(config.num_generations, config.max_completion_length, config.temperature,
                                          config.top_p, config.top_k),
                reward_pool=reward_pool, reward_names=reward_pool.names, reward_weights=reward_pool.weights,
                scale_rewards=config.scale_rewards, multi_objective_aggregation=config.multi_objective_aggregation,
                dynamic_sampling=config.dynamic_sampling, max_gen_batches=config.max_gen_batches,
                groups_per_step=groups_per_step, streaming_min_groups=config.streaming_min_groups,
                steps_per_generation=config.steps_per_generation, rollout_reuse=config.rollout_reuse,
                sync_warmup_rollouts=config.sync_warmup_rollouts,
                max_staleness=config.max_staleness, vllm_sync_interval=config.vllm_sync_interval,
                max_inflight_groups=config.max_inflight_groups, queue=queue, version=version, drops=drops,
                **setup_batch_shaping(config),
            )  # fmt: skip
            producer = VLLMProducer(orchestrator, queue, version, producer_config,
                                    streaming=config.streaming_min_groups is not None)
        if orchestrator is not None:
            orchestrator.start()
        t_train = time.perf_counter()
        idle_s = 0.0
        tokens_per_s: list[float] = []
        bar = tqdm(total=config.max_steps, desc="GRPO", unit="step", disable=not progress,
                   mininterval=0.5 if sys.stderr.isatty() else PROGRESS_LOG_INTERVAL_S)  # sparse lines in logs
        step = 0
        rollouts = 0
        while step < config.max_steps:
            if producer_config.max_rollouts is not None and rollouts >= producer_config.max_rollouts:
                logger.info("max_rollouts=%d reached after %d steps", producer_config.max_rollouts, step)
                break
            t_wait = time.perf_counter()
            depth = queue.depth if queue is not None else 0
            producer.on_rollout_begin(step)
            rollout = producer.produce(model, step, timeout_s=config.rollout_timeout_s)
            producer.on_rollout_end(rollout, step)
            rollouts += 1
            waited = time.perf_counter() - t_wait
            idle_s += waited
            reuse = producer_config.mini_epochs * producer_config.num_iterations
            cache = rollout_old_logps(learner, rollout) if reuse * len(rollout) > 1 else None
            for _epoch in range(producer_config.mini_epochs):
                for index, item in enumerate(rollout):
                    for _ in range(producer_config.num_iterations):
                        if step >= config.max_steps:
                            break
                        t0 = time.perf_counter()
                        metrics = dict(item.metrics)
                        metrics.update(learner.step(item, old_logps=cache[index] if cache else None))
                        if not isinstance(item, TrainBatch):  # streamed: chunk count and waits are known now
                            metrics.update(item.metrics)
                            waited += item.wait_s
                            idle_s += item.wait_s
                        step += 1
                        staleness = [version.value - g.policy_version for g in item.groups]
                        if step % config.vllm_sync_interval == 0 or step == config.max_steps:
                            sync_times.append(push(version.bump()))
                            metrics["weight_sync/seconds"] = sync_times[-1]
                        tokens_per_s.append(metrics.get("generation/tokens_per_s", 0.0))
                        metrics.update({
                            "staleness/mean": sum(staleness) / max(len(staleness), 1),
                            "staleness/max": float(max(staleness, default=0)),
                            "queue/depth": float(depth), "trainer/idle_seconds": waited,
                            "trainer/step_seconds": time.perf_counter() - t0,
                            "policy_version": float(version.value), "rollouts": float(rollouts),
                            "groups": float(len(item.groups)), "trainer/ranks": float(info.world_size),
                            "dropped_groups/total": float(sum(drops.snapshot().values())),
                            **{f"dropped_groups/{k}": float(v) for k, v in drops.snapshot().items()},
                        })  # fmt: skip
                        waited = 0.0
                        if step % config.logging_steps == 0 or step == config.max_steps:
                            tracker.log_metrics(metrics, step=step)
                        if step % config.log_completions_steps == 0:
                            tracker.log_completions(_completion_rows(item, lambda g: decode(g.prompt_ids),
                                                                     config.num_completions_to_print), step=step)
                        bar.update(1)
                        bar.set_postfix(reward=f"{metrics.get('reward', float('nan')):.3f}", v=version.value,
                                        refresh=False)
            if isinstance(learner, DataParallelLearner):
                for item in rollout:
                    learner.forget(item)
        bar.close()
        train_s = time.perf_counter() - t_train
        if orchestrator is not None:
            orchestrator.stop()

        # ---- held-out reward after training (vLLM already serves the final weights)
        eval_after: dict[str, float] = {}
        if eval_items:
            eval_after, rows = evaluate_reward(make_client(), eval_items, decode, reward_pool, **eval_kwargs)
            tracker.log_metrics(eval_after, step=step)
            tracker.log_completions(rows[: config.num_completions_to_print], step=step)
        model_dir = None
        if config.save_model:
            model_dir = out_dir / "final-model"
            state = learner.full_state_dict()  # unsharded (a collective under fsdp)
            save_pretrained(model, state, model_dir)
            tokenizer.save_pretrained(model_dir)
            tracker.log_model_dir(model_dir)
        if isinstance(learner, DataParallelLearner):
            learner.stop()  # the followers leave the process group
        summary = RunSummary(
            run_id=tracker.run_id, tracking_uri=tracker.tracking_uri, output_dir=str(out_dir),
            eval_before=eval_before, eval_after=eval_after, steps=step,
            wall_s=time.perf_counter() - t_start, train_s=train_s, steps_per_s=step / train_s,
            generation_tokens_per_s=sum(tokens_per_s) / max(len(tokens_per_s), 1),
            weight_sync_s_mean=sum(sync_times) / max(len(sync_times), 1), weight_syncs=len(sync_times),
            trainer_idle_fraction=idle_s / train_s, dropped_groups=drops.snapshot(),
            model_dir=str(model_dir) if model_dir else None,
        )  # fmt: skip
        tracker.log_metrics({"summary/steps_per_s": summary.steps_per_s,
                             "summary/trainer_idle_fraction": summary.trainer_idle_fraction,
                             "summary/weight_sync_s_mean": summary.weight_sync_s_mean,
                             "summary/wall_s": summary.wall_s}, step=step)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as err:
        if _INTERRUPTED.is_set():  # a secondary failure caused by the interrupt (see _install_signal_handlers)
            status = "KILLED"
            raise KeyboardInterrupt("interrupted") from err
        raise
    finally:
        if orchestrator is not None:
            orchestrator.stop()
        if isinstance(learner, DataParallelLearner) and status == "FAILED" and not _INTERRUPTED.is_set():
            try:  # release the followers so torchrun sees rank 0's real error, not their collective timeout
                learner.stop()
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
        close_distributed()
        if pusher is not None:
            pusher.close()
        reward_pool.close()
        if server is not None:
            server.stop()
        if tracker is not None:
            tracker.end(status)


def setup_batch_shaping(config: GRPOConfig) -> dict:
    """The orchestrator's optional batch-shaping state from `config`: keyword arguments `replay`
    (a seeded `ReplayBuffer` when replay_buffer_size > 0) and `reroll` (a `RerollQueue` when
    reroll_start_fraction < 1), each None when off."""
    replay = (ReplayBuffer(config.replay_buffer_size, random.Random(config.seed))
              if config.replay_buffer_size > 0 else None)
    start = config.reroll_start_step
    reroll = RerollQueue(start_step=start, max_per_batch=config.reroll_max_groups) if start is not None else None
    return {"replay": replay, "reroll": reroll}


def build_learner(config: GRPOConfig, model, pad_token_id: int) -> GRPOLearner:
    """The `GRPOLearner` for `config` (every rank builds the same one)."""
    return GRPOLearner(
        model, learning_rate=config.learning_rate, weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm, micro_batch_size=config.per_device_train_batch_size,
        pad_token_id=pad_token_id, logprob_chunk_size=config.logprob_chunk_size,
        skip_zero_advantage_batches=config.skip_zero_advantage_batches,
        loss=LossSettings(
            loss_type=config.loss_type, epsilon=config.epsilon, epsilon_high=config.epsilon_high_value,
            beta=config.beta, max_completion_length=config.max_completion_length,
            mask_truncated_completions=config.mask_truncated_completions,
            vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=config.vllm_importance_sampling_mode,
            vllm_importance_sampling_cap=config.vllm_importance_sampling_cap,
            vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
            delta=config.delta, importance_sampling_level=config.importance_sampling_level,
            use_bias_correction_kl=config.use_bias_correction_kl,
            off_policy_mask_threshold=config.off_policy_mask_threshold,
            sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
            top_entropy_quantile=config.top_entropy_quantile,
            replay_recompute_logps=config.replay_recompute_logps,
            temperature=config.temperature, use_liger_kernel=config.use_liger_kernel,
        ),
        fsdp=config.fsdp,
    )  # fmt: skip


def rollout_old_logps(learner, rollout: list) -> list:
    """pi_old for every step batch of a reused rollout, computed before its first update (see
    `GRPOLearner.old_logps`).

    Raises:
        ValueError: a step batch is a stream of chunks (streaming cannot be reused; the config forbids it).
    """
    if not all(isinstance(item, TrainBatch) for item in rollout):
        raise ValueError("a streamed rollout cannot be reused (mini_epochs/num_iterations/steps_per_generation > 1). "
                         "Fix: unset streaming_min_groups.")
    return [learner.old_logps(item) for item in rollout]


def _collective_timeout_s(config: GRPOConfig) -> float:
    """How long trainer ranks > 0 wait on rank 0 in one collective (rank 0 may be starting vLLM, warm-starting,
    evaluating or waiting for rollouts meanwhile)."""
    return max(1800.0, 2 * (config.vllm_startup_timeout_s + config.rollout_timeout_s))


def _run_follower(config: GRPOConfig) -> None:
    """A trainer rank > 0: join the process group, take rank 0's weights, then train on the shards rank 0
    broadcasts until it says stop (see `trainer.distributed`). Returns None; rank 0 reports the run."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(config.seed)
    if config.torch_num_threads:
        torch.set_num_threads(config.torch_num_threads)
    info = init_distributed(_collective_timeout_s(config))
    try:
        model_path = Path(config.output_dir) / "tiny-model" if config.model_name_or_path == "builtin:tiny" \
            else Path(config.model_name_or_path)  # rank 0 built the tiny model before joining the group
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
        model.to(info.device)
        broadcast_parameters(model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        steps = follow(build_learner(config, model, tokenizer.pad_token_id), info)
        logger.info("trainer rank %d: %d steps", info.rank, steps)
        return None
    finally:
        close_distributed()


class LocalBackend:
    """`LaunchBackend` that runs every role on this machine (`run_training`)."""

    name = "local"

    def launch(self, config: GRPOConfig, *, timeout_s: float | None = None) -> "LaunchResult":
        """Run `config` here. `timeout_s` is not enforced beyond the run's own per-wait timeouts."""
        from async_grpo.launch.base import LaunchResult

        summary = run_training(config, progress=True)
        metrics = {f"before/{k}": v for k, v in summary.eval_before.items()}
        metrics.update({f"after/{k}": v for k, v in summary.eval_after.items()})
        return LaunchResult(summary.run_id, summary.tracking_uri, summary.model_dir, metrics)
