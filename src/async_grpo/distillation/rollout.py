"""The training rollout with the teacher's logprobs: `TeacherRollout` wraps the run's rollout (single-turn or an
environment's) and, once a group is generated and scored, asks the teacher for the logprob of every sampled token.

Only the orchestrator's rollout is wrapped (`with_teacher`, called by `runner.builders.build_producer`): held-out
evaluation runs the run's own rollout unwrapped and never asks the teacher. A multi-turn group's completion holds
tool and environment tokens (loss mask 0) among the model's: the whole completion is scored, as the teacher reads it in
context, and the trainer masks what the policy did not sample.

The teacher's client is asynchronous, so it is built on the event loop that calls the rollout (lazily, at its first
group: the orchestrator's loop) and closed there by `aclose`, which the orchestrator awaits when its loop ends, as it
closes its generation client.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from async_grpo.config.sections.distillation import DistillationConfig
from async_grpo.data import PromptItem
from async_grpo.distillation.teacher import TeacherClient, TeacherError, teacher_url
from async_grpo.inference.client import GenerationClient
from async_grpo.orchestrator.rollout import Rollout, SamplingSettings
from async_grpo.transports.messages import EpisodeSpan, RolloutGroup

logger = logging.getLogger(__name__)

TEACHER_SPAN = "teacher"  # the span name of a teacher request in an episode's trace
TEACHER_SPAN_KIND = "EVALUATOR"  # mlflow.entities.SpanType: the teacher judges the sampled tokens


class TeacherRollout:
    """A `Rollout` (`orchestrator.rollout`) that adds the teacher's logprobs to each group of an inner rollout.

    Each call runs `inner`, then one `TeacherClient.score_group` request for the group: `group.teacher_logprobs` (G
    lists of (T_i,) floats, NaN where the teacher gave none), `group.teacher_topk_ids` and
    `group.teacher_topk_logprobs` (G lists of (T_i,) lists of K, the teacher's K most likely tokens at each position,
    padded with 0 / NaN; [] when the client's `topk` is 0) and `group.teacher_seconds` (the request's wall-clock
    seconds, the wait for a free request slot and retries included) are filled. When the group records episode spans
    (`group.spans` non-empty: the run traces episodes), each episode gains a "teacher" span (kind "EVALUATOR") over the
    request, with attributes `seconds`, `tokens` (T_i, the completion's tokens scored) and `unscored_tokens` (those
    with NaN), and outputs {"mean_logprob": the mean finite teacher logprob of the completion, None without any}.

    Args:
        inner: the run's rollout (the caller closes it: the runner, which also evaluates with it).
        make_teacher: builds the teacher's client; called inside the event loop that runs the rollout, once per loop.

    Attributes:
        tool_schemas: the inner rollout's.
    """

    def __init__(self, inner: Rollout, make_teacher: Callable[[], TeacherClient]):
        self.inner = inner
        self.make_teacher = make_teacher
        self._teacher: TeacherClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def tool_schemas(self) -> list[dict]:
        """The inner rollout's tool schemas (`Rollout.tool_schemas`)."""
        return self.inner.tool_schemas

    def without_tools(self) -> Rollout | None:
        """The inner rollout's `without_tools()`, without the teacher: it serves held-out evaluation only."""
        return self.inner.without_tools()

    def close(self) -> None:
        """Forget the teacher's client (its connections are closed by `aclose` on its own loop; after that loop ended
        they cannot be). The inner rollout is not closed: it belongs to the caller."""
        if self._teacher is not None:
            logger.debug("teacher client dropped without aclose (its event loop is gone)")
        self._teacher = self._loop = None

    async def aclose(self) -> None:
        """Close the teacher's client, when it was built on the running loop (the orchestrator awaits this when its
        loop ends, under a time-out)."""
        teacher, loop = self._teacher, self._loop
        self._teacher = self._loop = None
        if teacher is not None and loop is asyncio.get_running_loop():
            await teacher.aclose()

    def _client(self) -> TeacherClient:
        """The teacher's client of the running loop, built at the first call on it (a call on another loop builds
        another one: the first loop's client cannot serve it)."""
        loop = asyncio.get_running_loop()
        if self._teacher is None or self._loop is not loop:
            if self._teacher is not None:
                logger.warning("the rollout runs on a new event loop: a new teacher client is built for it")
            self._teacher, self._loop = self.make_teacher(), loop
        return self._teacher

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """The inner rollout's group, with `teacher_logprobs`, `teacher_topk_ids`, `teacher_topk_logprobs` and
        `teacher_seconds` filled (see the class).

        Raises:
            TeacherError / TeacherTimeout: the teacher could not score the group (the orchestrator drops and counts
                it: `dropped_groups/teacher_error`, `dropped_groups/teacher_timeout`), or its answer does not fit the
                group's shapes (`RolloutGroup.check_teacher_logprobs`).
            whatever the inner rollout raises (`Rollout.__call__`).
        """
        group = await self.inner(client, item, sampling, version=version, seed=seed)
        teacher = self._client()
        start_ns, t0 = time.time_ns(), time.monotonic()
        scores = await teacher.score_group(group.prompt_ids, group.completion_ids)
        group.teacher_seconds = time.monotonic() - t0
        group.teacher_logprobs = scores.logprobs
        group.teacher_topk_ids = scores.topk_ids
        group.teacher_topk_logprobs = scores.topk_logprobs
        end_ns = time.time_ns()
        try:
            group.check_teacher_logprobs()
        except ValueError as err:  # the client returns one row per completion token: a bug if this fires
            raise TeacherError(f"the teacher's logprobs do not fit the group: {err}") from err
        if group.spans:
            _add_teacher_spans(group, start_ns, end_ns)
        return group


def _add_teacher_spans(group: RolloutGroup, start_ns: int, end_ns: int) -> None:
    """Append one "teacher" span to each episode of `group` (see `TeacherRollout`)."""
    for spans, row in zip(group.spans, group.teacher_logprobs, strict=True):
        finite = [lp for lp in row if not math.isnan(lp)]
        spans.append(
            EpisodeSpan(
                TEACHER_SPAN,
                TEACHER_SPAN_KIND,
                start_ns,
                end_ns,
                outputs={"mean_logprob": sum(finite) / len(finite) if finite else None},
                attributes={
                    "seconds": group.teacher_seconds,
                    "tokens": len(row),
                    "unscored_tokens": len(row) - len(finite),
                },
            )
        )


def with_teacher(section: DistillationConfig, rollout: Rollout) -> Rollout:
    """The orchestrator's rollout: `rollout` itself when the run does not distill (`section.enabled` False), else a
    `TeacherRollout` around it whose client is built from `section` (`TeacherClient.from_config`) on the
    orchestrator's loop.

    Raises:
        ValueError: the run distills but `teacher_url` is not set (the launcher sets it for a teacher it serves from
            `teacher_model_name_or_path`) or is not an http(s) URL.
    """
    if not section.enabled:
        return rollout
    teacher_url(section)  # checked now, before anything starts
    return TeacherRollout(rollout, lambda: TeacherClient.from_config(section))
