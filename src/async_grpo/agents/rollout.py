"""The agent rollout: an unmodified agent calls an OpenAI-compatible endpoint, and its calls become GRPO rows.

The implementation of the `Rollout` seam (`orchestrator.rollout`) for `agent` / `agent_command` (docs/agents.md).
For one prompt and its G samples:

1. G episodes start at once, each with its own session on the endpoint (`agents.endpoint.AgentEndpoint`, served on
   the calling event loop, one per loop) and so its own API key: concurrent episodes never mix.
2. Each episode runs the agent (`agents.execution`: a function or a command) on the dataset row with the endpoint's
   `base_url` and the episode's key, under `agent_timeout_s`. Every model call it makes is served by the run's vLLM
   through the rollout's generation client and recorded exactly (`agents.trajectory.ModelCall`).
3. The episode's calls are joined into segments by token prefix as they arrive (`agents.trajectory.add_call`); each segment
   is one row of the group, and `RolloutGroup.episode_index` says whose episode it is, so the advantage is the
   episode's (the batcher computes it over the G episodes, `orchestrator.batching`). The group's `prompt_ids` are
   the longest token prefix all rows' first prompts share; a row's own remainder of its first prompt opens its
   completion, loss-masked.
4. Every row is scored with the reward functions (TRL's contract): the completion is the episode's final
   conversation after its first request's messages (TRL's conversational form, tool calls included) or, for an
   agent using `/v1/completions`, its last completion's text; the agent's return value is the keyword column
   `agent_reward` (`builtin:agent_reward` returns it).

Faults (`AGENT_FAULTS`, counted per episode in `agent/faults/<kind>`, never a crash): `exception`, `timeout`,
`bad_return` (`agents.execution`), `no_call` (the agent made no model call) and `max_turns` (it tried a call past
`max_turns`, refused with an API error it saw). An episode keeps the calls it made before its fault and is scored
with the others (its return value None). An episode without any call is one loss-masked token (the EOS id) after
the group's prompt, scored as the others, so the group keeps G episodes; a group in which no episode made a call is
dropped (`agent_no_call`), and so is one whose rows share no prompt token (`agent_no_shared_prompt`). vLLM failing
or aborting a call drops the group as every rollout does (`aborted`, `generation_error`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from async_grpo.agents.endpoint import REFUSAL_KINDS, AgentEndpoint, EndpointBinding, EpisodeSession
from async_grpo.agents.execution import AgentOutcome, AgentRunner
from async_grpo.agents.trajectory import Segment, common_prefix
from async_grpo.data import PromptItem
from async_grpo.inference.client import GenerationClient, GenerationError
from async_grpo.orchestrator.env_rollout import all_or_none
from async_grpo.orchestrator.rollout import RolloutDropped, SamplingSettings, score_group
from async_grpo.rewards.agent_reward import AGENT_REWARD_COLUMN
from async_grpo.transports.messages import RolloutGroup
from async_grpo.transports.scorer import Scorer

logger = logging.getLogger(__name__)

AGENT_FAULTS = ("exception", "timeout", "bad_return", "no_call", "max_turns")
AGENT_LOG_COLUMN = "agent_log"  # the completions table's column with the tail of each episode's output
LOCAL_BINDING = EndpointBinding()  # 127.0.0.1, any free port: the agents run on this machine
_SEED_STRIDE = 7919  # per-episode seed offset when the caller seeds (evaluation)


@dataclass
class _Episode:
    """One finished episode: its session (the calls and their segments) and its outcome."""

    session: EpisodeSession
    outcome: AgentOutcome

    @property
    def segments(self) -> list[Segment]:
        """The episode's rows (`EpisodeSession.segments`)."""
        return self.session.segments

    def faults(self) -> dict[str, int]:
        out = dict.fromkeys(AGENT_FAULTS, 0)
        if self.outcome.fault is not None:
            out[self.outcome.fault] = 1
        out["no_call"] = int(not self.session.calls)
        out["max_turns"] = int(self.session.refused["max_turns"] > 0)
        return out

    def stats(self) -> dict[str, float]:
        faults = self.faults()
        out = {
            "agent/calls": float(len(self.session.calls)),
            "agent/segments": float(len(self.segments)),
            "agent/history_rewrites": float(max(len(self.segments) - 1, 0)),
            "agent/seconds": self.outcome.seconds,
            "agent/faults": float(sum(faults.values())),
            "agent/truncated": float(self.session.budget_exhausted or any(s.finish_reason == "length"
                                                                          for s in self.segments)),
        }  # fmt: skip
        out.update({f"agent/faults/{k}": float(v) for k, v in faults.items()})
        out.update({f"agent/refused/{k}": float(self.session.refused[k]) for k in REFUSAL_KINDS})
        return out


class AgentRollout:
    """The agent rollout (see the module docstring).

    Args:
        scorer: the run's reward backend.
        tokenizer: the policy's tokenizer (the endpoint renders chat requests with its template).
        runner: runs one episode of the agent (`agents.execution.FunctionAgent` or `CommandAgent`); closed by
            `close`.
        max_turns: most model calls per episode (verifiers' name), >= 1.
        timeout_s: wall-clock limit of one episode (agent_timeout_s, seconds).
        binding: where each loop's endpoint listens and the host its URL names (the default: 127.0.0.1 and any free
            port, the agents run on this machine; all interfaces on the platform's ports when they run on the reward
            service, `agents.remote.endpoint_binding`).

    Raises:
        ValueError: max_turns < 1 or timeout_s <= 0.
    """

    def __init__(
        self,
        scorer: Scorer,
        tokenizer: Any,
        runner: AgentRunner,
        *,
        max_turns: int,
        timeout_s: float,
        binding: EndpointBinding = LOCAL_BINDING,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1. Fix: allow the agent at least one model call.")
        if timeout_s <= 0:
            raise ValueError(f"agent_timeout_s={timeout_s} must be > 0 seconds.")
        self.scorer, self.tokenizer, self.runner = scorer, tokenizer, runner
        self.max_turns, self.timeout_s, self.binding = max_turns, timeout_s, binding
        self.tool_schemas: list[dict] = []  # the agent offers its own tools, in its requests
        self._endpoints: dict[asyncio.AbstractEventLoop, AgentEndpoint] = {}

    def without_tools(self) -> None:
        """None: the run offers no tools of its own (the agent's are its business; `Rollout.without_tools`)."""
        return None

    def close(self) -> None:
        """Release the agent runner's threads (each loop's endpoint is closed by `aclose` on that loop)."""
        self.runner.close()

    async def aclose(self) -> None:
        """Stop the endpoint served on the running loop (`Rollout.aclose`): the orchestrator and the held-out
        evaluation await this when their loop ends."""
        endpoint = self._endpoints.pop(asyncio.get_running_loop(), None)
        if endpoint is not None:
            await endpoint.aclose()

    async def endpoint(self) -> AgentEndpoint:
        """The endpoint of the running loop, started at its first use there.

        Raises:
            TimeoutError: it did not start (`AgentEndpoint.start`).
            OSError: no port of its range is free.
        """
        loop = asyncio.get_running_loop()
        if loop not in self._endpoints:
            b = self.binding
            endpoint = AgentEndpoint(
                self.tokenizer, b.host, port=b.port, port_count=b.port_count, advertise_host=b.advertise_host
            )
            await endpoint.start()
            if loop in self._endpoints:  # another group started one meanwhile
                await endpoint.aclose()
            else:
                self._endpoints[loop] = endpoint
                logger.info("agent endpoint serving at %s", endpoint.url)
        return self._endpoints[loop]

    async def __call__(
        self,
        client: GenerationClient,
        item: PromptItem,
        sampling: SamplingSettings,
        *,
        version: Callable[[], int],
        seed: int | None = None,
    ) -> RolloutGroup:
        """See `Rollout.__call__` and the module docstring. The group has one row per segment (>= G rows), with
        `episode_index` set; `rollout_stats` holds each row's episode's `agent/*` numbers.

        Raises:
            RolloutDropped: "agent_no_call", "agent_no_shared_prompt", or "aborted" (vLLM aborted a call).
            GenerationError, httpx.HTTPError: vLLM failed a call (the orchestrator counts `generation_error`).
            RewardError: the reward functions failed.
        """
        endpoint = await self.endpoint()
        row = {"prompt": item.prompt, **item.columns}
        sessions = [
            endpoint.open_session(
                client, sampling, version, max_turns=self.max_turns,
                seed=None if seed is None else seed + _SEED_STRIDE * i,
            )
            for i in range(sampling.num_generations)
        ]  # fmt: skip
        try:
            outcomes = await all_or_none([self.runner.run(row, endpoint.url, s.key, self.timeout_s) for s in sessions])
        finally:  # every key revoked, and no request of the group left in flight (cancelled, then awaited)
            for session in sessions:
                endpoint.close_session(session)
            await asyncio.gather(*(session.drain() for session in sessions))
        for session in sessions:
            if session.error is not None:
                if isinstance(session.error, GenerationError) and "aborted" in str(session.error):
                    raise RolloutDropped("aborted", str(session.error))
                raise session.error
        episodes = [_Episode(s, o) for s, o in zip(sessions, outcomes, strict=True)]
        group = self._group(item, episodes, version)
        columns = {AGENT_REWARD_COLUMN: [episodes[e].outcome.value for e in group.episode_index]}
        await score_group(self.scorer, group, columns)
        group.reward_extra[AGENT_LOG_COLUMN] = [episodes[e].outcome.log for e in group.episode_index]
        return group

    def _group(self, item: PromptItem, episodes: list[_Episode], version: Callable[[], int]) -> RolloutGroup:
        """The rows of the group (module docstring, step 3)."""
        segments = [seg for ep in episodes for seg in ep.segments]
        if not segments:
            raise RolloutDropped("agent_no_call", f"none of the {len(episodes)} episodes made a model call")
        prompt_ids = common_prefix([seg.prompt_ids for seg in segments])
        if not prompt_ids:
            raise RolloutDropped("agent_no_shared_prompt", "the episodes' first prompts share no token")
        rows: dict[str, list] = {k: [] for k in ("ids", "logprobs", "mask", "versions", "truncated", "completions",
                                                  "stats", "episode")}  # fmt: skip
        eos = self.tokenizer.eos_token_id
        for e, ep in enumerate(episodes):
            stats = ep.stats()
            completion = _completion(ep.session)
            for k, seg in enumerate(ep.segments or [None]):
                if seg is None:  # no call: one loss-masked token, scored with the others
                    ids, logprobs, mask, versions, cut = [eos], [0.0], [0], [version()], False
                else:
                    head = seg.prompt_ids[len(prompt_ids) :]
                    first = seg.versions[0]
                    ids, logprobs = head + seg.ids, [0.0] * len(head) + seg.logprobs
                    mask, versions = [0] * len(head) + seg.mask, [first] * len(head) + seg.versions
                    last = k == len(ep.segments) - 1
                    cut = seg.finish_reason == "length" or (last and ep.session.budget_exhausted)
                for name, value in zip(("ids", "logprobs", "mask", "versions", "truncated", "completions", "stats",
                                        "episode"), (ids, logprobs, mask, versions, cut, completion, stats, e),
                                       strict=True):  # fmt: skip
                    rows[name].append(value)
        return RolloutGroup(
            prompt_ids=prompt_ids, completion_ids=rows["ids"], sampling_logprobs=rows["logprobs"],
            truncated=rows["truncated"], completions=rows["completions"],
            prompt=_prompt(episodes, item), columns=item.columns,
            policy_version=min(v for row in rows["versions"] for v in row), loss_mask=rows["mask"],
            token_versions=rows["versions"], episode_index=rows["episode"],
            rollout_stats={k: [st[k] for st in rows["stats"]] for k in rows["stats"][0]},
        )  # fmt: skip


def _prompt(episodes: list[_Episode], item: PromptItem) -> Any:
    """The group's prompt for the reward functions: the first episode with a call's first request (its messages, or
    its text prompt), else the dataset's."""
    for ep in episodes:
        if ep.session.first_request is not None:
            return ep.session.first_request
    return item.prompt


def _completion(session: EpisodeSession) -> Any:
    """An episode's completion for the reward functions (module docstring, step 4): the final conversation after
    the first request's messages, or the last completion's text; "" when it made no call."""
    final, first = session.final_conversation, session.first_request
    if isinstance(final, list):
        if (
            isinstance(first, list)
            and len(final) >= len(first)
            and all(_same(a, b) for a, b in zip(final, first, strict=False))
        ):
            return final[len(first) :]
        return final
    return final if isinstance(final, str) else ""


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")
