"""The DataProducer protocol: where the trainer's rollouts come from.

The training loop (`runner.GRPORecipe.train`) asks a producer for one *generation round* at a time,
`producer.produce(model, global_step)`, and trains on it: a round holds `steps_per_generation`
step batches, each trained `num_iterations` times in a row, the whole round `mini_epochs` times.
`on_rollout_begin` / `on_rollout_end` bracket every `produce` call. axolotl calls a round a "rollout", and its
names stay where a user meets them (`max_rollouts`, `sync_warmup_rollouts`, `on_rollout_*`, the run's
`generation_rounds` metric counts them); everywhere else in this package a rollout is what the field means by it, one
sampled episode or group (`orchestrator.rollout.Rollout`). This mirrors axolotl's async GRPO
`DataProducer` / `ProducerConfig` (itself a proposal for TRL), so a user who brings their own rollout
source (an environment, a different server, offline data) implements three methods and keeps the
rest: advantages travel with the batch, and the trainer's loss, stale-rollout correction, weight sync
and MLflow logging are unchanged.

The builtin implementation is `VLLMProducer`: the asynchronous vLLM `Orchestrator` fills the bounded
rollout queue in the background (its prefetch), and `produce` takes the next `steps_per_generation`
step batches off it. With `streaming_min_groups` a step batch arrives as a `StepStream` of chunks that
the trainer consumes while the orchestrator is still scoring the step's later groups.

A user producer is configured as `data_producer: pkg.module:factory` (or `path/file.py:factory`);
`factory(config, tokenizer)` returns the producer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from async_grpo.errors import RunFailedError
from async_grpo.orchestrator.progress import ProducerState
from async_grpo.transports.messages import RolloutGroup, TrainBatch
from async_grpo.transports.policy_version import PolicyVersion
from async_grpo.transports.queue import RolloutQueue

if TYPE_CHECKING:
    from async_grpo.inference.health import InferenceHealth
    from async_grpo.orchestrator.orchestrator import Orchestrator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerConfig:
    """How rollouts are produced and reused (axolotl `ProducerConfig` names; TRL names where TRL has them).

    Attributes:
        mini_epochs: passes over each whole rollout (>= 1).
        max_rollouts: stop after this many generation rounds (`produce` calls; axolotl's rollouts); None for no
            limit (the run still ends at max_steps).
        steps_per_generation: step batches per rollout (TRL `steps_per_generation`, >= 1).
        num_iterations: consecutive optimizer steps on each step batch (TRL `num_iterations`, GRPO's mu, >= 1).
        prefetch_depth: generation rounds produced ahead of training at most (>= 1).
        sync_warmup_rollouts: leading generation rounds generated strictly on-policy (>= 0).

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    mini_epochs: int = 1
    max_rollouts: int | None = None
    steps_per_generation: int = 1
    num_iterations: int = 1
    prefetch_depth: int = 1
    sync_warmup_rollouts: int = 0

    def __post_init__(self) -> None:
        for name in ("mini_epochs", "steps_per_generation", "num_iterations", "prefetch_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProducerConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.max_rollouts is not None and self.max_rollouts < 1:
            raise ValueError(f"ProducerConfig.max_rollouts={self.max_rollouts} must be >= 1 or None.")
        if self.sync_warmup_rollouts < 0:
            raise ValueError(f"ProducerConfig.sync_warmup_rollouts={self.sync_warmup_rollouts} must be >= 0.")

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps one rollout feeds: steps_per_generation x num_iterations x mini_epochs."""
        return self.steps_per_generation * self.num_iterations * self.mini_epochs

    @classmethod
    def from_config(cls, config: Any) -> ProducerConfig:
        """The producer settings of a `GRPOConfig` (its `producer` section)."""
        p = config.producer
        return cls(
            mini_epochs=p.mini_epochs,
            max_rollouts=p.max_rollouts,
            steps_per_generation=p.steps_per_generation,
            num_iterations=p.num_iterations,
            prefetch_depth=p.prefetch_depth,
            sync_warmup_rollouts=p.sync_warmup_rollouts,
        )


class StepStream:
    """One optimizer step's batch, delivered as chunks (`TrainBatch.final` marks the step's last chunk).

    Iterating yields the chunks as they come off the rollout queue; every chunk is kept, so a second
    iteration replays them from memory. The trainer treats a `TrainBatch` and a `StepStream` alike.

    Args:
        queue: the rollout queue.
        version: callable returning the current policy version (for the queue's staleness check).
        timeout_s: longest wait for one chunk (seconds).
        check: called before each wait; raises if the producer side failed.
    """

    def __init__(self, queue: RolloutQueue, version, timeout_s: float, check=lambda: None):
        self._queue, self._version, self._timeout_s, self._check = queue, version, timeout_s, check
        self._chunks: list[TrainBatch] = []
        self._done = False
        self.wait_s = 0.0  # seconds spent blocked on the queue (trainer idle time)

    def __iter__(self) -> Iterator[TrainBatch]:
        yield from list(self._chunks)
        while not self._done:
            t0 = time.perf_counter()
            chunk = _get(self._queue, self._version(), self._timeout_s, self._check, keep_empty_final=True)
            self.wait_s += time.perf_counter() - t0
            if chunk.final:
                self._done = True
            self._chunks.append(chunk)
            if chunk.groups:
                yield chunk

    @property
    def metrics(self) -> dict[str, float]:
        """The step's rollout metrics (carried by its final chunk), plus `streaming/chunks`."""
        out: dict[str, float] = {}
        for chunk in self._chunks:
            out.update(chunk.metrics)
        out["streaming/chunks"] = float(sum(1 for c in self._chunks if c.groups))
        return out

    @property
    def groups(self):
        """Every group received so far, in arrival order."""
        return [g for c in self._chunks for g in c.groups]


StepInput = TrainBatch | StepStream  # what one optimizer step consumes


@runtime_checkable
class DataProducer(Protocol):
    """Anything that can hand the trainer rollouts.

    Attributes:
        config: its `ProducerConfig`.
    """

    config: ProducerConfig

    def produce(self, model: Any, global_step: int, **kwargs: Any) -> list[StepInput]:
        """The next rollout: `config.steps_per_generation` step batches with advantages filled in.

        Args:
            model: the trainer's policy (a transformers model; read-only: a producer that generates with it
                must not step it).
            global_step: optimizer steps completed so far.
            kwargs: `timeout_s` (float seconds, the longest the caller will wait) and future extensions.

        Raises:
            TimeoutError: nothing could be produced within `timeout_s`.
        """

    def on_rollout_begin(self, global_step: int) -> None:
        """Called before each `produce`."""

    def on_rollout_end(self, rollout: list[StepInput], global_step: int) -> None:
        """Called after each `produce` with what it returned."""


@runtime_checkable
class RunProducer(DataProducer, Protocol):
    """A `DataProducer` with the run's lifecycle: what the training loop drives besides `produce`. Every
    `BaseDataProducer` has it (no background work and no state by default); `load_data_producer` wraps a user
    producer that has only the three `DataProducer` methods.
    """

    def start(self) -> None:
        """Start producing in the background (before the first `produce`)."""

    def stop(self) -> None:
        """Stop the background work and count what was produced and never trained (idempotent)."""

    def mark_trained(self, groups: list[RolloutGroup]) -> None:
        """The trainer finished its steps on `groups` (once per step, from the trainer's thread)."""

    def wait_before_push(self, version: int, timeout_s: float) -> float | None:
        """Called before the trainer pushes policy version `version + 1`: wait (at most `timeout_s` seconds) until
        what must be generated at `version` is (full_determinism); returns the seconds waited, None when the
        producer has nothing to wait for.

        Raises:
            TimeoutError: not done within `timeout_s`.
        """

    def state_dict(self, version: int, timeout_s: float) -> ProducerState:
        """What a checkpoint written at policy version `version` keeps of the producer (may wait up to
        `timeout_s` seconds for groups being scored)."""

    def load_state_dict(self, state: ProducerState, *, generation_rounds: int, launched_before: int) -> None:
        """Continue from a checkpoint's `state_dict()` (before `start`); `generation_rounds`: generation rounds trained before it;
        `launched_before`: groups launched before it and dropped with a reason (the prompt ledger's balance)."""

    @property
    def queue_depth(self) -> int:
        """Step batches produced ahead and waiting (metric `queue/depth`)."""

    @property
    def launched_total(self) -> int | None:
        """Groups launched since the start (or the checkpoint), the prompt ledger's "sampled" count; None: the
        producer does not count them (`summary/prompts_lost` is then not logged)."""


class BaseDataProducer:
    """Convenience base: holds a `ProducerConfig` (default settings when None), no-op hooks, and the run's
    lifecycle (`RunProducer`) of a producer with no background work and no state of its own."""

    def __init__(self, config: ProducerConfig | None = None):
        self.config = config or ProducerConfig()

    def on_rollout_begin(self, global_step: int) -> None:
        """No-op."""

    def on_rollout_end(self, rollout: list[StepInput], global_step: int) -> None:
        """No-op."""

    def start(self) -> None:
        """No-op: `produce` does the work."""

    def stop(self) -> None:
        """No-op."""

    def mark_trained(self, groups: list[RolloutGroup]) -> None:
        """No-op."""

    def wait_before_push(self, version: int, timeout_s: float) -> float | None:
        """None: nothing to wait for."""
        return None

    def state_dict(self, version: int, timeout_s: float) -> ProducerState:
        """Nothing: a resumed run calls the producer afresh."""
        return ProducerState()

    def load_state_dict(self, state: ProducerState, *, generation_rounds: int, launched_before: int) -> None:
        """No-op."""

    @property
    def queue_depth(self) -> int:
        """0: nothing is produced ahead."""
        return 0

    @property
    def launched_total(self) -> int | None:
        """None: not counted."""
        return None


class UserDataProducer(BaseDataProducer):
    """A user producer that has only the three `DataProducer` methods, with the default lifecycle.

    Args:
        producer: the user's object (`config`, `produce`, `on_rollout_begin`, `on_rollout_end`).
    """

    def __init__(self, producer: DataProducer):
        super().__init__(producer.config)
        self.producer = producer

    def produce(self, model: Any, global_step: int, **kwargs: Any) -> list[StepInput]:
        """The user producer's `produce`."""
        return self.producer.produce(model, global_step, **kwargs)

    def on_rollout_begin(self, global_step: int) -> None:
        """The user producer's hook."""
        self.producer.on_rollout_begin(global_step)

    def on_rollout_end(self, rollout: list[StepInput], global_step: int) -> None:
        """The user producer's hook."""
        self.producer.on_rollout_end(rollout, global_step)


class VLLMProducer(BaseDataProducer):
    """The builtin producer: the asynchronous vLLM `Orchestrator` behind the bounded rollout queue.

    The orchestrator generates in the background (that is the prefetch); `produce` only dequeues.

    Args:
        orchestrator: a started (or about to be started) `Orchestrator` filling `queue`.
        queue: its rollout queue.
        version: the shared `PolicyVersion`.
        config: producer settings.
        streaming: True when the orchestrator emits chunks (`streaming_min_groups`).
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        queue: RolloutQueue,
        version: PolicyVersion,
        config: ProducerConfig,
        streaming: bool = False,
        health: InferenceHealth | None = None,
    ):
        super().__init__(config)
        self.orchestrator = orchestrator
        self.queue = queue
        self.version = version
        self.streaming = streaming
        self.health = health
        self._partial: list[StepInput] = []

    def start(self) -> None:
        """Start the orchestrator's background generation."""
        self.orchestrator.start()

    def stop(self) -> None:
        """Stop the orchestrator and drain the queue (prefetched batches never trained are counted as
        `unconsumed_at_end`)."""
        self.orchestrator.stop()
        self.queue.drain()

    def mark_trained(self, groups: list[RolloutGroup]) -> None:
        """`Orchestrator.mark_trained`: the prompt ledger and the full_determinism schedule."""
        self.orchestrator.mark_trained(groups)

    def wait_before_push(self, version: int, timeout_s: float) -> float | None:
        """Under full_determinism, `Orchestrator.wait_generated(version)`; None otherwise.

        Raises:
            InferenceLost, RuntimeError, TimeoutError: as `Orchestrator.wait_generated`.
        """
        if not self.orchestrator.full_determinism:
            return None
        return self.orchestrator.wait_generated(version, timeout_s)

    def state_dict(self, version: int, timeout_s: float) -> ProducerState:
        """`Orchestrator.state_dict`."""
        return self.orchestrator.state_dict(version, timeout_s)

    def load_state_dict(self, state: ProducerState, *, generation_rounds: int, launched_before: int) -> None:
        """`Orchestrator.load_state_dict`."""
        self.orchestrator.load_state_dict(state, generation_rounds=generation_rounds, launched_before=launched_before)

    @property
    def queue_depth(self) -> int:
        """Batches waiting on the rollout queue."""
        return self.queue.depth

    @property
    def launched_total(self) -> int | None:
        """`Orchestrator.launched_total`."""
        return self.orchestrator.launched_total

    def _check(self) -> None:
        if isinstance(self.orchestrator.error, RunFailedError):  # its message says what failed and the fix
            raise self.orchestrator.error
        if self.orchestrator.error is not None:
            raise RuntimeError(f"orchestrator failed: {self.orchestrator.error!r}") from self.orchestrator.error
        if self.health is not None:
            self.health.check()  # InferenceLost: the runner recovers the server, then asks again

    def produce(self, model: Any, global_step: int, **kwargs: Any) -> list[StepInput]:
        """The next `steps_per_generation` step batches off the queue (see `DataProducer.produce`).

        Raises:
            TimeoutError: no batch within `timeout_s` (default 300 s).
            RuntimeError: the orchestrator died (its error is chained).
            InferenceLost: the inference server was lost while waiting (the runner recovers it and asks again).
        """
        timeout_s = float(kwargs.get("timeout_s", 300.0))
        out, self._partial = self._partial, []  # batches taken before an interrupted call are not lost
        while len(out) < self.config.steps_per_generation:
            if self.streaming:
                out.append(StepStream(self.queue, lambda: self.version.value, timeout_s, self._check))
                continue
            try:
                out.append(_get(self.queue, self.version.value, timeout_s, self._check))
            except BaseException:
                self._partial = out
                raise
        return out


def _get(queue: RolloutQueue, version: int, timeout_s: float, check, keep_empty_final: bool = False) -> TrainBatch:
    """Next batch off `queue`, polling `check` (which raises if the producer died) every second.

    Raises:
        TimeoutError: nothing within `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        try:
            return queue.get(
                version, timeout_s=min(1.0, max(deadline - time.monotonic(), 0.01)), keep_empty_final=keep_empty_final
            )
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no rollouts for {timeout_s:.0f} s (dropped so far: {queue.drops.snapshot()}); "
                    "check vllm.log and the reward functions, or raise rollout_timeout_s"
                ) from None


def resolve_producer_factory(spec: str) -> Callable[..., Any]:
    """The factory `data_producer: pkg.module:factory` or `path/to/file.py:factory` names (`user_code`'s spec
    forms; this imports it). There is no builtin producer: the builtin one is the vLLM orchestrator.

    Raises:
        ValueError: the spec is malformed or `builtin:`, or does not import to a callable (the message names
            `data_producer` and the fix).
    """
    from async_grpo.user_code import import_callable, parse_spec

    parsed = parse_spec(spec, what="data_producer", error=ValueError)
    if parsed.kind == "builtin":
        raise ValueError(
            f"data_producer {spec!r}: there is no builtin data producer (the vLLM orchestrator is used when "
            "data_producer is unset). Fix: unset data_producer, or write pkg.module:factory or "
            "path/to/file.py:factory."
        )
    return import_callable(parsed, what="data_producer", error=ValueError, prefix="_async_grpo_producer",
                           returns="a DataProducer from (config, tokenizer)")  # fmt: skip


def load_data_producer(spec: str, config: Any, tokenizer: Any) -> RunProducer:
    """Build a user producer: `resolve_producer_factory(spec)(config, tokenizer)`. One with only the three
    `DataProducer` methods is wrapped in `UserDataProducer` (the default lifecycle).

    Raises:
        ValueError: as `resolve_producer_factory`, or the factory's result lacks the protocol or a
            `config: ProducerConfig` (the message names `data_producer` and the fix).
    """
    producer = resolve_producer_factory(spec)(config, tokenizer)
    if not isinstance(producer, DataProducer) or not isinstance(getattr(producer, "config", None), ProducerConfig):
        raise ValueError(
            f"data_producer={spec!r} returned {type(producer).__name__}, which lacks the DataProducer protocol. "
            "Fix: return an object with a `config: ProducerConfig` attribute and produce(model, global_step, "
            "**kwargs), on_rollout_begin(global_step), on_rollout_end(rollout, global_step) methods "
            "(subclass async_grpo.orchestrator.producer.BaseDataProducer)."
        )
    return producer if isinstance(producer, RunProducer) else UserDataProducer(producer)
