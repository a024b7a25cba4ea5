"""Typed messages that cross role boundaries. Plain Python lists (no torch), so every role can import them.

Each struct names its producer and consumer. Roles never import each other's internals: the
orchestrator and the trainer meet only here and in `transports.queue`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


# Rollout -> the run's episode traces (issue 53)
@dataclass(frozen=True)
class EpisodeSpan:
    """One timed part of a sampled episode: a span of its MLflow trace (`tracking.Tracker.log_episode_traces`).

    Recorded by the rollout (generation turns, tool calls, environment steps) and by `score_group` (reward
    functions) only when the run traces episodes (`log_traces_steps` > 0); JSON-safe values only.

    Attributes:
        name: "generation" (a single-turn sample), "turn <k>" (the k-th generation of a multi-turn episode, from 1),
            "tool <name>" (a tool call), "env step <k>" (the environment's answer to turn k), "reward <function>".
        kind: the MLflow span type (`mlflow.entities.SpanType`): "LLM" for a generation, "TOOL" for a tool call,
            "TASK" for an environment step, "EVALUATOR" for a reward function.
        start_ns, end_ns: wall-clock times (`time.time_ns()`), nanoseconds since the epoch. A generation of G samples
            in one request, and a reward function called once for the group, give every episode the same times.
        inputs: what went in: a tool call's arguments, an environment step's action (the model's turn text).
        outputs: what came out: a tool's result, an environment's reply, a reward value.
        attributes: numbers and labels: `prompt_tokens`, `completion_tokens`, `policy_version`, `finish_reason`
            (generations); `error` (the failure kind of a tool call or environment step, e.g. "malformed",
            "unknown_tool", "timeout"; absent when it succeeded).
    """

    name: str
    kind: str
    start_ns: int
    end_ns: int
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    attributes: dict = field(default_factory=dict)


# Orchestrator -> Trainer
@dataclass
class RolloutGroup:
    """One prompt and its `num_generations` sampled completions, scored and stamped.

    Shapes use G = group size (num_generations), F = number of reward functions, T_i = tokens of
    completion i.

    Attributes:
        prompt_ids: (P,) prompt token ids exactly as sent to vLLM.
        completion_ids: G lists, (T_i,) sampled token ids each, EOS included when generated.
        sampling_logprobs: G lists, (T_i,) vLLM processed logprobs (nats) of each sampled token.
        truncated: (G,) True when the completion hit max_completion_length (finish_reason "length").
        completions: (G,) decoded completion texts (for reward functions and sample tables).
        prompt: the prompt as given by the dataset (string or list of chat messages).
        columns: the dataset row's other columns, passed to reward functions as keyword arguments.
        rewards_per_func: G rows of F floats; NaN where a function returned None.
        rewards: (G,) weighted reward per completion (nansum over functions).
        advantages: (G,) per-completion advantage (filled by the orchestrator's batcher).
        policy_version: the oldest trainer policy version whose weights sampled any token of this group
            (staleness = current version - policy_version). With `token_versions` given it is their minimum.
        replayed: True for a copy drawn from the orchestrator's replay buffer (`replay_buffer_size`) in
            place of a zero-std group. It is deliberately old: the rollout queue never drops it as stale,
            and with `replay_recompute_logps` the trainer treats its rows as on-policy.
        rerolled: True when the prompt was generated again by deferred re-roll (`reroll_start_fraction`)
            after an earlier group of it scored ~0. Informational.
        loss_mask: G lists, (T_i,) 1 for a token the policy sampled and is trained on, 0 for a token it did
            not sample (tool output in a multi-turn rollout): no policy loss, KL, entropy, IS ratio or token
            count there. Empty (the default) means all ones.
        token_versions: G lists, (T_i,) the policy version that sampled each token (a multi-turn rollout whose
            turns straddle a weight push carries two). Empty (the default) means `policy_version` everywhere.
        reward_extra: column -> G values the reward functions logged with TRL's `log_extra` (completions table).
        reward_metrics: name -> values the reward functions logged with TRL's `log_metric` (step means).
        rollout_stats: per-completion numbers the rollout recorded, name -> (G,) floats (the multi-turn rollout's
            `tools/calls`, `tools/failures`, `tools/turns`, `tools/seconds`, ...); the batcher turns them into step
            metrics. Empty for a single-turn rollout.
        launch_index: the orchestrator's launch index of the group (its place in the schedule under
            `full_determinism`, which batches, seeds and checkpoints by it); None otherwise.
        reward_seconds: reward function name -> wall-clock seconds its call took for this group, measured where it
            ran (`ScoredGroup.seconds`); empty when the scorer did not time it (a user producer, an older service).
        spans: G lists, the `EpisodeSpan`s of each episode in the order they happened (issue 53's traces); empty
            (the default) when the run does not trace episodes.
        teacher_logprobs: G lists, (T_i,) the teacher's logprob (nats, temperature 1) of each sampled completion
            token given everything before it (`distillation.teacher`: vLLM prompt logprobs of prompt + completion);
            NaN where the teacher gave none. Empty (the default) when the run does not distill (no teacher).
        teacher_topk_ids: G lists, (T_i,) lists of exactly K token ids each: the teacher's K most likely next tokens
            at each completion position given everything before it, by rank (most likely first; vLLM prompt logprobs
            with prompt_logprobs=K, `distillation.teacher.parse_prompt_topk`). 0 pads a position with fewer than K
            entries, and fills every entry of a position the teacher did not score (cut at its context). Empty (the
            default) without top-k (distillation_loss reverse_kl, or no teacher).
        teacher_topk_logprobs: G lists, (T_i,) lists of K floats each: the logprobs (nats, temperature 1, normalized
            over the teacher's whole vocabulary, not over the K) of `teacher_topk_ids`; NaN at every padded entry.
            Empty (the default) without top-k.
        teacher_seconds: wall-clock seconds the teacher's request for this group took, retries included (the metric
            `distill/teacher_seconds`); 0.0 without a teacher.
        episode_index: (rows,) the episode each row belongs to, 0 .. G-1, non-decreasing from 0 in steps of at most
            one: an agent episode whose history was rewritten is several rows (segments, `agents.trajectory`), each
            trained with the episode's advantage (the batcher computes advantages over the G episodes, from each
            episode's first row). Empty (the default): row i is episode i, and G is the number of rows.

    After construction `nonfinite_logprob_tokens` counts the trained tokens whose sampling logprob was NaN or
    infinite: their `loss_mask` is set to 0 (a NaN ratio would poison the step), and the batcher logs the count as
    `sampling/nonfinite_logprob_tokens`.

    Raises:
        ValueError: a per-completion list has the wrong number of rows, or a per-token list the wrong length.
    """

    prompt_ids: list[int]
    completion_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    truncated: list[bool]
    completions: list[str]
    prompt: object
    columns: dict
    policy_version: int
    rewards_per_func: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    replayed: bool = False
    rerolled: bool = False
    loss_mask: list[list[int]] = field(default_factory=list)
    token_versions: list[list[int]] = field(default_factory=list)
    reward_extra: dict[str, list] = field(default_factory=dict)
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    rollout_stats: dict[str, list[float]] = field(default_factory=dict)
    launch_index: int | None = None
    reward_seconds: dict[str, float] = field(default_factory=dict)
    spans: list[list[EpisodeSpan]] = field(default_factory=list)
    teacher_logprobs: list[list[float]] = field(default_factory=list)
    teacher_topk_ids: list[list[list[int]]] = field(default_factory=list)
    teacher_topk_logprobs: list[list[list[float]]] = field(default_factory=list)
    teacher_seconds: float = 0.0
    episode_index: list[int] = field(default_factory=list)

    def __setstate__(self, state: dict) -> None:
        """Unpickle (a checkpoint's replay buffer, `torch.load(weights_only=True)`): a group pickled before a field
        existed gets that field's default."""
        defaults = {
            "reward_seconds": {},
            "spans": [],
            "teacher_logprobs": [],
            "teacher_topk_ids": [],
            "teacher_topk_logprobs": [],
            "teacher_seconds": 0.0,
            "episode_index": [],
        }
        self.__dict__.update(defaults)
        self.__dict__.update(state)

    def __post_init__(self) -> None:
        g = len(self.completion_ids)
        for name in ("sampling_logprobs", "truncated", "completions"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"RolloutGroup.{name} has {len(getattr(self, name))} rows for {g} completions")
        lengths = [len(ids) for ids in self.completion_ids]
        if not self.loss_mask:
            self.loss_mask = [[1] * n for n in lengths]
        if self.token_versions:
            self.policy_version = min((v for row in self.token_versions for v in row), default=self.policy_version)
        else:
            self.token_versions = [[self.policy_version] * n for n in lengths]
        for name in ("sampling_logprobs", "loss_mask", "token_versions"):
            if [len(row) for row in getattr(self, name)] != lengths:
                raise ValueError(f"RolloutGroup.{name} rows must have one entry per completion token")
        # a trained token whose sampling logprob is NaN/inf (a user producer's padding, a broken sampler) would turn
        # the IS ratio and the loss into NaN: it is left out of the loss (loss_mask 0) and counted, never trained on
        self.nonfinite_logprob_tokens = 0
        for row, mask in zip(self.sampling_logprobs, self.loss_mask, strict=True):
            for t, (lp, m) in enumerate(zip(row, mask, strict=True)):
                if m and not math.isfinite(lp):
                    mask[t] = 0
                    self.nonfinite_logprob_tokens += 1
        for name, values in self.rollout_stats.items():
            if len(values) != g:
                raise ValueError(f"RolloutGroup.rollout_stats[{name!r}] has {len(values)} values for {g} completions")
        if self.spans and len(self.spans) != g:
            raise ValueError(f"RolloutGroup.spans has {len(self.spans)} rows for {g} completions")
        if self.teacher_logprobs or self.teacher_topk_ids or self.teacher_topk_logprobs:
            self.check_teacher_logprobs()
        if self.episode_index:
            steps = [b - a for a, b in zip(self.episode_index, self.episode_index[1:], strict=False)]
            if len(self.episode_index) != g or self.episode_index[0] != 0 or any(d not in (0, 1) for d in steps):
                raise ValueError(
                    f"RolloutGroup.episode_index {self.episode_index} must give each of the {g} rows its episode, "
                    "counting 0, 1, ... in row order (a row's episode is the one before it or the next)"
                )

    def episode_rows(self) -> list[int]:
        """(G,) the index of each episode's first row: every row when `episode_index` is empty."""
        if not self.episode_index:
            return list(range(len(self.completion_ids)))
        return [i for i, e in enumerate(self.episode_index) if i == 0 or e != self.episode_index[i - 1]]

    def check_teacher_logprobs(self) -> None:
        """Check the teacher's fields' shapes (the teacher sets them after construction): `teacher_logprobs` G rows
        of T_i values; `teacher_topk_ids` and `teacher_topk_logprobs`, when either is non-empty, G rows of T_i rows of
        one common K > 0 entries each, in both fields.

        Raises:
            ValueError: naming the field: a wrong number of rows, a row whose length is not its completion's, a
                position whose top-k row is not a list of K entries (K differing between positions or fields, or 0),
                or one top-k field given without the other.
        """
        lengths = [len(ids) for ids in self.completion_ids]
        if [len(row) for row in self.teacher_logprobs] != lengths:
            raise ValueError("RolloutGroup.teacher_logprobs rows must have one entry per completion token")
        if not self.teacher_topk_ids and not self.teacher_topk_logprobs:
            return
        widths = {}  # field -> its K
        for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
            rows = getattr(self, name)
            if [len(row) if isinstance(row, list) else -1 for row in rows] != lengths:
                raise ValueError(
                    f"RolloutGroup.{name} must have G={len(lengths)} rows of one top-k list per completion token "
                    f"(completion lengths {lengths}). Fix: set teacher_topk_ids and teacher_topk_logprobs together, "
                    "as `TeacherClient.score_group` returns them"
                )
            ks = {len(position) if isinstance(position, list) else -1 for row in rows for position in row}
            if len(ks) > 1 or ks & {0, -1}:
                raise ValueError(
                    f"RolloutGroup.{name} must hold a list of one common K > 0 entries at every completion position "
                    f"(got lengths {sorted(ks)}; -1: not a list). Fix: pad a position with fewer than K entries "
                    "(id 0, logprob NaN)"
                )
            widths[name] = next(iter(ks), None)
        if len(set(widths.values()) - {None}) > 1:
            raise ValueError(
                f"RolloutGroup.teacher_topk_ids holds K={widths['teacher_topk_ids']} entries per position but "
                f"teacher_topk_logprobs K={widths['teacher_topk_logprobs']}. Fix: one logprob per top-k id"
            )

    @property
    def size(self) -> int:
        """Number of completions (rows): G, or more when an episode is several rows (`episode_index`)."""
        return len(self.completion_ids)

    @property
    def reward_std(self) -> float:
        """Population-free (unbiased, as torch.std) std of the finite rewards; 0.0 if fewer than 2."""
        vals = [r for r in self.rewards if not math.isnan(r)]
        if len(vals) < 2:
            return 0.0
        mean = sum(vals) / len(vals)
        return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


# Orchestrator -> Trainer
@runtime_checkable
class StepBatch(Protocol):
    """What one optimizer step trains on: a `TrainBatch`, or a stream of its chunks
    (`orchestrator.producer.StepStream`, streaming group scoring). The learner iterates the chunks; the runner reads
    these once the step is done.

    Attributes:
        groups: every group of the step (for a stream, those received so far).
        metrics: the step's rollout metrics (for a stream, complete once it was consumed).
        wait_s: seconds the trainer waited for chunks during the step (0.0 for a whole batch).
    """

    @property
    def groups(self) -> list[RolloutGroup]: ...

    @property
    def metrics(self) -> dict[str, float]: ...

    @property
    def wait_s(self) -> float: ...


@dataclass
class TrainBatch:
    """The groups for one optimizer step, with advantages already computed over this batch, or one chunk
    of them (streaming group scoring, `streaming_min_groups`).

    Attributes:
        groups: the rollout groups (each with `advantages` filled).
        metrics: rollout metrics for this step (reward means, lengths, zero-std fraction...), logged by
            the trainer at the step that consumes it. With streaming, the final chunk carries the whole
            step's metrics and earlier chunks carry none.
        final: True on the last (or only) chunk of a step.
    """

    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    final: bool = True

    @property
    def wait_s(self) -> float:
        """Seconds the trainer waited for this batch while training on it: 0.0, since a whole batch is waited for
        before its step starts (a streamed step, `orchestrator.producer.StepStream`, reports its chunk waits)."""
        return 0.0
