"""The rollout a run uses, and the tool-calling, environment and agent parts of its set-up.

With `agent` or `agent_command` set, the run's rollout is `AgentRollout`: the user's agent, called once per episode
against an OpenAI-compatible endpoint in front of vLLM (docs/agents.md); its episodes run where the tool calls run
(here, or on the reward service when one is used). With `environment` set, the run's rollout is `EnvironmentRollout`,
driving the environment the spec names (`environments.load_environment`). With `tools` declared, the run's rollout is
the same `EnvironmentRollout` driving the tool environment (`environments.tools.ToolEnvironment`), its tool calls
running in a local `ToolExecutor` (spawned workers) or, when rewards are scored on the reward service, on that service. Everything
here runs before vLLM or any worker starts, so bad tools, a chat template that cannot carry tool calls and
non-conversational prompts are refused first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from async_grpo.tasks.base import Task

from async_grpo.agents.execution import AgentRunner, CommandAgent, FunctionAgent
from async_grpo.agents.loading import check_agent_command, load_agent
from async_grpo.agents.remote import RemoteAgentRunner, endpoint_binding
from async_grpo.agents.rollout import AgentRollout
from async_grpo.config import GRPOConfig
from async_grpo.config.sections.agents import AGENT_ENDPOINT_PORT_COUNT
from async_grpo.data import PromptItem
from async_grpo.environments import EnvironmentCaller, load_environment
from async_grpo.environments.tools import ToolCallingSettings, ToolEnvironment
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import Rollout, SingleTurnRollout
from async_grpo.rewards.remote import reward_service_url
from async_grpo.rewards.tool_routes import tool_executor
from async_grpo.tools.executor import ToolBackend
from async_grpo.tools.loading import load_tools
from async_grpo.tools.remote import RemoteToolExecutor
from async_grpo.tools.render import turn_pairs
from async_grpo.transports.scorer import Scorer

logger = logging.getLogger(__name__)


def build_tool_backend(config: GRPOConfig, service: tuple[str, str | None] | None = None) -> ToolBackend:
    """Where the run's tool calls run: the reward service when one is used (`service` = (URL, bearer token), else
    `reward_url` or env ASYNC_GRPO_REWARD_URL with env ASYNC_GRPO_REWARD_TOKEN; on Kubernetes), else
    `tool_num_workers` local spawned workers. With a reward service the tools and their schemas come from it: this
    process, which may hold credentials, never imports a tool file.

    Raises:
        ToolSpecError: (local workers) a tool does not import, lacks type hints or a docstring, or two share a name.
        ToolServiceError: (reward service) it cannot be reached, or serves other tools.
    """
    t = config.tools
    url, token = service if service is not None else (reward_service_url(config), None)
    if url is not None:
        logger.info("running tool calls on the reward service at %s", url)
        return RemoteToolExecutor(
            url,
            t.tools,
            timeout_s=t.tool_timeout_s,
            token=token,
            max_concurrency=max(t.tool_num_workers, config.producer.max_inflight_groups),
        )
    return tool_executor(config)  # the same executor the reward service runs, here


def check_conversational(items: Sequence[PromptItem], spec: str, what: str = "tools", field: str = "tools") -> None:
    """Tools (and environments: `what`, set by the config key `field`) need conversational prompts (as TRL's).

    Raises:
        ValueError: a prompt is a string; names the dataset and the fix.
    """
    for i, item in enumerate(items):
        if not isinstance(item.prompt, list):
            raise ValueError(
                f"dataset {spec!r}: row {i} has a string prompt, but {what} need conversational prompts "
                "(a list of {'role', 'content'} messages, rendered by the chat template). "
                f"Fix: make each prompt [{{'role': 'user', 'content': prompt}}], or unset {field}."
            )


def build_rollout(
    config: GRPOConfig,
    scorer: Scorer,
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    items: Sequence[PromptItem],
    tool_service: tuple[str, str | None] | None = None,
) -> Rollout:
    """The run's rollout: `AgentRollout` when `agent` or `agent_command` is set (`build_agent_rollout`);
    `EnvironmentRollout` when `environment` is set or `tools` are declared (tools as an
    environment, `EnvironmentRollout.for_tools`; both: the environment with tools, `ToolEnvironment(inner=...)`,
    under `max_turns`), else `SingleTurnRollout`. Each records its episodes' spans (`RolloutGroup.spans`) only when
    the run traces episodes (`tracking.log_traces_steps` > 0).

    Args:
        items: the training and held-out prompts (checked to be conversational for tools or an environment).
        tool_service: (URL, bearer token) of a reward service to run the tool calls (and an agent's episodes) on
            (see `build_tool_backend`, `build_agent_rollout`).

    Raises:
        ValueError: bad tools (ToolSpecError), string prompts, a tool format the tokenizer cannot parse
            (ToolFormatError) or a chat template that cannot carry tool calls (ChatTemplateError), a bad
            `environment` (EnvironmentSpecError), a bad `agent` or `agent_command` (AgentSpecError); each names the fix.
    """
    if config.agents.agent is not None or config.agents.agent_command is not None:
        return build_agent_rollout(config, scorer, tokenizer, tool_service)
    env = config.environments
    record_spans = config.tracking.log_traces_steps > 0
    inner = None
    if env.environment is not None:
        check_conversational(items, config.data.dataset, "environments", "environment")
        inner = EnvironmentCaller(
            load_environment(env.environment), timeout_s=env.env_timeout_s, num_threads=env.env_num_threads
        )
        if not config.tools.tools:
            return EnvironmentRollout(scorer, tokenizer, inner, max_turns=env.max_turns, record_spans=record_spans)
    if not config.tools.tools:
        return SingleTurnRollout(scorer, decode, record_spans=record_spans)
    check_conversational(items, config.data.dataset)
    settings = ToolCallingSettings(
        max_tool_calling_iterations=config.tools.max_tool_calling_iterations,
        max_tool_response_length=config.tools.max_tool_response_length,
    )
    backend = None
    try:
        backend = build_tool_backend(config, tool_service)
        if inner is None:
            return EnvironmentRollout.for_tools(
                scorer, tokenizer, backend, settings=settings, record_spans=record_spans
            )
        tools = ToolEnvironment(backend, settings, inner=inner)  # the run's environment, with tools
        caller = EnvironmentCaller(tools, timeout_s=None, num_threads=1)  # the inner one times its own calls
        return EnvironmentRollout(scorer, tokenizer, caller, max_turns=env.max_turns, record_spans=record_spans)
    except Exception:
        if inner is not None:
            inner.close()
        if backend is not None:
            backend.close()
        raise


def build_agent_rollout(
    config: GRPOConfig,
    scorer: Scorer,
    tokenizer: PreTrainedTokenizerBase,
    service: tuple[str, str | None] | None = None,
) -> AgentRollout:
    """The agent rollout: at most `max_turns` model calls and `agent_timeout_s` seconds per episode, run where the
    tool calls run (`build_tool_backend`'s rule). With a reward service (`service` = (URL, bearer token), else
    `reward_url` or env ASYNC_GRPO_REWARD_URL with env ASYNC_GRPO_REWARD_TOKEN; on Kubernetes) the episodes run there
    (`agents.remote.RemoteAgentRunner`: a function in the service's process, a command in its bwrap sandbox), this
    process never imports the agent, and the endpoint listens where the service reaches it
    (`agents.remote.endpoint_binding`: all interfaces on `agent_endpoint_port` .. + AGENT_ENDPOINT_PORT_COUNT - 1,
    advertising the pod's IP; 127.0.0.1 for a service on loopback). Without one: `agent` (a function,
    `agents.execution.FunctionAgent`) or `agent_command` (a program, `CommandAgent`) here, the endpoint on 127.0.0.1.

    Raises:
        AgentSpecError: (here) the function does not resolve or has the wrong signature, or the program is not
            executable (a ValueError naming the field and the fix).
        AgentServiceError: (reward service) it cannot be asked, or runs another agent or none.
        OSError: (reward service) this pod's address cannot be found (`agents.remote.advertised_host`).
    """
    a = config.agents
    url, token = service if service is not None else (reward_service_url(config), None)
    options = {"max_turns": config.environments.max_turns, "timeout_s": a.agent_timeout_s}
    runner: AgentRunner
    if url is not None:
        logger.info("running the agent's episodes on the reward service at %s", url)
        binding = endpoint_binding(url, a.agent_endpoint_port, AGENT_ENDPOINT_PORT_COUNT)
        runner = RemoteAgentRunner(url, token, agent=a.agent, agent_command=a.agent_command)
        return AgentRollout(scorer, tokenizer, runner, **options, binding=binding)
    if a.agent is not None:
        runner = FunctionAgent(load_agent(a.agent))
    else:
        check_agent_command(a.agent_command)
        runner = CommandAgent(a.agent_command)
    return AgentRollout(scorer, tokenizer, runner, **options)


def warm_start_pairs(
    config: GRPOConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    tool_schemas: Sequence[dict],
    conversations: Sequence[list[dict]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(context ids, turn ids) pairs of a builtin task's reference conversations (`n` of `Task.sft_transcripts`,
    or the given `conversations`), rendered with `tool_schemas` (the rollout's, `Rollout.tool_schemas`, when the
    run declares `tools`: on a reward service they come from there, and no tool file is imported here), else with
    the task's own builtin tools; one pair per assistant turn.

    Raises:
        ToolSpecError: a builtin tool does not resolve; ChatTemplateError: the template is not prefix-preserving.
    """
    schemas = list(tool_schemas) if config.tools.tools else [t.schema for t in load_tools(list(task.tools))]
    convs = task.sft_transcripts(config.seed, n) if conversations is None else conversations
    return [pair for conv in convs for pair in turn_pairs(tokenizer, conv, schemas)]
