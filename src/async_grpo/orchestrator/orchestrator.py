"""The orchestrator: keeps vLLM busy generating groups while the trainer trains on earlier ones.

It runs an asyncio loop on a background thread. Each prompt goes through the run's `Rollout` (one prompt in,
one scored group stamped with the policy version that sampled it out; `orchestrator.rollout`); finished groups
are batched, advantages are computed over each step's batch (so `scale_rewards=batch` sees the whole batch,
`orchestrator.batching`) and the batch goes onto the bounded rollout queue.
Bounded in-flight requests and the queue bound give backpressure; a failed group is dropped and
counted, never retried silently; the stop event is checked at every wait. Batch shaping (dynamic
sampling here; the replay buffer and deferred re-roll in `batch_shaping`) decides which groups make up
a batch; the trainer only ever sees the result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable

import httpx

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.inference.busy import BusyClient, BusyMeter
from async_grpo.inference.client import GenerationClient, GenerationError
from async_grpo.inference.health import InferenceHealth
from async_grpo.orchestrator.batch_shaping import ReplayBuffer, RerollQueue, is_zero_std, weighted_reward_std
from async_grpo.orchestrator.batching import GenerationMeter, make_train_batch, rollout_metrics
from async_grpo.orchestrator.determinism import ScheduleState
from async_grpo.orchestrator.failures import DynamicSamplingError, RewardFailureWatch, RewardServiceError  # noqa: F401 - the errors are re-exported
from async_grpo.orchestrator.progress import ProducerState, PromptLedger, draw_window
from async_grpo.orchestrator.rollout import Rollout, RolloutDropped, SamplingSettings, aclose_rollout
from async_grpo.transports.drops import DropCounter
from async_grpo.transports.messages import RolloutGroup, TrainBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue
from async_grpo.transports.scorer import RewardError

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.1
GATE_POLL_S = 0.01  # the trainer's poll of `generated_through` before a push (full_determinism)
THREAD_JOIN_TIMEOUT_S = 30.0
GENERATION_ERROR_BACKOFF_S = 1.0


class Orchestrator:
    """Background rollout producer.

    Args:
        client_factory: builds the inference client (called inside the orchestrator's event loop).
        prompts: the seeded `data.PromptSampler`; the orchestrator draws from it through its `PromptLedger`
            (`self.prompts`), which remembers the prompts drawn and not yet trained (`mark_trained`).
        rollout: turns one prompt into one scored group (`orchestrator.rollout`).
        sampling: sampling settings.
        reward_names: metric names of the reward functions, in order.
        reward_weights: (F,) weights.
        scale_rewards: "group" | "batch" | "none" (TRL).
        multi_objective_aggregation: "sum_then_normalize" | "normalize_then_sum" (TRL).
        dynamic_sampling: drop groups whose weighted rewards all tie (std 0, no learning signal) and keep
            generating until the batch is full (DAPO dynamic sampling); drops count as `zero_std`.
        max_gen_batches: with dynamic sampling, give up (DynamicSamplingError) after this many
            batches' worth of groups failed to fill one batch.
        groups_per_step: groups per TrainBatch.
        max_staleness: a group launched for the b-th batch waits until the policy version is at least
            b // vllm_sync_interval - max_staleness, i.e. the version the trainer will hold when it
            consumes that batch, minus the allowed lag (prime-rl's "async level"). The orchestrator
            therefore never runs further ahead than the queue would accept, and stale drops stay rare.
        vllm_sync_interval: trainer steps per policy version.
        max_inflight_groups: generation requests in flight at most.
        queue: the rollout queue to fill.
        version: shared policy version counter.
        drops: shared drop counter.
        replay: optional replay buffer (`replay_buffer_size`): each emitted batch's zero-std groups are
            replaced by buffered groups (`ReplayBuffer.fill`); metrics `replayed_groups` (cumulative) and
            `replay_buffer/size`.
        streaming_min_groups: streaming group scoring (axolotl name): emit each step's groups in chunks of this
            many (advantages per chunk, group scaling), the last one `final` and carrying the step's metrics;
            None emits whole steps. Must divide groups_per_step (checked by the config).
        steps_per_generation: step batches per rollout (pacing: a rollout is consumed from one trainer step on).
        rollout_reuse: optimizer steps per step batch (mini_epochs x num_iterations; pacing).
        sync_warmup_rollouts: the first this-many rollouts launch only once the policy version equals the one
            the trainer will hold when consuming them (strictly on-policy, no max_staleness slack).
        reroll: optional deferred re-roll FIFO (`reroll_start_fraction`, `reroll_max_groups`): scored
            groups whose weighted rewards are all ~0 queue their prompt; from its start step (trainer step
            = policy version x vllm_sync_interval) queued prompts are launched before fresh ones; metrics
            `rerolled_groups` (cumulative, re-rolled groups that reached a batch), `reroll/pending` and
            `reroll/overflowed` (candidates refused by a full FIFO).
        health: the inference gate (`inference.health`): while the server is lost nothing new is launched, and a
            group whose request failed at the transport level (the server went away) waits for the recovery and is
            generated again instead of being dropped; None drops it as `generation_error`.
        recovery_timeout_s: the longest a parked group waits for the server (then it is dropped as
            `inference_unavailable`; seconds).
        reward_failure_timeout_s: when every group has failed to score for this long (at least two in a row), the
            orchestrator stops with a `RewardServiceError` naming the scorer (seconds).
        full_determinism: fix by the schedule, not by timing, what timing decides otherwise (TRL's name; issue 28):
            the i-th launched group (launch index i, the i-th prompt of the seeded sampler) is sampled with
            per-request seed `group_seed(i)` at exactly policy version `scheduled_version(i)` (the trainer
            pushes the next version only once every group scheduled for this one finished generating:
            `wait_generated`), and groups enter step batches in launch order, not in the order they finished.
            Refuses dynamic sampling and deferred re-roll (their launches depend on earlier groups' outcomes).
        seed: the run's seed (`seed`), the base of the per-group sampling seeds under full_determinism.
    """

    def __init__(
        self,
        *,
        client_factory: Callable[[], GenerationClient],
        prompts: PromptSampler,
        rollout: Rollout,
        sampling: SamplingSettings,
        reward_names: list[str],
        reward_weights: list[float],
        scale_rewards: str,
        groups_per_step: int,
        multi_objective_aggregation: str = "sum_then_normalize",
        dynamic_sampling: bool = False,
        max_gen_batches: int = 10,
        max_staleness: int,
        vllm_sync_interval: int,
        max_inflight_groups: int,
        queue: RolloutQueue,
        version: PolicyVersion,
        drops: DropCounter,
        replay: ReplayBuffer | None = None,
        reroll: RerollQueue[PromptItem] | None = None,
        streaming_min_groups: int | None = None,
        steps_per_generation: int = 1,
        rollout_reuse: int = 1,
        sync_warmup_rollouts: int = 0,
        health: InferenceHealth | None = None,
        recovery_timeout_s: float = 600.0,
        reward_failure_timeout_s: float = 120.0,
        full_determinism: bool = False,
        seed: int = 0,
    ):
        if full_determinism and (dynamic_sampling or reroll is not None):
            raise ValueError(
                "full_determinism with dynamic_sampling or reroll_start_fraction < 1: which prompt is launched next "
                "would depend on when earlier groups finished. Fix: turn those off, or full_determinism off."
            )
        self.client_factory = client_factory
        self.rollout = rollout
        self.sampling = sampling
        self.reward_names = reward_names
        self.reward_weights = reward_weights
        self.scale_rewards = scale_rewards
        self.multi_objective_aggregation = multi_objective_aggregation
        self.dynamic_sampling = dynamic_sampling
        self.max_gen_batches = max_gen_batches
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.vllm_sync_interval = vllm_sync_interval
        self.max_inflight_groups = max_inflight_groups
        self.queue = queue
        self.version = version
        self.drops = drops
        self.replay = replay
        self.reroll = reroll
        self.chunk_groups = streaming_min_groups or groups_per_step
        if groups_per_step % self.chunk_groups:
            raise ValueError(
                f"streaming_min_groups={streaming_min_groups} must divide groups_per_step={groups_per_step}"
            )
        self.streaming = streaming_min_groups is not None
        queued_groups = queue.maxsize * self.chunk_groups
        window = draw_window(
            max_inflight_groups=max_inflight_groups, queued_groups=queued_groups, groups_per_step=groups_per_step
        )
        self.prompts = PromptLedger(prompts, window)
        self.steps_per_generation = steps_per_generation
        self.rollout_reuse = rollout_reuse
        self.sync_warmup_rollouts = sync_warmup_rollouts
        self.health = health
        self.recovery_timeout_s = recovery_timeout_s
        self.reward_failure_timeout_s = reward_failure_timeout_s
        self.reward_watch = RewardFailureWatch(reward_failure_timeout_s)
        self.launched_total = 0  # every launch, never taken back: the prompt ledger's "sampled" count
        self.meter = GenerationMeter()
        self.busy = BusyMeter()  # the share of time vLLM has a request of this run in flight
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pending: list[RolloutGroup] = []
        self._launched = 0  # groups launched that did not fail (event-loop thread only)
        self._unsettled = 0  # launched groups neither handed to a batch nor dropped yet (event-loop thread only)
        self._generated_for_batch = 0  # scored groups seen while building the current batch
        self._step_groups: list[RolloutGroup] = []  # groups already emitted for the step being built
        self._emit_lock: asyncio.Lock | None = None  # created inside the event loop; keeps chunks in order
        self.full_determinism = full_determinism
        self.seed = seed
        self.schedule = ScheduleState() if full_determinism else None  # launch-index bookkeeping
        self._gate_index = 0  # `scheduled_before`'s cursor (versions only grow)

    # ------------------------------------------------------------------ lifecycle
    def load_state_dict(self, state: ProducerState, *, generation_rounds: int, launched_before: int) -> None:
        """Continue a resumed run from a checkpoint's `state_dict()` (call before `start`): the prompt ledger's
        position, the replay buffer and the re-roll FIFO, the pacing, and under full_determinism the schedule (its
        kept groups enter batches again in launch order and count as launched; later prompts are sampled again).

        Args:
            state: the checkpoint's `ProducerState`; a field that is None leaves that part fresh.
            generation_rounds: generation rounds (`produce` calls) the run had trained when its checkpoint was
                written: launches are paced from there (`generation_rounds` x steps_per_generation x groups_per_step
                groups count as launched).
            launched_before: groups launched before this process started and counted in the restored drop
                counters (they were dropped with a reason), so the ledger `launched_total - trained - dropped`
                stays balanced across the resume.

        Raises:
            ValueError: the checkpoint holds a schedule and full_determinism is off in this run, or its sampler
                position belongs to another dataset.
        """
        if state.sampler is not None:
            self.prompts.load_state_dict(state.sampler)
        self._launched = generation_rounds * self.steps_per_generation * self.groups_per_step
        self.launched_total = launched_before
        if state.schedule is not None:
            self._restore_schedule(state.schedule)
        elif self.full_determinism:
            logger.warning(
                "full_determinism: the checkpoint holds no schedule (written without full_determinism); the resumed "
                "run samples the untrained prompts again at its policy version and will not equal an uninterrupted one"
            )
        if self.replay is not None and state.replay is not None:
            self.replay.load_state_dict(state.replay)
        if self.reroll is not None and state.reroll is not None:
            self.reroll.load_state_dict(state.reroll)

    def state_dict(self, version: int, timeout_s: float) -> ProducerState:
        """What a checkpoint written at policy version `version` keeps (between steps, from the trainer's thread):
        the prompt ledger's trained position, the replay buffer, the re-roll FIFO and, under full_determinism, the
        schedule (`schedule_state`, which waits up to `timeout_s` seconds for the older groups to be scored).

        Raises:
            RuntimeError / TimeoutError: as `schedule_state`.
        """
        return ProducerState(
            sampler=self.prompts.state_dict(),
            replay=self.replay.state_dict() if self.replay is not None else None,
            reroll=self.reroll.state_dict() if self.reroll is not None else None,
            schedule=self.schedule_state(version, timeout_s),
        )

    def start(self) -> None:
        """Start the background thread."""
        self._thread = threading.Thread(target=self._run, name="orchestrator", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = THREAD_JOIN_TIMEOUT_S) -> None:
        """Signal stop and join the thread (up to `timeout_s`)."""
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                logger.error("orchestrator thread did not stop within %.0f s", timeout_s)

    @property
    def alive(self) -> bool:
        """True while the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # surfaced to the trainer through .error
            logger.exception("orchestrator failed")
            self.error = err
            self.stop_event.set()

    # ------------------------------------------------------------------ main loop
    async def _main(self) -> None:
        client = BusyClient(self.client_factory(), self.busy)
        self._emit_lock = asyncio.Lock()
        inflight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(self.max_inflight_groups)
        try:
            while not self.stop_event.is_set():
                if (
                    self.version.value < self._launch_version()
                    or (self.queue.full() and not self.full_determinism)  # its pacing alone bounds how far ahead
                    or (self.health is not None and self.health.lost)
                    or not await _acquire(slots)
                ):
                    await asyncio.sleep(STOP_POLL_S)
                    continue
                if self.stop_event.is_set():  # stop came while waiting for a slot: launch nothing more
                    slots.release()
                    break
                if self.schedule is not None:
                    index, item = self.schedule.draw(self.prompts)
                    rerolled = False
                else:
                    index, (item, rerolled) = self.launched_total, self._next_prompt()
                self._launched += 1
                self.launched_total += 1
                self._unsettled += 1
                task = asyncio.create_task(self._one_group(client, item, slots, rerolled, index))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
        finally:
            tasks = list(inflight)  # done-callbacks empty `inflight` while we wait
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._unsettled:  # cancelled (even before they ran), or their request failed once stopping
                self.drops.add("shutdown", self._unsettled)
                self._unsettled = 0
            if self._pending:  # scored groups that never filled a batch
                self.drops.add("shutdown", len(self._pending))
                self._pending = []
            waiting = self.schedule.waiting() if self.schedule is not None else 0
            if waiting:  # full_determinism: scored groups still waiting for an earlier launch index
                self.drops.add("shutdown", waiting)
            await client.aclose()
            await aclose_rollout(self.rollout)

    def _launch_version(self) -> int:
        """The policy version the next launch waits for: `scheduled_version` of its launch index under
        full_determinism, else `required_version` of `_paced_launches`."""
        if self.schedule is not None:
            return self.scheduled_version(self.schedule.next_index)
        return self.required_version(self._paced_launches())

    def scheduled_version(self, index: int) -> int:
        """The policy version that samples launch index `index` under full_determinism: `required_version(index)`,
        raised to the largest one before it (the on-policy warm-up rollouts can ask for a later version than the
        first rollouts after them, and launches are in index order) and to 0. Never decreases with `index`."""
        version = self.required_version(index)
        warm = self.sync_warmup_rollouts
        if warm and (index // self.groups_per_step) // self.steps_per_generation >= warm:
            last_warm = warm * self.steps_per_generation * self.groups_per_step - 1
            version = max(version, self.required_version(last_warm))
        return max(version, 0)

    def group_seed(self, index: int) -> int:
        """vLLM's per-request `seed` for the group of launch index `index` under full_determinism: vLLM seeds the
        request's k-th sample with seed + k (`ParentRequest`), so groups are `num_generations` apart and never share
        a sample's seed; the run's `seed` offsets the whole sequence. Below 2**31."""
        return (self.seed * 1_000_003 + index * self.sampling.num_generations) % 2**31

    def scheduled_before(self, version: int) -> int:
        """The first launch index whose scheduled version is above `version`: the groups `[0, scheduled_before)` are
        exactly those the schedule samples at policy versions up to `version` (`scheduled_version` never decreases
        with the launch index)."""
        while self.scheduled_version(self._gate_index) <= version:
            self._gate_index += self.groups_per_step
        index = self._gate_index
        while index > 0 and self.scheduled_version(index - 1) > version:
            index -= 1
        return index

    def wait_generated(self, version: int, timeout_s: float) -> float:
        """Block the trainer until every group the schedule samples at policy versions up to `version` finished
        generating (full_determinism: then the next version may be pushed without any of them seeing it). Returns
        the seconds waited. Called from the trainer's thread before each weight push.

        Raises:
            InferenceLost: the server was lost while waiting (the runner recovers it and asks again).
            RuntimeError: the orchestrator failed (its error is chained) or stopped.
            TimeoutError: not done within `timeout_s` seconds.
        """
        needed = self.scheduled_before(version)

        def missing() -> str | None:
            through = self.schedule.generated_through
            return None if through >= needed else f"{through} of {needed} generated"

        what = f"the groups scheduled for policy version {version} to be generated"
        return self._await(missing, timeout_s, what, "check vllm.log, or raise rollout_timeout_s", check_health=True)

    def _await(
        self, missing: Callable[[], str | None], timeout_s: float, what: str, fix: str, check_health: bool
    ) -> float:
        """Poll `missing` every GATE_POLL_S until it returns None (it describes what is still missing otherwise);
        returns the seconds waited. `what` names the wait in errors, `fix` the remedy of a time-out.

        Raises:
            InferenceLost: `check_health` and the server was lost while waiting.
            RuntimeError: the orchestrator failed (its error is chained) or stopped.
            TimeoutError: still missing after `timeout_s` seconds.
        """
        t0 = time.monotonic()
        while (left := missing()) is not None:
            if self.error is not None:
                raise RuntimeError(f"orchestrator failed: {self.error!r}") from self.error
            if self.stop_event.is_set():
                raise RuntimeError(f"the orchestrator stopped while the trainer waited for {what}")
            if check_health and self.health is not None:
                self.health.check()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"full_determinism: waited {timeout_s:.0f} s for {what} ({left}); {fix}")
            time.sleep(GATE_POLL_S)
        return time.monotonic() - t0

    def mark_trained(self, groups: list[RolloutGroup]) -> None:
        """The trainer finished its steps on `groups`: the prompt ledger forgets their draws, and under
        full_determinism the schedule its untrained groups (what a checkpoint keeps). Called from the trainer's
        thread, once per step."""
        self.prompts.mark_trained(groups)
        if self.schedule is not None:
            self.schedule.mark_trained(groups)

    def schedule_state(self, version: int, timeout_s: float) -> dict | None:
        """What a checkpoint written at policy version `version` keeps of the schedule under full_determinism
        (`ScheduleState.snapshot`: the untrained groups sampled at older versions, the prompts drawn since, the
        sampler's position); None otherwise. Called from the trainer's thread, between steps.

        The groups sampled at older versions finished generating before the last push, but some may still be
        scored (a `save_steps` checkpoint comes right after a step, while the reward workers run): it first waits
        up to `timeout_s` seconds for every one of them to settle (scored or dropped), polling every GATE_POLL_S.

        Raises:
            RuntimeError: the orchestrator failed or stopped while waiting; see also `ScheduleState.snapshot`.
            TimeoutError: a group was not settled within `timeout_s` seconds (the message names its launch index).
        """
        if self.schedule is None:
            return None
        keep_before = self.scheduled_before(version - 1)

        def missing() -> str | None:
            unsettled = self.schedule.unsettled_before(keep_before)
            return f"launch indices {unsettled[:5]} not yet scored" if unsettled else None

        what = f"the groups sampled before policy version {version} to be scored at the checkpoint"
        self._await(
            missing, timeout_s, what, "check the reward workers, or raise rollout_timeout_s", check_health=False
        )
        return self.schedule.snapshot(keep_before, self.prompts.live_state_dict)

    def _restore_schedule(self, state: dict) -> None:
        """Continue the schedule of a checkpoint's `schedule_state` (`load_state_dict`).

        Raises:
            ValueError: full_determinism is off in this run (the checkpoint's run had it on).
        """
        if self.schedule is None:
            raise ValueError(
                "this checkpoint was written with full_determinism: true and holds the groups it had sampled ahead. "
                "Fix: resume with full_determinism: true (the run's own config)."
            )
        sampler, kept = self.schedule.restore(state)
        self.prompts.load_state_dict(sampler)
        self.launched_total += kept

    def _paced_launches(self) -> int:
        """Launches that will each feed a trainer step: `_launched` less the groups of step batches the queue
        skipped as wholly stale (the trainer trained on the next batch in their place, so every later batch is
        consumed one step earlier than its launch order says)."""
        return self._launched - self.queue.skipped_steps * self.groups_per_step

    def required_version(self, launched: int) -> int:
        """Policy version needed before launching the group after `launched` earlier ones (see class doc).

        `launched` counts only groups that are in flight or reached a batch: dropped groups are taken
        off again, so drops cannot push the requirement past what the trainer will ever reach.
        """
        rollout = (launched // self.groups_per_step) // self.steps_per_generation
        first_step = rollout * self.steps_per_generation * self.rollout_reuse  # trainer steps done when it is consumed
        slack = 0 if rollout < self.sync_warmup_rollouts else self.max_staleness
        return first_step // self.vllm_sync_interval - slack

    def _next_prompt(self) -> tuple[PromptItem, bool]:
        """The prompt for the next launch and whether it is a re-roll (re-rolls take precedence)."""
        if self.reroll is not None:
            step = self.version.value * self.vllm_sync_interval  # steps done at the last weight push
            item = self.reroll.take(step, batch_index=self._launched // self.groups_per_step)
            if item is not None:
                return item, True
        return next(self.prompts), False

    async def _one_group(
        self, client: GenerationClient, item: PromptItem, slots: asyncio.Semaphore, rerolled: bool, index: int
    ) -> None:
        """Run one rollout and batch its group. Every failure is counted under a reason and logged; none
        escapes the task (a `DynamicSamplingError` stops the orchestrator through `error`).

        The prompt ledger (`runner.report.prompts_lost`): the group is settled exactly once, when it is handed to
        the batch being built (`_pending`; from there the batches and the shutdown count it) or counted as dropped
        here. A task cancelled or stopped before that leaves it unsettled, and `_main` counts it as `shutdown`
        once every task ended, whether the task ran at all or not.

        Under full_determinism the slot is freed as soon as the group is generated (a scored group may wait for
        earlier launch indices or for room in the queue while the trainer waits for later groups to be generated),
        and the group enters batches in launch order (`schedule`; a dropped one leaves a gap that is skipped)."""
        batched = settled = released = False
        try:
            group = await self._generate_surviving_restarts(client, item, index)
            if self.schedule is not None:  # generated: the slot goes to the next launch at once
                slots.release()
                released = True
            self.reward_watch.scored()
            group.rerolled = rerolled
            self.meter.add(sum(sum(mask) for mask in group.loss_mask))  # generated tokens: tool output excluded
            if self.reroll is not None and not rerolled:  # a prompt is re-rolled at most once per fresh visit
                self.reroll.offer(item, group.rewards_per_func, self.reward_weights)
            settled = True  # from here the group is counted by the batch or dropped as zero_std
            batched = self._accept(group, index)
            if batched:
                await self._emit()
        except DynamicSamplingError as err:
            self.error = err
            self.stop_event.set()
        except asyncio.CancelledError:
            raise
        except RolloutDropped as err:
            settled = True
            self.drops.add(err.reason)
        except RewardError as err:
            settled = True
            self.drops.add(err.reason)
            logger.warning("reward failed, group dropped: %s", err)
            self._count_reward_failure(err)
        except (httpx.HTTPError, GenerationError) as err:
            if not self.stop_event.is_set():  # once stopping, left unsettled: `_main` counts it as shutdown
                settled = True
                self.drops.add("generation_error")
                logger.warning("generation failed: %s", err)
                await asyncio.sleep(GENERATION_ERROR_BACKOFF_S)  # no tight retry loop against a failing server
        except Exception as err:
            settled = True
            self.drops.add("rollout_error")
            logger.error("rollout failed, group dropped: %r", err, exc_info=err)
        finally:
            if settled:
                self._unsettled -= 1
            if not batched:
                self._launched -= 1
            if self.schedule is not None and not batched:
                if settled:  # a gap the in-order hand-over skips
                    self._pending.extend(self.schedule.settle(index, None))
                else:
                    self.schedule.mark_generated(index)
            if not released:
                slots.release()

    async def _generate_surviving_restarts(
        self, client: GenerationClient, item: PromptItem, index: int
    ) -> RolloutGroup:
        """`self.rollout` on `item`; when its request fails because the server is gone (connection refused or
        reset), mark the server lost, wait for the recovery and generate the group again (counted in
        `health.parked_groups`). Under full_determinism every request of the group carries the seed of its launch
        index `index` (`group_seed`), so a regenerated group samples as the lost one would have.

        Raises:
            RolloutDropped: reason `inference_unavailable`, the server was not back within recovery_timeout_s.
            whatever the rollout raises otherwise.
        """
        seeded = {"seed": self.group_seed(index)} if self.full_determinism else {}
        while True:
            try:
                return await self.rollout(client, item, self.sampling, version=lambda: self.version.value, **seeded)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
                if self.health is None or self.stop_event.is_set():
                    raise
                self.health.mark_lost(f"a generation request failed: {err!r}")
                self.health.parked_groups += 1
                if not await self.health.wait_available(self.recovery_timeout_s, self.stop_event):
                    if self.stop_event.is_set():
                        raise asyncio.CancelledError from err
                    raise RolloutDropped("inference_unavailable") from err

    def _count_reward_failure(self, err: RewardError) -> None:
        """Stop the orchestrator (`error` = `RewardServiceError`) once scoring failed for every group for
        `reward_failure_timeout_s` seconds."""
        failure = self.reward_watch.failed(err)
        if failure is not None and self.error is None:
            self.error = failure
            self.stop_event.set()

    def _accept(self, group: RolloutGroup, index: int) -> bool:
        """Hand a scored group (launch index `index`) to the step being built (`_pending`, emitted by `_emit`;
        under full_determinism through `schedule`, so in launch order); returns False if dynamic sampling dropped
        it (counted as `zero_std`). Synchronous, so a cancellation cannot fall between the ledger's hand-over and
        the group's place.

        Raises:
            DynamicSamplingError: `max_gen_batches` generation batches did not yield a full batch.
        """
        self._generated_for_batch += 1
        if self.dynamic_sampling and is_zero_std(weighted_reward_std(group.rewards_per_func, self.reward_weights)):
            self.drops.add("zero_std")
            if self._generated_for_batch >= self.max_gen_batches * self.groups_per_step:
                raise DynamicSamplingError(
                    f"dynamic sampling: only {len(self._step_groups) + len(self._pending)} of {self.groups_per_step} "
                    f"groups had reward std > 0 after max_gen_batches={self.max_gen_batches} generation batches "
                    f"({self._generated_for_batch} groups). Fix: raise max_gen_batches, use a task whose rewards vary "
                    "within a group, or set dynamic_sampling=false."
                )
            return False
        if self.schedule is not None:  # in launch order; settling also moves the generation watermark
            self._pending.extend(self.schedule.settle(index, group))
        else:
            self._pending.append(group)
        return True

    async def _emit(self) -> None:
        """Enqueue every chunk that became complete, in order (one emitter at a time). A chunk the queue refuses
        because the orchestrator is stopping, or whose wait for room is cancelled, is counted there
        (`RolloutQueue.put_async`: `shutdown`); the wait stays on this event loop, so no cancelled thread can take
        a chunk out of `_pending` without either enqueuing or counting it."""
        async with self._emit_lock:  # one emitter at a time, so a step's chunks reach the queue in order
            while (chunk := self._take_chunk()) is not None:
                if not await self.queue.put_async(chunk, self.stop_event):
                    logger.info("orchestrator stopping; batch not enqueued")
                    break

    def _take_chunk(self) -> TrainBatch | None:
        """The next chunk (`chunk_groups` groups, or the whole step without streaming) when enough groups are
        pending, else None. The step's last chunk is `final` and carries the metrics of the whole step."""
        if len(self._pending) < self.chunk_groups:
            return None
        groups, self._pending = self._pending[: self.chunk_groups], self._pending[self.chunk_groups :]
        chunk = make_train_batch(
            groups, self.reward_names, self.reward_weights, self.scale_rewards, self.multi_objective_aggregation
        )
        if self.reroll is not None:
            self.reroll.count_batched(groups)
        if self.replay is not None:
            chunk.groups = self.replay.fill(chunk.groups)  # after the metrics: they describe what was generated
        self._step_groups.extend(groups)
        chunk.final = len(self._step_groups) >= self.groups_per_step
        if not chunk.final:
            chunk.metrics = {}
            return chunk
        if self.streaming:  # the whole step's rollout metrics (advantages are per group: nothing is reassigned)
            chunk.metrics = rollout_metrics(
                self._step_groups,
                self.reward_names,
                self.reward_weights,
                self.scale_rewards,
                self.multi_objective_aggregation,
            )
        chunk.metrics["generation/tokens_per_s"] = self.meter.rate()
        chunk.metrics["generation/vllm_busy_fraction"] = self.busy.fraction()
        if self.reroll is not None:
            chunk.metrics["rerolled_groups"] = float(self.reroll.rerolled_total)
            chunk.metrics["reroll/pending"] = float(len(self.reroll))
            chunk.metrics["reroll/overflowed"] = float(self.reroll.overflowed)
        if self.replay is not None:
            chunk.metrics["replayed_groups"] = float(self.replay.replayed_total)
            chunk.metrics["replay_buffer/size"] = float(len(self.replay))
        if self.dynamic_sampling:
            chunk.metrics["dynamic_sampling/gen_batches"] = float(
                math.ceil(self._generated_for_batch / self.groups_per_step)
            )
        self._generated_for_batch = len(self._pending)
        self._step_groups = []
        return chunk


async def _acquire(sem: asyncio.Semaphore) -> bool:
    """Acquire `sem`, giving up (False) after one poll interval so the caller can re-check its stop event."""
    try:
        await asyncio.wait_for(sem.acquire(), timeout=STOP_POLL_S)
        return True
    except TimeoutError:
        return False
