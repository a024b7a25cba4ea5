"""The GRPO recipe, in torchtune's shape: `setup` builds every role, `train` runs the step loop,
`save_checkpoint` / `load_checkpoint` move the `TrainState`, `cleanup` ends what setup started.

Every launch backend runs this one recipe on trainer rank 0 (the other ranks run `runner.follower`): the local
backend after starting a vLLM subprocess, the Kubernetes trainer pod against the run's vLLM Service. Setup is
ordered so that everything cheap and checkable (model folder, tokenizer, datasets, reward functions) fails
before anything expensive starts, and vLLM's start-up overlaps the model load and warm start.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from async_grpo import dataset_source
from async_grpo.checkpoint_layout import complete_checkpoints, resolve_resume
from async_grpo.config import GRPOConfig, dump_config
from async_grpo.data import load_prompt_items
from async_grpo.evaluation import evaluate_reward
from async_grpo.inference.client import InferenceEndpoint
from async_grpo.inference.health import InferenceHealth
from async_grpo.inference.replicas import BalancedClient, ReplicaSet
from async_grpo.lifecycle.registry_start import registry_start_of
from async_grpo.orchestrator.producer import RunProducer
from async_grpo.orchestrator.progress import ProducerState
from async_grpo.orchestrator.rollout import Rollout
from async_grpo.rewards.remote import make_reward_pool
from async_grpo.runner import builders, checkpoints, peft_setup, plots, recovery, report, resource_sharing
from async_grpo.runner.collapse import Collapse, CollapseGuard
from async_grpo.runner.memory import memory_metrics
from async_grpo.runner.overlapped_push import OverlappedPush
from async_grpo.runner.plots import StepHistory
from async_grpo.runner.report import RunSummary, completion_rows, pipeline_metrics
from async_grpo.runner.state import TrainState, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from async_grpo.runner.step_time import StepClock
from async_grpo.runner.trainjob_progress import TrainJobProgress
from async_grpo.tracking import Tracker
from async_grpo.trainer.distributed import DistInfo, broadcast_parameters
from async_grpo.trainer.protocol import Learner
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import StepBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.weights.frozen import FrozenSource
from async_grpo.transports.weights.replicas import ReplicaPusher

logger = logging.getLogger(__name__)

PROGRESS_LOG_INTERVAL_S = 15.0  # progress-bar refresh when stderr is a log file or a pipeline step, not a terminal


class GRPORecipe:
    """One async GRPO run on trainer rank 0.

    Args:
        config: the validated run config.
        info: this process's place among the trainer ranks (rank 0).
        progress: show a progress bar.
    """

    def __init__(self, config: GRPOConfig, info: DistInfo, *, progress: bool = True):
        self.config = config
        self.info = info
        self.progress = progress
        self.out_dir = Path(config.output_dir)
        self.drops = DropCounter()
        self.version = PolicyVersion(0)
        self.step = 0
        self.generation_rounds = 0  # `produce` calls trained on (axolotl's rollouts: `max_rollouts`)
        self.sync_times: list[float] = []
        self.tokens_per_s: list[float] = []
        self.idle_s = 0.0
        self.train_s = 0.0
        self.clock = StepClock()  # the time split of each step (`time/*`), restarted when the step loop starts
        self.history = StepHistory()  # what the staleness and summary figures draw (`runner.plots`)
        self.trainjob_progress = TrainJobProgress(config.batch.max_steps)  # started with the step loop
        self.num_tokens = 0  # prompt + completion tokens trained on so far (TRL's num_tokens)
        self.trained_groups = 0  # groups of the step batches trained on (the prompt ledger, `report.prompts_lost`)
        self.eval_before: dict[str, float] = {}
        self.eval_after: dict[str, float] = {}
        self.t_start = time.perf_counter()
        self.scorer = self.tracker = self.learner = self.pusher = None
        self.producer: RunProducer | None = None  # the builtin vLLM orchestrator's, or a user data_producer
        self.replicas: ReplicaSet | None = None  # the vLLM server(s): `vllm_replicas`
        self.health = InferenceHealth()  # lost / available: the orchestrator parks groups, `recovery` restores it
        self.guard = checkpoints.StopGuard(config.checkpoint.checkpoint_signal_grace_s / 2)
        self.resume_from: Path | None = None  # the checkpoint this run resumes from (`resume_from_checkpoint`)
        self.rollout: Rollout | None = None
        self.recovery: recovery.InferenceRecovery | None = None  # built once the pusher and tracker exist
        self.checkpointer: checkpoints.Checkpointer | None = None  # built at the end of setup
        self.push_source: FrozenSource | None = None  # weight_sync_overlap: the pushers' source, frozen per push
        self.overlap: OverlappedPush | None = None  # weight_sync_overlap, where it takes effect (`overlap_off`)
        self.settled_push: dict[str, float] = {}  # a background push's metrics, logged with the next step's
        ckpt = config.checkpoint
        self.collapse = CollapseGuard(ckpt.collapse_reward_drop, ckpt.collapse_window_steps, ckpt.collapse_min_entropy)
        self.rollbacks = 0  # on_collapse rollback: checkpoints gone back to
        self.stopped_by_collapse = False  # on_collapse stop (or rollbacks spent): the step loop ends

    # ------------------------------------------------------------------ setup
    def setup(self, start_inference: Callable[[Path], InferenceEndpoint | list[InferenceEndpoint]]) -> None:
        """Build every role: validate the cheap parts, start inference (`start_inference(model_path)`: one endpoint
        per vLLM replica, which may return before the servers are up), load and warm-start the policy, build the learner, wait for the server,
        open the MLflow run, rendezvous for weight transfer, and build the rollout producer.

        Raises:
            ValueError: bad model folder, dataset, reward spec or data_producer (before inference starts).
            VLLMStartupError: the server did not come up.
        """
        from transformers import AutoTokenizer

        config = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.resolved.yaml").write_text(dump_config(config))
        builders.seed_trainer(config)
        # ---- cheap validation first
        builders.check_warm_start(config)
        model_path = builders.resolve_model_path(config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
        self.train_items = self._items(config.data.dataset, "train")
        record = dataset_source.read_record(config.data.dataset)  # a pipeline-prepared folder says what it holds
        self.config = config = builders.with_epochs_resolved(
            config, len(self.train_items) + self.drops.snapshot().get("prompt_too_long", 0), self.info.world_size
        )  # max_steps=-1: TRL's num_train_epochs
        eval_spec = builders.eval_dataset_spec(config)
        self.eval_items = self._items(eval_spec, "eval", limit=config.data.eval_num_prompts) if eval_spec else []
        self.resume_from = resolve_resume(config.checkpoint.resume_from_checkpoint, self.out_dir)
        self.scorer = make_reward_pool(config)  # the reward service when reward_url / $ASYNC_GRPO_REWARD_URL is set
        self.rollout = builders.build_rollout(
            config, self.scorer, self.tokenizer, self.decode, self.train_items + self.eval_items
        )
        # ---- inference starts; the model loads and warm-starts meanwhile
        self.replicas = ReplicaSet.of(start_inference(model_path))
        model = builders.load_policy(config, model_path)
        sft_threads = resource_sharing.warm_start_threads(
            config.compute.torch_num_threads,
            launched_here=all(r.endpoint.launched for r in self.replicas.replicas),
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            cuda=self.info.device.type == "cuda",
            full_determinism=config.full_determinism,
        )  # nothing generates yet: a trainer held below the cores for vLLM's sake takes them all meanwhile, and one
        # on every core may leave one, whichever is faster with the other processes on them (`FasterThreads`)
        faster = None if sft_threads is None else resource_sharing.FasterThreads(*sft_threads)
        with resource_sharing.torch_threads(sft_threads and sft_threads[0]):
            if faster is not None:
                faster.start()
            warm = (
                None
                if self.resume_from
                else builders.warm_start(
                    config, model, self.tokenizer, self.rollout.tool_schemas, after_step=faster and faster.after_step
                )
            )
        if faster is not None and warm is not None:
            logger.info(
                "warm start: torch threads %s (%s s per 1k padded tokens)",
                faster.chosen, {n: round(1e3 * r, 4) for n, r in faster.rate.items()},
            )  # fmt: skip
        model.to(self.info.device)
        broadcast_parameters(model)  # every rank starts from rank 0's (warm-started) weights
        self.learner: Learner = builders.build_learner(config, model, self.tokenizer.pad_token_id, self.info)
        for replica in self.replicas.replicas:
            replica.endpoint.wait_ready()
        self.served_model = self.replicas.replicas[0].endpoint.model_name()
        self.tracker = Tracker(config, run_id=checkpoints.resumed_run_id(self.resume_from))  # same run on resume
        self.tracker.log_text(dump_config(config), "config.resolved.yaml")
        self.tracker.set_tags(registry_start_of(model_path, config.model_name_or_path).tags())  # the registry parent
        self.tracker.log_dataset(
            config.data.dataset, [item.prompt for item in self.train_items], context="training",
            digest=record.train_digest if record else None, source=record.resolved_uri if record else None,
        )  # fmt: skip
        self.pusher = self.make_pusher()
        self.pusher.setup()
        if warm is not None:
            self.tracker.log_metrics(warm, step=0)
        launched = all(r.endpoint.launched for r in self.replicas.replicas)
        if (
            warm is not None or not launched or peft_setup.push_at_start(config)
        ):  # serve exactly the trainer's starting weights as version 0
            self.sync_times.append(self.pusher.push(self.version.value))  # (warm-started, or attached: unknown)
        self.time_slice = resource_sharing.TimeSlice.for_run(config, self.replicas, launched, self.learner.model)
        if config.weight_sync.weight_sync_overlap:
            why = self.overlap_off()
            if why is None:
                self.overlap = OverlappedPush(self.push_source, self.push_weights, self.overlap_timeout_s())
                logger.info("weight_sync_overlap: each push runs beside the next optimizer step")
            else:
                logger.warning("weight_sync_overlap is off for this run: %s; every push runs in its step", why)
        self.producer = builders.build_producer(
            config, tokenizer=self.tokenizer, train_items=self.train_items, rollout=self.rollout,
            client_factory=self.make_client, reward_names=self.scorer.names, reward_weights=self.scorer.weights,
            version=self.version, drops=self.drops, world_size=self.info.world_size, health=self.health,
        )  # fmt: skip
        self.recovery = recovery.InferenceRecovery(
            health=self.health, replicas=self.replicas, pusher=self.pusher, push_weights=self.push_weights,
            log_metrics=self.tracker.log_metrics, current_step=lambda: self.step,
            current_version=lambda: self.version.value, max_restarts=config.inference.max_inference_restarts,
            recovery_timeout_s=config.inference.vllm_recovery_timeout_s, log_hint=self.out_dir / "vllm.log",
            before_recover=lambda: self.overlap and self.overlap.drain(), stop_signal=lambda: self.guard.pending,
        )  # fmt: skip
        ckpt = config.checkpoint
        self.checkpointer = checkpoints.Checkpointer(
            out_dir=self.out_dir, save_steps=ckpt.save_steps, save_total_limit=ckpt.save_total_limit,
            checkpoint_on_signal=ckpt.checkpoint_on_signal, max_steps=config.batch.max_steps,
            save=self.save_checkpoint, guard=self.guard,
        )  # fmt: skip
        if self.resume_from is not None:  # restore the checkpoint and serve its weights as its policy version
            t0 = time.perf_counter()
            self.load_checkpoint(self.resume_from)
            self.sync_times.append(self.pusher.push(self.version.value))  # vLLM started from the base model
            logger.info(
                "resumed from %s at step %d (policy version %d) in %.1f s",
                self.resume_from, self.step, self.version.value, time.perf_counter() - t0,
            )  # fmt: skip

    def _items(self, spec: str, split: str, limit: int | None = None) -> list:
        items, too_long = load_prompt_items(
            self.tokenizer,
            spec,
            split,
            seed=self.config.seed,
            max_prompt_length=self.config.data.max_prompt_length,
            limit=limit,
            **builders.dataset_options(self.config, split),
        )
        if too_long:
            self.drops.add("prompt_too_long", too_long)
        return items

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped (what reward functions and tables see)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def make_pusher(self) -> ReplicaPusher:
        """A weight pusher from the learner to every vLLM replica (not yet set up; `builders.replica_pusher`).
        Under weight_sync_overlap with full-weight pushes, every replica's pusher reads one `FrozenSource`."""
        inf = self.config.inference
        if self.config.weight_sync.weight_sync_overlap and not self.config.peft.vllm_lora_sync:
            self.push_source = FrozenSource(builders.push_source(self.config, self.learner))
        return ReplicaPusher(
            self.replicas,
            lambda url: builders.replica_pusher(self.config, self.learner, url, self.push_source),
            recovery_timeout_s=inf.vllm_recovery_timeout_s,
            max_restarts=inf.max_inference_restarts,
            parallel=not self.config.compute.fsdp,
        )

    def make_client(self) -> BalancedClient:
        """A generation client over the run's replicas (build it inside the event loop that uses it)."""
        model = peft_setup.request_model(self.config, self.version, self.served_model)  # a LoRA adapter per version
        inf = self.config.inference
        return BalancedClient(
            self.replicas, model, timeout_s=inf.vllm_request_timeout_s, coalesce_window_s=inf.vllm_coalesce_window_s
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rollout: Rollout | None = None, prefix: str = "eval") -> dict[str, float]:
        """Held-out reward at the current step with the run's own rollout (or `rollout`), logged as `<prefix>/*`
        ({} without a held-out set)."""
        if not self.eval_items:
            return {}
        metrics, rows = evaluate_reward(
            rollout or self.rollout, self.make_client, self.eval_items,
            builders.sampling_settings(self.config, evaluation=True), reward_names=self.scorer.names,
            reward_weights=self.scorer.weights, seed=self.config.seed, version=self.version.value,
        )  # fmt: skip
        metrics = {prefix + k.removeprefix("eval"): v for k, v in metrics.items()}
        self.tracker.log_metrics(metrics, step=self.step)
        if rollout is None:  # one table per step: the run's own rollout's
            self.tracker.log_completions(
                rows[: self.config.tracking.num_completions_to_print], step=self.step, folder="eval_completions"
            )
        return metrics

    # ------------------------------------------------------------------ the step loop
    def train(self) -> None:
        """Held-out reward before training, then rollouts and optimizer steps until `max_steps` (or
        `max_rollouts`), pushing weights every `vllm_sync_interval` steps.

        Raises:
            TimeoutError: no rollout within rollout_timeout_s.
            RuntimeError: the orchestrator failed (its error is chained).
        """
        config = self.config
        self.eval_before = {} if self.resume_from else self.evaluate()  # a resumed run measured it before
        if "eval/reward" in self.eval_before:  # the collapse guard's first held-out reward
            self.collapse.observe_eval(
                self.step, self.eval_before["eval/reward"], self.eval_before.get("eval/reward_se", 0.0)
            )
        self.producer.start()
        t_train = time.perf_counter()
        bar = tqdm(
            total=config.batch.max_steps,
            initial=self.step,
            desc="GRPO",
            unit="step",
            disable=not self.progress,
            mininterval=0.5 if sys.stderr.isatty() else PROGRESS_LOG_INTERVAL_S,
        )  # sparse lines in logs
        pconf = self.producer.config
        self.clock = StepClock()
        self.trainjob_progress = TrainJobProgress(config.batch.max_steps)  # a TrainJob's status.trainerStatus
        self.trainjob_progress.start()
        try:
            while self.step < config.batch.max_steps and not self.stopped_by_collapse:
                if pconf.max_rollouts is not None and self.generation_rounds >= pconf.max_rollouts:
                    logger.info("max_rollouts=%d reached after %d steps", pconf.max_rollouts, self.step)
                    break
                t_wait = time.perf_counter()
                depth = self.producer.queue_depth
                with self.clock.phase("wait"):
                    self.producer.on_rollout_begin(self.step)
                    batches = self.recovery.surviving(
                        lambda: self.producer.produce(
                            self.learner.model, self.step, timeout_s=config.producer.rollout_timeout_s
                        ),
                    )
                    self.producer.on_rollout_end(batches, self.step)
                self.generation_rounds += 1
                waited = time.perf_counter() - t_wait
                self.idle_s += waited
                self._train_on_round(batches, depth, waited, bar)
        finally:
            bar.close()
            self.trainjob_progress.stop()  # its last report: where the loop ended
            self.train_s = time.perf_counter() - t_train
            self.producer.stop()  # prefetched batches never trained: counted as `unconsumed_at_end`

    def _train_on_round(self, batches: list[StepBatch], depth: int, waited: float, bar) -> None:
        """Every optimizer step one generation round feeds (the step batches of one `produce` call): mini_epochs x
        step batches x num_iterations (pi_old cached once when the round is trained more than once)."""
        pconf = self.producer.config
        reuse = pconf.mini_epochs * pconf.num_iterations
        with self.clock.phase("compute"):
            cache = [self.learner.old_logps(item) for item in batches] if reuse * len(batches) > 1 else None
        trained: set[int] = set()
        completed = False
        try:
            for _epoch in range(pconf.mini_epochs):
                for index, item in enumerate(batches):
                    for _ in range(pconf.num_iterations):
                        if self.step >= self.config.batch.max_steps or self.stopped_by_collapse:
                            break
                        waited = self._one_step(item, cache[index] if cache else None, depth, waited)
                        if index not in trained:  # the prompt ledger counts a batch's groups once, when first trained
                            trained.add(index)
                            self.trained_groups += len(item.groups)
                        bar.update(1)
                        self.guard.end()  # the step, its metrics and the ledger are complete
                        self.guard.check()  # a stop signal that came during the step: stop now, between steps
            completed = True
        finally:  # batches of this round never trained: max_steps reached inside it, or the run stops
            for index, item in enumerate(batches):
                self.learner.forget(item)
                if index not in trained and item.groups:
                    self.drops.add("unconsumed_at_end" if completed else "shutdown", len(item.groups))

    def _one_step(self, item: StepBatch, old_logps: list | None, depth: int, waited: float) -> float:
        """One optimizer step on `item` (a step batch or a stream of its chunks), its weight push and its
        metrics; returns the idle time still to report (0 once logged)."""
        config = self.config
        t0 = time.perf_counter()
        metrics = dict(item.metrics)
        self.guard.begin()  # a stop signal waits for the step's end (checkpoint_on_signal)
        with self.clock.phase("compute"), self.time_slice:
            metrics.update(self.recovery.surviving(lambda: self.learner.step(item, old_logps=old_logps)))
        metrics.update(item.metrics)  # a streamed step knows its chunk count and waits once it consumed them
        self.clock.move(item.wait_s, source="compute", target="wait")  # a streamed step waited inside the step
        waited += item.wait_s
        self.idle_s += item.wait_s
        self.step += 1
        # replayed groups are old on purpose and exempt from max_staleness: they are counted by replayed_groups
        staleness = [self.version.value - g.policy_version for g in item.groups if not g.replayed]
        if self.step % config.weight_sync.vllm_sync_interval == 0 or self.step == config.batch.max_steps:
            if self.step < config.batch.max_steps:  # full_determinism: what is sampled at it is generated first
                version, timeout_s = self.version.value, config.producer.rollout_timeout_s
                with self.clock.phase("wait"):
                    scheduled = self.recovery.surviving(lambda: self.producer.wait_before_push(version, timeout_s))
                if scheduled is not None:
                    metrics["determinism/wait_seconds"] = scheduled
            with self.clock.phase("push"):
                if self.overlap is None:
                    metrics["weight_sync/seconds"] = self.recovery.push()
                    metrics.update(self.pusher.last_report.metrics())
                else:  # the previous push must end first: at most one in flight, versions in order
                    self.settle_push()
                    self.overlap.start()
        metrics.update(self.replicas.metrics(), **self.time_slice.metrics())  # resource_sharing
        self.tokens_per_s.append(metrics.get("generation/tokens_per_s", 0.0))
        for name, value in report.reward_log_metrics(item.groups).items():  # TRL log_metric, never over ours
            metrics.setdefault(name, value)
        self.num_tokens += report.step_tokens(item.groups)  # TRL num_tokens: prompt + completion, cumulative
        self.producer.mark_trained(item.groups)  # the prompt ledger and the schedule, before any checkpoint
        metrics.update({"num_tokens": float(self.num_tokens), "num_tokens/step": metrics.pop("num_tokens", 0.0)})
        self.scorer.set_trainer_state(global_step=self.step, max_steps=config.batch.max_steps)
        every = builders.eval_every(config)
        if every and self.step % every == 0 and self.step < config.batch.max_steps:  # the last: `finish`
            with self.clock.phase("push"):
                self.settle_push()  # vLLM serves this step's weights
            with self.clock.phase("eval"):
                held_out = self.evaluate()  # held-out reward between pushes, logged as eval/* at this step
            reward = held_out.get("eval/reward")
            se = held_out.get("eval/reward_se", 0.0)
            collapse = self.collapse.observe_eval(self.step, reward, se) if reward is not None else None
            if collapse is not None:
                metrics.update(self.on_collapse(collapse))
        rewards = [r for g in item.groups if not g.replayed for r in g.rewards]
        collapse = self.collapse.observe_step(self.step, rewards, metrics.get("entropy"))
        if collapse is not None:
            metrics.update(self.on_collapse(collapse))
        metrics.update(self.settled_push)  # a background push settled since the last logged step
        self.settled_push = {}
        metrics["groups"] = float(len(item.groups))
        metrics.update(pipeline_metrics(
            staleness, version=self.version.value, depth=depth, waited_s=waited,
            step_s=time.perf_counter() - t0, generation_rounds=self.generation_rounds, world_size=self.info.world_size,
            drops=self.drops.snapshot(),
        ))  # fmt: skip
        logged = self.step % config.tracking.logging_steps == 0 or self.step == config.batch.max_steps
        with self.clock.phase("log"):
            if logged:
                metrics.update(memory_metrics())  # resident memory by role: a slow leak shows as a slope
                self.tracker.log_metrics(metrics, step=self.step)
            if config.tracking.log_completions and self.step % config.tracking.log_completions_steps == 0:
                rows = completion_rows(item.groups, self.decode, config.tracking.num_completions_to_print)
                self.tracker.log_completions(rows, step=self.step)
            traced = config.tracking.log_traces_steps
            if traced and self.step % traced == 0:  # written on the tracker's writer thread
                self.tracker.log_episode_traces(report.episode_traces(
                    item.groups[: config.tracking.log_traces_per_step], step=self.step, version=self.version.value,
                    reward_names=self.scorer.names, decode=self.decode,
                ))  # fmt: skip
        # the step is complete: the save_steps checkpoint, written after the step's metrics were logged so that it
        # keeps those MLflow has not taken yet (`TrainState.unlogged_metrics`); its own seconds and the step's time
        # split (`time/*`, which includes the checkpoint) are logged after it
        saved: dict[str, float] = {}
        if self.checkpointer.due(self.step):
            with self.clock.phase("push"):
                self.settle_push()  # the checkpoint's policy version is the one vLLM serves
        with self.clock.phase("checkpoint"):
            self.checkpointer.after_step(self.step, saved)
        split = self.clock.lap()
        if logged or saved:
            self.tracker.log_metrics({**saved, **(split if logged else {})}, step=self.step)
        self.history.record(self.step, {**metrics, **split}, staleness)
        self.trainjob_progress.update(self.step, metrics)
        every = config.tracking.log_plots_steps
        if every and self.step % every == 0:  # drawn on the tracker's writer thread
            counts, first, last = self.history.take_window(self.step)
            bound = config.off_policy.max_staleness
            self.tracker.log_figure(
                lambda: plots.staleness_figure(counts, first, last, bound), f"plots/staleness/step_{self.step:06d}.png"
            )
        return 0.0

    def on_collapse(self, collapse: Collapse) -> dict[str, float]:
        """Act on a collapse the guard saw (`on_collapse`): log a warning naming the step and the signal; `stop` ends
        the step loop; `rollback` restores the newest checkpoint written at or before the best held-out evaluation
        (`CollapseGuard.rollback_target`), pushes its weights to vLLM as the next policy version and goes on (groups
        sampled before it are corrected like any stale group), until collapse_max_rollbacks are spent or no
        checkpoint is left, then stops. Returns the metrics to log at this step (`collapse/detected`,
        `collapse/threshold`, `collapse/rollbacks`)."""
        ckpt = self.config.checkpoint
        metrics = {"collapse/detected": 1.0, "collapse/threshold": collapse.threshold}
        logger.warning("collapse: %s (on_collapse=%s)", collapse.describe(), ckpt.on_collapse)
        if ckpt.on_collapse == "stop":
            self.stopped_by_collapse = True
            logger.warning("collapse: the run stops at step %d (on_collapse=stop)", self.step)
        elif ckpt.on_collapse == "rollback":
            target = self.collapse.rollback_target(complete_checkpoints(self.out_dir), collapse.step)
            if target is None or self.rollbacks >= ckpt.collapse_max_rollbacks:
                why = "no checkpoint from before it" if target is None else f"{self.rollbacks} rollbacks already"
                logger.warning("collapse: the run stops at step %d (%s)", self.step, why)
                self.stopped_by_collapse = True
            else:
                self.settle_push()
                self.learner.load_state_dict(load_checkpoint(target).learner)
                metrics["collapse/rollback_push_seconds"] = self.recovery.push()
                self.collapse.rolled_back()
                self.rollbacks += 1
                logger.warning(
                    "collapse: rolled back to %s (weights and optimizer) at step %d; vLLM serves it as policy "
                    "version %d", target, self.step, self.version.value,
                )  # fmt: skip
        metrics["collapse/rollbacks"] = float(self.rollbacks)
        return metrics

    def overlap_off(self) -> str | None:
        """Why weight_sync_overlap cannot take effect in this run (None: it can)."""
        config = self.config
        if self.info.world_size > 1:
            return f"{self.info.world_size} trainer ranks gather the weights together in every push"
        if config.peft.vllm_lora_sync:
            return "vllm_lora_sync pushes the adapter as a LoRA module, not the weights"
        if config.full_determinism:
            return "full_determinism orders every push after the groups scheduled before it"
        if self.time_slice is not None and self.time_slice.pauses_inference:
            return "resource_sharing resolved to time_slice: vLLM is paused while the trainer computes"
        return None

    def overlap_timeout_s(self) -> float:
        """The longest a background push may take before `settle_push` gives up on it (seconds): a recovery's
        start-up plus a push's own bound."""
        return self.config.inference.vllm_recovery_timeout_s + 2 * self.config.weight_sync.weight_sync_timeout_s

    def settle_push(self) -> None:
        """Wait for the background push in flight, if any (weight_sync_overlap); its seconds and bytes go to
        `settled_push`, logged with the next logged step. A push that failed is handled as a failed push in the
        step: the server is recovered and the trainer's current weights pushed (`InferenceRecovery.recover`).

        Raises:
            InferenceFailedError: the server could not be recovered (see `InferenceRecovery.recover`).
        """
        if self.overlap is None or not self.overlap.in_flight:
            return
        try:
            seconds = self.overlap.settle()
        except Exception as err:
            seconds = self.recovery.recover(f"a weight push failed: {err!r}")
        self.settled_push = {"weight_sync/seconds": seconds, **self.pusher.last_report.metrics()}

    def push_weights(self) -> float:
        """Send the current weights to vLLM as the next policy version, then bump the shared version; returns the
        push's seconds. The version moves only once vLLM serves the new weights (TRL's async GRPO bumps after
        resume): a group requested during the push is stamped with the version that really samples it, and a
        failed push leaves the version where it was.

        Raises:
            whatever the push raised (vLLM is resumed first by `WeightPusher.push`).
        """
        seconds = self.pusher.push(self.version.value + 1)
        self.version.bump()
        self.sync_times.append(seconds)
        return seconds

    # ------------------------------------------------------------------ the end
    def finish(self) -> RunSummary:
        """Save the final model (before evaluating, so an evaluation failure never loses it), measure the
        held-out reward (vLLM already serves the final weights), and summarize the run."""
        self.settle_push()  # vLLM serves the final weights before they are evaluated
        if self.settled_push:
            self.tracker.log_metrics(self.settled_push, step=self.step)
            self.settled_push = {}
        model_dir = None
        if self.config.checkpoint.save_model:
            model_dir = self.out_dir / "final-model"
            self.learner.save_pretrained(model_dir)
            self.tokenizer.save_pretrained(model_dir)
        self.eval_after = self.evaluate()
        without_tools = self.rollout.without_tools()
        if without_tools is not None:  # the same final model with no tools: what the tools are worth
            self.eval_after.update(self.evaluate(without_tools, prefix="eval_no_tools"))
        if model_dir is not None:
            self.tracker.log_model(model_dir)
        summary_plot = self._save_summary_plot()
        s = RunSummary(
            run_id=self.tracker.run_id, tracking_uri=self.tracker.tracking_uri, output_dir=str(self.out_dir),
            eval_before=self.eval_before, eval_after=self.eval_after, steps=self.step,
            wall_s=time.perf_counter() - self.t_start, train_s=self.train_s,
            steps_per_s=self.step / max(self.train_s, 1e-9),
            generation_tokens_per_s=sum(self.tokens_per_s) / max(len(self.tokens_per_s), 1),
            weight_sync_s_mean=sum(self.sync_times) / max(len(self.sync_times), 1), weight_syncs=len(self.sync_times),
            trainer_idle_fraction=self.idle_s / max(self.train_s, 1e-9), dropped_groups=self.drops.snapshot(),
            model_dir=str(model_dir) if model_dir else None, prompts_lost=self._prompts_lost(),
            summary_plot=str(summary_plot) if summary_plot else None,
        )  # fmt: skip
        self.tracker.log_metrics(
            {
                "summary/steps_per_s": s.steps_per_s,
                "summary/trainer_idle_fraction": s.trainer_idle_fraction,
                "summary/weight_sync_s_mean": s.weight_sync_s_mean,
                "summary/wall_s": s.wall_s,
                "summary/prompts_lost": s.prompts_lost,
                "summary/inference_restarts": self.health.restarts,
            },
            step=self.step,
        )
        return s

    def _save_summary_plot(self) -> Path | None:
        """Draw the end-of-run figure (`plots.summary_figure`) to `<output_dir>/summary.png` and log it as
        `plots/summary.png`; None (logged) when there is no step to draw or the file cannot be written."""
        if not self.history.steps:
            return None
        for step, held_out in ((0, self.eval_before), (self.step, self.eval_after)):
            if "eval/reward" in held_out:  # measured outside the step loop: the first and the last point
                self.history.record_eval(step, held_out["eval/reward"])
        path = self.out_dir / "summary.png"
        title = f"{self.config.tracking.run_name or self.out_dir.name}: {self.step} steps"
        try:
            plots.summary_figure(self.history, title).savefig(path, dpi=100)
        except OSError as err:
            logger.warning("the summary figure was not written to %s (%s)", path, err)
            return None
        self.tracker.log_artifact(path, "plots")
        return path

    # ------------------------------------------------------------------ state and checkpoints
    def state(self) -> TrainState:
        """The run's `TrainState` now (between steps)."""
        producer = self.producer.state_dict(self.version.value, self.config.producer.rollout_timeout_s)
        return TrainState(
            step=self.step, policy_version=self.version.value, generation_rounds=self.generation_rounds,
            learner=self.learner.state_dict(), rng=capture_rng(),
            sampler=producer.sampler, replay=producer.replay, reroll=producer.reroll, schedule=producer.schedule,
            drops=self.drops.snapshot(), mlflow_run_id=self.tracker.run_id if self.tracker else None,
            weight_syncs=len(self.sync_times), num_tokens=self.num_tokens,
            unlogged_metrics=self.tracker.unlogged_metrics() if self.tracker is not None else [],
        )  # fmt: skip

    def restore(self, state: TrainState) -> None:
        """Put `state` into the live roles (after `setup`, before `train`)."""
        self.step, self.generation_rounds, self.num_tokens = state.step, state.generation_rounds, state.num_tokens
        self.version.reset(state.policy_version)
        self.learner.load_state_dict(state.learner)
        self.drops.load_state_dict(state.drops)
        # the producer paces from the generation rounds trained; the ledger counts the restored drops as launched
        self.producer.load_state_dict(
            ProducerState(sampler=state.sampler, replay=state.replay, reroll=state.reroll, schedule=state.schedule),
            generation_rounds=state.generation_rounds,
            launched_before=-report.prompts_lost(0, 0, self.drops.snapshot()),
        )
        restore_rng(state.rng)
        if self.tracker is not None and state.unlogged_metrics:  # what MLflow had not taken before the checkpoint
            logger.info("writing %d metric(s) MLflow had not taken before the checkpoint", len(state.unlogged_metrics))
            self.tracker.resubmit_metrics(state.unlogged_metrics)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write the `TrainState` and the policy (Hugging Face folder) to `path`, atomically."""
        return save_checkpoint(self.state(), path, write_model=self._write_model)

    def checkpoint_now(self) -> float:
        """Write `<output_dir>/checkpoint-<step>` now (between steps) and rotate; returns its seconds."""
        self.settle_push()
        return self.checkpointer.write(self.step)

    def checkpoint_on_stop(self) -> Path | None:
        """After a stop signal: a checkpoint of the current step if the run is past setup and between steps
        (`Checkpointer.on_stop`); returns its folder, or None. Never raises."""
        self.guard.disarm()
        if self.checkpointer is None or self.learner is None:
            return None
        if self.overlap is not None:
            try:
                self.settle_push()
            except Exception as err:  # the checkpoint's weights are the trainer's; its version may lag one push
                logger.error("the weight push in flight at the stop failed: %r", err)
        return self.checkpointer.on_stop(self.step, self.tracker.log_metrics)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a `save_checkpoint` folder into the live roles."""
        self.restore(load_checkpoint(path))

    def _write_model(self, folder: Path) -> None:
        self.learner.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def _log_ledger_at_stop(self) -> None:
        """A run that stops before `finish` (a signal, a failure) logs its prompt ledger too, once the orchestrator
        has stopped and counted its unsettled groups under `shutdown`: `summary/prompts_lost` at the last step, 0
        unless a launched group was neither trained nor dropped with a reason (a resumed run draws the untrained
        prompts again from the checkpoint's position)."""
        lost = self._prompts_lost()
        if lost is not None and self.tracker is not None:
            self.tracker.log_metrics({"summary/prompts_lost": float(lost)}, step=self.step)

    def _prompts_lost(self) -> int | None:
        """`report.prompts_lost` of the producer's ledger; None when the producer does not count its launches."""
        launched = self.producer.launched_total if self.producer is not None else None
        return None if launched is None else report.prompts_lost(launched, self.trained_groups, self.drops.snapshot())

    def cleanup(self, status: str) -> None:
        """End what setup started, in reverse order, whatever happened; close the MLflow run with `status`
        (FINISHED, FAILED or KILLED). Never raises for a role that failed to stop (it is logged). After an
        interrupt the other trainer ranks got the same signal, so they are not waited for."""
        release_ranks = status != "KILLED"
        for name, stop in (
            ("rollout producer", lambda: self.producer and self.producer.stop()),
            ("prompt ledger", lambda: status != "FINISHED" and self._log_ledger_at_stop()),
            ("background weight push", lambda: self.overlap and self.overlap.close()),
            ("trainer ranks", lambda: self.learner and release_ranks and self.learner.close()),
            ("weight transfer", lambda: self.pusher and self.pusher.close()),
            ("reward workers", lambda: self.scorer and self.scorer.close()),
            ("tool workers", lambda: self.rollout and self.rollout.close()),
            ("tracking", lambda: self.tracker and self.tracker.end(status)),
        ):
            try:
                stop()
            except Exception as err:
                logger.warning("cleanup: could not stop the %s: %r", name, err)
