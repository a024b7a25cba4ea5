"""Sharing one machine between generation and training (`resource_sharing`): time slices or adaptive threads.

When the trainer and vLLM share cores (one CPU machine) or one GPU, running both at once makes each slower than
taking turns: on 2 cores a trainer step that takes 8.2 s alone took 14-16 s beside a generating vLLM (oversubscribed
threads wait on each other; issue 9). `TimeSlice` pauses every live vLLM replica (`/pause?mode=keep`: requests in
flight freeze and continue later, nothing is dropped) for the duration of an optimizer step and resumes them after,
so the trainer gets every core while it computes and vLLM gets them while the trainer waits for the next batch.
Groups are still generated ahead (max_staleness) and scored during the step by the reward workers. A paused vLLM
CPU server still uses about 0.16 of a core (measured, tiny model), against 1.2-1.5 cores while it generates.

`ThreadGovernor` (`adaptive`) never pauses vLLM. The launched CPU servers compute on half the cores
(`vllm_cpu_threads`), and the trainer's torch thread count follows vLLM's activity: the other cores while a
generation request is in flight, every core once vLLM is idle (the staleness bound or a full queue stopped it). The
count is checked before each decoder layer's forward and backward, so no core idles while either side has work.
On the 2-core vs_trl workload (benchmarks/vs_trl.py, one run) the async step took 5.91 s adaptive, 6.58 s
time-sliced, 7.36 s overlapped (vLLM on 1 thread, the trainer on 2) and 7.09 s on-policy: 1 torch thread reaches
57% of 2 threads' throughput, and the vLLM CPU engine generates at 78% of its 2-thread speed on one (1.5k against
1.9k tokens/s alone), so splitting the cores while both have work beats taking turns.

Before any generation, the supervised warm start chooses between every core and fewer (`warm_start_threads`),
whichever `FasterThreads` measures to be faster: another process on one of the cores makes every core a cliff, not a
gain, whether the trainer was widened to them or sits on them by default (`torch_num_threads` unset). The GRPO steps
keep measuring the same choice (`StepThreads`, under both the time slice and the governor), since a neighbour may
arrive at any time.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import requests
import torch

from async_grpo.inference.client import VLLMControlClient
from async_grpo.inference.replicas import ReplicaSet

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 30.0  # one pause / resume call


def resolve_resource_sharing(
    mode: str,
    *,
    launched_here: bool,
    streaming: bool,
    trainer_threads: int | None = None,
    cores: int | None = None,
    cuda: bool = False,
    on_policy: bool = False,
) -> str:
    """The mode `auto` stands for; explicit modes are returned as they are.

    `auto` shares cores only when the trainer would compute on the cores vLLM generates on: this run launched its
    vLLM servers on its own CPU machine (no CUDA) and the trainer uses every core (`trainer_threads` None or >=
    `cores`). It is then `adaptive`, or `time_slice` when the run is `on_policy` (max_staleness 0, not streaming:
    generation and training never overlap, so vLLM is better off with every core while the trainer waits). A
    trainer held to fewer threads (`torch_num_threads`, e.g. 1 on 2 cores) already leaves vLLM its own cores:
    overlap (the tiny demo: 1.95 steps/s overlapped against 1.51 time-sliced on 2 cores). GPU runs overlap:
    vLLM and the trainer hold separate GPU memory; set `time_slice` yourself when both compute on one GPU.
    A streamed on-policy run does overlap (the trainer starts on the first chunks): adaptive.
    """
    if mode != "auto":
        return mode
    cores = cores or len(os.sched_getaffinity(0))
    if not (launched_here and not cuda and (trainer_threads is None or trainer_threads >= cores)):
        return "overlap"
    return "time_slice" if on_policy and not streaming else "adaptive"


def resolve_for_config(config, launched_here: bool) -> str:
    """`resolve_resource_sharing` with the arguments `config` (a `GRPOConfig`) gives: its resource_sharing, streaming
    (streaming_min_groups set), torch_num_threads, CUDA present, on-policy (max_staleness 0). The launcher (vLLM's
    threads) and the runner (time slice or thread governor) both resolve through it, so they always agree."""
    return resolve_resource_sharing(
        config.inference.resource_sharing,
        launched_here=launched_here,
        streaming=config.producer.streaming_min_groups is not None,
        trainer_threads=config.compute.torch_num_threads,
        cuda=torch.cuda.is_available(),
        on_policy=config.off_policy.max_staleness == 0,
    )


def warm_start_threads(
    trainer_threads: int | None,
    *,
    launched_here: bool,
    local_ranks: int = 1,
    cores: int | None = None,
    cuda: bool = False,
    full_determinism: bool = False,
) -> tuple[int, int] | None:
    """The two torch thread counts the supervised warm start (`warmup_sft_steps`) chooses between, measured as it
    goes (`FasterThreads(wide, narrow)`), or None to keep the trainer's own count unmeasured.

    The warm start runs before any generation. A run that launched its vLLM servers on its own CPU machine and holds
    the trainer to fewer threads than the cores (`torch_num_threads`, e.g. 1 on 2 cores, so that vLLM generates on
    the others during GRPO) would leave those cores idle for the whole warm start: it may take every core instead
    (`wide`, shared among the trainer ranks on this machine: `local_ranks`, torchrun's LOCAL_WORLD_SIZE), or keep
    its own (`narrow`). A trainer already on every core (`torch_num_threads` unset: torch's default) may keep them
    (`wide`) or leave one (`narrow` = wide - 1): beside a process that computes on one core, OpenMP's threads wait at
    every operation for the one that shares it (measured on 2 cores: the demo's 400-step warm start had not finished
    after 6 minutes on 2 threads beside a busy core, against about 40 s on 1). An attached server, a GPU, or a trainer
    with one thread to its share keeps its threads (on Kubernetes `torch_num_threads` may stand for the pod's CPU
    limit, which the affinity mask does not show). Measured on 2 cores, quiet: the tool-calling warm start took 0.33 s
    per step on 1 thread and 0.20 s on 2.

    Args:
        trainer_threads: `torch_num_threads` (None: torch's default, every core).
        launched_here: every vLLM server of the run was launched by this process.
        local_ranks: trainer processes on this machine.
        cores: cores this process may run on (default: its affinity mask).
        cuda: the trainer computes on a GPU.
        full_determinism: keep the trainer's own threads. The warm start learns its task in a jump whose step is
            chaotic in the float sums, and the thread count changes them: the same seed of examples/guess_cpu.yaml
            ended its 200-step warm start at loss 0.058 in one run and 0.162 in another under another load (held-out
            reward 0.577 against 0.461 before GRPO); `FasterThreads` runs its probe steps on the other count at
            load-dependent steps, the one difference we know of between the two runs.

    Returns:
        (wide, narrow), wide > narrow >= 1, or None.
    """
    if not launched_here or cuda or full_determinism:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    share = max(1, cores // max(1, local_ranks))
    if trainer_threads is not None and trainer_threads < share:
        return share, trainer_threads  # held below its share for vLLM's sake
    wide = share if trainer_threads is None else trainer_threads
    return (wide, wide - 1) if wide > 1 else None


def measure_step_threads(config, launched_here: bool, full: int) -> bool:
    """Whether the GRPO steps of a run (`config`, a `GRPOConfig`) measure their thread ceiling (`StepThreads`).

    As for the warm start (`warm_start_threads`): only a trainer on a CPU machine whose vLLM servers it launched
    itself (a cluster pod's CPU limit, which the affinity mask does not show, is the platform's to set), with at
    least two threads to choose from, and not under `full_determinism` (it keeps the trainer's own threads). Nor
    when streaming (`streaming_min_groups`): a streamed step waits for its chunks inside the step, so its seconds are
    not the trainer's rate.
    """
    return (
        launched_here
        and full >= 2
        and not torch.cuda.is_available()
        and not config.full_determinism
        and config.producer.streaming_min_groups is None
    )


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block on `threads` torch threads and restore the count after it; None leaves the count alone."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class FasterThreads:
    """Runs a loop of similar CPU steps on whichever of two torch thread counts is faster now, measured (issue 48).

    The warm start widens a trainer held to `narrow` threads (`torch_num_threads`) to every core (`wide`,
    `warm_start_threads`), or keeps a trainer on every core (`wide`) against one fewer (`narrow`). Every core pays
    when they are idle: the tool-calling warm start took 0.200 s per step
    on 1 thread and 0.109 s on 2 (2 cores). It is a cliff when another process computes on one of those cores, which
    the affinity mask cannot show: OpenMP's threads wait at every operation for the one that shares its core. Beside
    one busy process the same step took 0.192 s on 1 thread and 0.433 s on 2. In the robustness benchmark's busy cell,
    the 400-step warm start had not finished after 15 minutes, against 77 s on a quiet machine.

    So the loop measures. It times `probe_steps` steps on each count (`wide` first), keeps the faster (seconds per
    padded token, the median of its probe; `narrow` only when faster by `margin`), and runs `block_steps` steps on it.
    Then it probes the other count again and keeps the faster. A count that stays faster doubles the next block, up to
    `max_block_steps`, so a settled choice costs a few probe steps per few hundred steps. A probe step more than twice
    as slow as the running count ends its probe at once, so a cliff costs one step per probe. A step of a block more
    than twice as slow as the other count's last rate ends the block at once, its rate then taken from its last
    `probe_steps` steps: a neighbour that arrives during a block (or a probe that chose the cliff by luck: beside a busy
    core, 2-thread steps of the demo ran anywhere between 0.16 and 1.3 s per 1k tokens) costs a step or two, not the
    block.

    Use: `start()` before the loop (it sets `wide`), `after_step(seconds, tokens)` after each step (the
    `supervised_warm_start` hook). The caller restores the thread count afterwards (`torch_threads`).

    Args:
        wide, narrow: the two torch thread counts (wide > narrow >= 1).
        probe_steps: steps per probe (the first probe of each count, and each later one).
        block_steps, max_block_steps: steps on the chosen count before the next probe, and their cap.
        set_threads: `torch.set_num_threads` (replaceable in tests).
        label: what the loop is, for the log line of a switch ("warm start", "GRPO steps").
        margin: `narrow` is chosen only when its rate is at least this fraction below `wide`'s (0.2: 20 % faster).
            On a quiet machine the two can be within noise: on the add18m workload's GRPO steps the rates of 1 and
            2 threads came out 2-17 % apart, either way round, and choosing by that coin looked to cost up to 7 %
            of the steps (within one run's noise). A cliff is 2-10x, far past the margin.

    Raises:
        ValueError: wide <= narrow, narrow < 1, probe_steps / block_steps < 1, or margin outside [0, 1).
    """

    def __init__(
        self,
        wide: int,
        narrow: int,
        *,
        probe_steps: int = 3,
        block_steps: int = 25,
        max_block_steps: int = 400,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        label: str = "warm start",
        margin: float = 0.2,
    ):
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"FasterThreads: margin={margin} must be in [0, 1)")
        if not wide > narrow >= 1:
            raise ValueError(f"FasterThreads: wide={wide} must exceed narrow={narrow}, and narrow must be >= 1")
        if probe_steps < 1 or block_steps < 1:
            raise ValueError(f"FasterThreads: probe_steps={probe_steps} and block_steps={block_steps} must be >= 1")
        self.wide, self.narrow = wide, narrow
        self.probe_steps, self.block_steps, self.max_block_steps = probe_steps, block_steps, max_block_steps
        self._first_block_steps = block_steps
        self.set_threads = set_threads
        self.label = label
        self.margin = margin
        self.rate: dict[int, float] = {}  # thread count -> seconds per padded token, last measured
        self.current = wide
        self.chosen: int | None = None  # None while the first probes run
        self._samples: list[float] = []  # seconds per token of the current probe or block
        self._left = probe_steps  # steps before the next decision
        self.switches = 0  # decisions that changed the count (logged)

    def start(self) -> None:
        """Set the first count to probe (`wide`)."""
        self.set_threads(self.wide)

    def after_step(self, seconds: float, tokens: int) -> None:
        """Record one step (its wall seconds and padded tokens) and, at the end of a probe or a block, choose."""
        per_token = seconds / max(tokens, 1)
        self._samples.append(per_token)
        self._left -= 1
        other = self.narrow if self.current == self.wide else self.wide
        probing = self.chosen is None or self.current != self.chosen
        incumbent = self.rate.get(self.chosen if self.chosen is not None else other)
        recent = self._samples
        if probing and incumbent is not None and per_token > 2 * incumbent:
            self._left = 0  # a clear loser: end its probe now
        elif not probing and other in self.rate and per_token > 2 * self.rate[other]:
            self._left = 0  # the chosen count became a cliff (a neighbour arrived): probe the other now
            recent = self._samples[-self.probe_steps :]  # its rate now, not the block's
        if self._left > 0:
            return
        self.rate[self.current] = sorted(recent)[len(recent) // 2]
        self._samples = []
        if other not in self.rate:  # first probes: now the other count
            self._switch(other, self.probe_steps)
            return
        if probing:  # a probe ended: keep the faster count for a block
            narrower = self.rate[self.narrow] < (1.0 - self.margin) * self.rate[self.wide]
            best = self.narrow if narrower else self.wide
            same = best == self.chosen
            if self.chosen is not None and best != self.chosen:
                self.switches += 1
                logger.info(
                    "%s: now %d torch threads, not %d (%.3g against %.3g s per 1k tokens)",
                    self.label, best, self.chosen, 1e3 * self.rate[best], 1e3 * self.rate[self.chosen],
                )  # fmt: skip
            elif self.chosen is None:
                logger.info(
                    "%s: %d torch threads (%s s per 1k padded tokens, first probes)",
                    self.label, best, {n: round(1e3 * r, 4) for n, r in self.rate.items()},
                )  # fmt: skip
            self.block_steps = min(2 * self.block_steps, self.max_block_steps) if same else self._first_block_steps
            self.chosen = best
            self._switch(best, self.block_steps)
            return
        self._switch(other, self.probe_steps)  # a block ended: probe the other count again

    def _switch(self, threads: int, steps: int) -> None:
        if threads != self.current:
            self.set_threads(threads)
            self.current = threads
        self._left = steps


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model`'s first `nn.ModuleList` (a transformers causal LM's decoder layers), else `[model]`."""
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [model])


class StepThreads:
    """The trainer's torch thread ceiling over GRPO optimizer steps, measured: every core it was given (`full`) or
    one fewer, whichever computes a padded token faster now (`FasterThreads` over whole steps).

    On a quiet machine every core is faster. Beside another process that computes on one of them, OpenMP's threads
    wait at every operation for the one that shares its core, and every core becomes a cliff: on 2 cores beside one
    `nice -n 19` busy loop our default step took 10.1 s against 0.87 s alone, and TRL `GRPOTrainer`'s (torch's
    default threads) 14.7 s against 1.43 s. Measured, the same runs stepped 1.39 and 1.28 s, 126 of 130 and 136 of
    140 steps on one thread (docs/performance.md, "A busy machine"). The warm start measures the same choice
    (`warm_start_threads`); this carries it into the GRPO steps, where a neighbour may arrive at any time.

    The rate is the step's wall seconds (`begin` to `end`) per padded token position the model's first decoder
    layer saw in forward passes during it (counted by a forward pre-hook on that layer: `(batch, seq, hidden)`
    inputs count batch x seq). A step that saw no token (every micro-batch skipped) is not a sample, nor is the
    first step (allocator and lazy initialisation: 1.17 s against 0.7-0.8 s for the next ones on the add18m
    workload).

    Args:
        model: the policy; the hook goes on `decoder_layers(model)[0]`.
        full: the ceiling's wide count (every core, or `torch_num_threads`); must be >= 2 (one thread leaves no
            choice).
        set_ceiling: called with the ceiling to use from now on (`torch.set_num_threads`, or a `ThreadGovernor`'s).
        clock: `time.perf_counter` (replaceable in tests).
        probe_steps, block_steps, max_block_steps: as in `FasterThreads`.

    Raises:
        ValueError: full < 2.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        full: int,
        set_ceiling: Callable[[int], None],
        *,
        clock: Callable[[], float] = time.perf_counter,
        probe_steps: int = 3,
        block_steps: int = 25,
        max_block_steps: int = 400,
    ):
        if full < 2:
            raise ValueError(f"StepThreads: full={full} leaves no choice; it must be >= 2")
        self.chooser = FasterThreads(
            full, full - 1, set_threads=set_ceiling, label="GRPO steps",
            probe_steps=probe_steps, block_steps=block_steps, max_block_steps=max_block_steps,
        )  # fmt: skip
        self.clock = clock
        self.tokens = 0  # padded token positions of the current step's forward passes
        self._t0: float | None = None
        self._unmeasured = 1  # the first step warms up; it is not a sample
        decoder_layers(model)[0].register_forward_pre_hook(self._count, with_kwargs=True)
        self.chooser.start()

    @property
    def ceiling(self) -> int:
        """The thread count in use now: the chosen one, or the one being probed."""
        return self.chooser.current

    def _count(self, _module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
        if self._t0 is not None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            self.tokens += hidden.numel() // (hidden.shape[-1] if hidden.is_floating_point() else 1)

    def begin(self) -> None:
        """A step starts: count its tokens and time it."""
        self.tokens = 0
        self._t0 = self.clock()

    def end(self) -> None:
        """The step ended: record its rate; at the end of a probe or block this may change the ceiling."""
        if self._t0 is None:
            return
        seconds, self._t0 = self.clock() - self._t0, None
        if self._unmeasured > 0:
            self._unmeasured -= 1
        elif self.tokens > 0:
            self.chooser.after_step(seconds, self.tokens)

    def metrics(self) -> dict[str, float]:
        """`trainer/thread_ceiling`: the torch threads the step may use now (after this step's choice)."""
        return {"trainer/thread_ceiling": float(self.ceiling)}


def vllm_cpu_threads(mode: str, trainer_threads: int | None = None, cores: int | None = None) -> int | None:
    """OMP_NUM_THREADS for a vLLM CPU server this run launches under the resolved `mode`: None (torch's default,
    every core) for time_slice, which gives vLLM the machine while the trainer waits; the cores the trainer leaves
    free for overlap beside a trainer held to `trainer_threads` < `cores`; else (adaptive, and overlap beside a
    trainer on every core) half the cores, at least 1. Two thread pools on every core at once made the vs_trl step
    5x slower (26.9 s against 5.2 s adaptive on 2 cores)."""
    cores = cores or len(os.sched_getaffinity(0))
    if mode == "time_slice":
        return None
    if mode == "overlap" and trainer_threads is not None and trainer_threads < cores:
        return cores - trainer_threads
    return max(1, cores // 2)


class TimeSlice:
    """A context manager around one optimizer step: pause the live replicas on entry, resume them on exit.

    Args:
        replicas: the run's vLLM replicas.
        enabled: False makes it a no-op (`resource_sharing` resolved to overlap).
        threads: the measured thread ceiling of the steps (`StepThreads` over `torch.set_num_threads`), or None to
            keep torch's count.

    Attributes:
        paused_s: seconds the replicas were paused by the last step (0 when disabled); logged as
            `inference/paused_for_training_s`.
    """

    def __init__(self, replicas: ReplicaSet, enabled: bool, threads: StepThreads | None = None):
        self.replicas = replicas
        self.enabled = enabled
        self.threads = threads
        self.paused_s = 0.0
        self._paused: list[VLLMControlClient] = []
        self._t0 = 0.0

    @classmethod
    def for_run(
        cls, config, replicas: ReplicaSet, launched_here: bool, model: torch.nn.Module | None = None
    ) -> TimeSlice | ThreadGovernor:
        """The run's sharing of the machine (logged once): a `ThreadGovernor` over `model` when `resource_sharing`
        resolves to adaptive, else a time slice, enabled for time_slice.

        Both measure the steps' thread ceiling (`StepThreads`: every core or one fewer) when `measure_step_threads`
        says so for this run; the time slice only while it pauses vLLM (the trainer then has the cores to itself)."""
        mode = resolve_for_config(config, launched_here)
        logger.info("resource_sharing=%s -> %s", config.inference.resource_sharing, mode)
        full = config.compute.torch_num_threads or torch.get_num_threads()
        measure = model is not None and measure_step_threads(config, launched_here, full)
        if mode == "adaptive" and model is not None:
            cores = len(os.sched_getaffinity(0))  # low: the cores vLLM does not compute on (never oversubscribed)
            low = max(1, min(full, cores - (vllm_cpu_threads(mode, cores=cores) or 0)))
            return ThreadGovernor(replicas, full, low, measure=measure).install(model)
        enabled = mode == "time_slice"
        threads = StepThreads(model, full, torch.set_num_threads) if enabled and measure else None
        return cls(replicas, enabled, threads)

    @property
    def pauses_inference(self) -> bool:
        """True when each optimizer step pauses vLLM (time_slice): a weight push cannot run beside the step."""
        return self.enabled

    def metrics(self) -> dict[str, float]:
        """`inference/paused_for_training_s`: seconds the replicas were paused by the last step; with measured
        threads also `trainer/thread_ceiling` (`StepThreads.metrics`)."""
        return {"inference/paused_for_training_s": self.paused_s, **(self.threads.metrics() if self.threads else {})}

    def __enter__(self) -> TimeSlice:
        if not self.enabled:
            return self
        if self.threads is not None:
            self.threads.begin()
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
        if self.threads is not None and exc[0] is None:  # a failed step is not a sample
            self.threads.end()


class ThreadGovernor:
    """`resource_sharing: adaptive`: the trainer's torch threads follow vLLM's activity; a context manager around
    one optimizer step (vLLM is never paused).

    With `measure`, the two counts are a ceiling measured over whole steps (`StepThreads`, set up by `install`):
    every core, or one fewer for both counts (`full_threads - 1` while vLLM is idle, `low_threads - 1`, at least
    1, while it generates) when that is faster now, e.g. beside another process computing on one of the cores.

    Args:
        replicas: the run's vLLM replicas; vLLM is busy while any live replica has a request in flight.
        full_threads: threads while vLLM is idle (every core, or `torch_num_threads`).
        low_threads: threads while vLLM generates (the cores `vllm_cpu_threads` left to the trainer).
        set_threads, clock: `torch.set_num_threads` and `time.perf_counter` (replaceable in tests).
        measure: measure the ceiling over the steps (`measure_step_threads`); needs full_threads >= 2.

    Attributes:
        reduced_s: seconds of the last step computed on fewer threads than the ceiling; logged as
            `trainer/reduced_threads_s`.
        switches: thread-count changes so far.
        ceiling: the count while vLLM is idle now (`full_threads`, or one fewer when measured to be faster).
        steps: the `StepThreads` measuring the ceiling (None without `measure`, or before `install`).
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        full_threads: int,
        low_threads: int,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        measure: bool = False,
    ):
        if not 1 <= low_threads <= full_threads:
            raise ValueError(f"low_threads={low_threads} must be in [1, full_threads={full_threads}]")
        self.replicas, self.full, self.low = replicas, full_threads, low_threads
        self._set, self._clock = set_threads, clock
        self.measure = measure and full_threads >= 2
        self.threads = full_threads
        self.ceiling = full_threads
        self.steps: StepThreads | None = None
        self.reduced_s = 0.0
        self.switches = 0
        self._last: float | None = None  # inside a step: when the thread count was last checked

    @property
    def pauses_inference(self) -> bool:
        """False: vLLM keeps generating beside every step (only the trainer's threads change)."""
        return False

    def install(self, model: torch.nn.Module) -> ThreadGovernor:
        """Check the thread count before the forward of each of `model`'s decoder layers (`decoder_layers`: the
        modules of its first `nn.ModuleList`, else the model itself) and before the backward through each one's
        output; with `measure`, time its steps (`StepThreads`)."""
        for layer in decoder_layers(model):
            layer.register_forward_pre_hook(self._before_forward)
            layer.register_forward_hook(self._on_output)
        if self.measure:
            self.steps = StepThreads(model, self.full, self._set_ceiling, clock=self._clock)
        return self

    def _set_ceiling(self, threads: int) -> None:
        self.ceiling = threads  # applied at the next check

    def _before_forward(self, *_) -> None:
        self.update()  # returns None: a pre-hook's return value would replace the layer's inputs

    def _on_output(self, _module, _inputs, output) -> None:
        """Arm a gradient hook on the layer's output: it fires just before the backward through the layer."""
        out = output[0] if isinstance(output, tuple) else output
        if self._last is not None and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)

    def _before_backward(self, _grad) -> None:
        self.update()  # returns None: the gradient passes unchanged

    def update(self) -> None:
        """Inside a step: account the time since the last check, then set `low_threads` while a generation request
        is in flight, else `full_threads` (outside a step: nothing, e.g. evaluation and `old_logps` passes)."""
        if self._last is None:
            return
        now = self._clock()
        if self.threads != self.ceiling:
            self.reduced_s += now - self._last
        self._last = now
        busy = any(r.in_flight > 0 for r in self.replicas.live())
        self._apply(max(1, self.low - (self.full - self.ceiling)) if busy else self.ceiling)

    def _apply(self, threads: int) -> None:
        if threads != self.threads:
            self._set(threads)
            self.threads = threads
            self.switches += 1

    def __enter__(self) -> ThreadGovernor:
        self.reduced_s = 0.0
        if self.steps is not None:
            self.steps.begin()
        self._last = self._clock()
        self.update()
        return self

    def __exit__(self, *exc) -> None:
        """Account the step's last stretch, record its rate (`measure`), and leave the ceiling set (every core
        unless measured otherwise), whatever the step did."""
        self.update()
        if self.steps is not None and exc[0] is None:
            self.steps.end()
        self._last = None
        self._apply(self.ceiling)

    def metrics(self) -> dict[str, float]:
        """`trainer/reduced_threads_s` (the last step's seconds below the ceiling), `trainer/thread_switches`
        (cumulative) and, with `measure`, `trainer/thread_ceiling`."""
        return {
            "trainer/reduced_threads_s": self.reduced_s,
            "trainer/thread_switches": float(self.switches),
            **(self.steps.metrics() if self.steps is not None else {}),
        }
