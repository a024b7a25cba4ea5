"""Preflight checks of the run's own inputs: the prompt datasets, the tokenizer, the reward functions, a user
data producer, the tools, an environment and an agent (reward models: `preflight.reward_models`).

The reward functions are resolved, their signatures bound to TRL's call, and each is called once on one group
built from the dataset's first row with dummy completions, under a timeout, so a function that cannot score
fails here with its name instead of in the pre-training evaluation.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_grpo import hub
from async_grpo.config import GRPOConfig
from async_grpo.preflight.report import Problem

PROBE_TIMEOUT_S = 10.0  # longest a probe call may take (reward_timeout_s when lower)
PROBE_COMPLETIONS = ("preflight dummy completion", "")  # G = 2: a text and the empty completion TRL can produce
MAX_TOKENIZED_PROMPTS = 1000
_SIGNATURE_FIX = (
    "define it as def f(prompts, completions, completion_ids, **kwargs) -> list[float | None] "
    "(TRL's reward signature; dataset columns arrive as keyword arguments)"
)


def load_first_row(config: GRPOConfig, spec: str, field: str, split: str) -> tuple[Any, list[Problem]]:
    """Load and validate the dataset `spec` (`data.load_prompt_dataset`: file, folder or builtin task; roles and
    message shapes of conversational prompts included). Returns (the dataset or None, problems)."""
    from async_grpo.data import load_prompt_dataset

    data = config.data
    options = {
        "config_name": data.dataset_config,
        "system_prompt": data.system_prompt,
        "split_name": data.dataset_train_split if split == "train" else None,
    }
    import datasets

    bars, quiet = datasets.is_progress_bar_enabled(), logging.getLogger("datasets")
    level = quiet.level
    datasets.disable_progress_bars()  # preflight prints only its verdict (a reader's error is in the problem)
    quiet.setLevel(logging.CRITICAL)
    try:
        return load_prompt_dataset(spec, split=split, seed=config.seed, **options), []
    except (FileNotFoundError, ValueError) as err:
        return None, [Problem(field, str(err) if "Fix:" in str(err) else f"{err}. Fix: check the dataset.")]
    finally:
        quiet.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def is_checkable_dataset(spec: str, local: bool) -> bool:
    """A dataset preflight can read here: a builtin task anywhere; a local file or folder on the local target
    (on a cluster it lives on the workspace volume) or when it exists here; never a hub id (read at launch)."""
    if spec.startswith("builtin:"):
        return True
    if hub.looks_like_repo_id(spec):
        return False
    return local or Path(spec).exists()


def load_tokenizer(config: GRPOConfig, local: bool = True) -> Any | None:
    """The policy's tokenizer when it is cheap and safe to get here (builtin:tiny, or a local model folder; off the
    local target never one whose code is remote, `trust_remote_code`, since that code would run here); else None."""
    if config.model_name_or_path == "builtin:tiny":
        from async_grpo.tiny_model import build_tiny_tokenizer

        return build_tiny_tokenizer()
    path = Path(config.model_name_or_path).expanduser()
    if not (path / "config.json").is_file() or (config.trust_remote_code and not local):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)


def check_prompt_lengths(config: GRPOConfig, dataset: Any, tokenizer: Any) -> list[Problem]:
    """Tokenize the first prompts as the run will (chat template for conversational ones): a conversational
    dataset needs a chat template, and at least one prompt must fit max_prompt_length."""
    from async_grpo.data import encode_prompt

    prompts = dataset.select(range(min(len(dataset), MAX_TOKENIZED_PROMPTS)))["prompt"]
    try:
        lengths = [len(encode_prompt(tokenizer, p, config.data.chat_template_kwargs)) for p in prompts]
    except ValueError as err:
        return [Problem("data.dataset", str(err).removeprefix("encode_prompt: "))]
    except Exception as err:  # a chat template that fails on these messages (jinja raises its own errors)
        return [
            Problem(
                "data.dataset",
                f"the tokenizer's chat template fails on prompt {prompts[0]!r:.80}: {type(err).__name__}: {err}",
                "check the messages' roles and order against the chat model",
            )
        ]
    limit = config.data.max_prompt_length
    if lengths and min(lengths) > limit:
        return [
            Problem(
                "data.max_prompt_length",
                f"every prompt checked is longer than max_prompt_length={limit} "
                f"tokens (shortest: {min(lengths)}), so the run would drop them all",
                f"raise max_prompt_length to at least {min(lengths)}, or shorten the prompts",
            )
        ]
    return []


def resolve_specs(config: GRPOConfig, local: bool) -> tuple[dict[str, Callable], list[Problem], list[str]]:
    """Resolve the reward specs that may be resolved here: builtins always; on the local target modules and files
    too. Off it, a file is only read (`user_code.check_file_statically`: it exists, parses and defines the function;
    none of its code runs, since this process may hold credentials) and a module is left to the trainer's image.
    Returns ({spec: function}, problems, skip notes)."""
    from async_grpo.rewards.contract import JUDGE_SPEC
    from async_grpo.rewards.loading import RewardSpecError, parse_reward_spec, resolve_reward_func, reward_func_name
    from async_grpo.rewards.reward_model import is_reward_model_spec
    from async_grpo.user_code import check_file_statically

    funcs, problems, skipped = {}, [], []
    for spec in config.rewards.reward_funcs:
        if is_reward_model_spec(spec):
            continue  # the reward_models check reads its folder (`preflight.reward_models`); no probe call
        if spec == JUDGE_SPEC and not (local and config.rewards.judge_url):
            skipped.append(
                "reward_funcs: builtin:llm_judge is asked where the run scores (its judge is served by the launcher, "
                "or reached from the cluster)"
            )
            continue
        try:
            parsed = parse_reward_spec(spec)
            if local or parsed.kind == "builtin":
                funcs[spec] = resolve_reward_func(spec)
            elif parsed.is_file and not os.path.lexists(parsed.target):
                skipped.append(f"reward_funcs: {spec!r} is not on this machine; it is read where it runs")
            elif parsed.is_file:
                problem = check_file_statically(parsed, what="reward function spec")
                if problem:
                    problems.append(Problem("rewards.reward_funcs", problem))
                else:
                    skipped.append(f"reward_funcs: {spec!r} was parsed, not run (it runs in the reward pods)")
            else:
                skipped.append(f"reward_funcs: {spec!r} is resolved in the trainer's image")
        except RewardSpecError as err:
            problems.append(
                Problem(
                    "rewards.reward_funcs",
                    str(err),
                    None
                    if "Fix:" in str(err)
                    else "give builtin:<name>, pkg.module:function or path/to/file.py:function",
                )
            )
    names = [
        reward_func_name(s)
        for s in config.rewards.reward_funcs
        if isinstance(s, str) and (":" in s or is_reward_model_spec(s))
    ]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(
            Problem(
                "rewards.reward_funcs",
                f"several functions are named {duplicates}; their metrics would collide",
                "give each reward function a distinct name",
            )
        )
    return funcs, problems, skipped


def check_data_producer(config: GRPOConfig, local: bool) -> tuple[list[Problem], list[str]]:
    """`data_producer` must name a callable factory (`pkg.module:factory` or `path/file.py:factory`, `user_code`'s
    forms; no `builtin:`); it is called only at launch, with the tokenizer. On the local target it is imported
    (`user_code.import_callable`, as the producer loads it); off it a file is only read, never imported, and a module
    is left to the trainer's image. Returns (problems, skip notes)."""
    spec = config.producer.data_producer
    if spec is None:
        return [], []
    from async_grpo.user_code import check_file_statically, import_callable, parse_spec

    field = "producer.data_producer"

    def problem_of(err: ValueError) -> Problem:
        fix = "give pkg.module:factory or path/to/file.py:factory returning a DataProducer"
        return Problem(field, str(err), None if "Fix:" in str(err) else fix)

    try:
        parsed = parse_spec(spec, what="data_producer", error=ValueError)
    except ValueError as err:
        return [problem_of(err)], []
    if parsed.kind == "builtin":
        return [Problem(field, f"data_producer {spec!r}: there is no builtin data producer",
                        "unset data_producer (the vLLM orchestrator is the builtin one), or give "
                        "pkg.module:factory or path/to/file.py:factory")], []  # fmt: skip
    if not local:
        if not parsed.is_file:
            return [], [f"data_producer: {spec!r} is resolved in the trainer's image"]
        if not os.path.lexists(parsed.target):
            return [], [f"data_producer: {spec!r} is not on this machine; it is read where it runs"]
        problem = check_file_statically(parsed, what="data_producer spec")
        return ([Problem(field, problem)] if problem else []), []
    try:
        import_callable(parsed, what="data_producer", error=ValueError, prefix="_async_grpo_producer",
                        returns="a DataProducer from (config, tokenizer)")  # fmt: skip
    except ValueError as err:
        return [problem_of(err)], []
    return [], []


def check_tools(config: GRPOConfig, local: bool) -> tuple[list[Problem], list[str]]:
    """The `tools` specs: on the local target each resolves and has a JSON schema (`tools.loading.load_tools`);
    off it a file is only read (`user_code.check_file_statically`), never imported, and a module is left to the
    image that runs it. `builtin:python`'s sandbox is tried on the local target (`check_python_sandbox`), and noted as
    checked where the calls run off it. Returns (problems, skip notes)."""
    specs = config.tools.tools
    if not specs:
        return [], []
    from async_grpo.config.sections.tools import PYTHON_TOOL
    from async_grpo.tools.loading import ToolSpecError, load_tools, parse_tool_spec
    from async_grpo.user_code import check_file_statically

    problems, notes = [], []
    try:
        if local:
            load_tools(specs)
            return check_python_sandbox(config), []
        for spec in specs:
            parsed = parse_tool_spec(spec)
            if parsed.is_file and not os.path.lexists(parsed.target):
                notes.append(f"tools: {spec!r} is not on this machine; it is read where it runs")
            elif parsed.is_file:
                problem = check_file_statically(parsed, what="tool spec")
                problems += [Problem("tools.tools", problem)] if problem else []
            elif parsed.kind == "module":
                notes.append(f"tools: {spec!r} is resolved in the image that runs the tool calls")
        if PYTHON_TOOL in specs and config.tools.python_tool_sandbox == "bwrap":
            notes.append(
                "tools: builtin:python's bwrap sandbox is checked where the tool calls run (the reward service's "
                "start); pods with the RuntimeDefault seccomp profile refuse its user namespaces (docs/tools.md)"
            )
    except ToolSpecError as err:
        problems.append(
            Problem(
                "tools.tools",
                str(err),
                None if "Fix:" in str(err) else "give builtin:<name>, pkg.module:function or path/to/file.py:function",
            )
        )
    return problems, notes


def check_python_sandbox(config: GRPOConfig) -> list[Problem]:
    """With `builtin:python` declared, its sandbox runs here (`tools.sandbox.check_sandbox`: one real sandboxed
    print), as the run's set-up will require; no problem without it."""
    from async_grpo.config.sections.tools import PYTHON_TOOL

    if PYTHON_TOOL not in config.tools.tools:
        return []
    from async_grpo.tools.sandbox import SandboxSettings, SandboxUnavailable, check_sandbox

    try:
        check_sandbox(SandboxSettings.from_section(config.tools))
    except SandboxUnavailable as err:
        return [Problem("tools.python_tool_sandbox", str(err))]
    return []


def check_environment(config: GRPOConfig, local: bool, row: dict[str, Any] | None) -> tuple[list[Problem], list[str]]:
    """The `environment` spec (an adapter's too: `openenv:`, `verifiers:`): on the local target (and for builtins
    anywhere) it resolves, its factory returns an
    object implementing the protocol (`environments.load_environment`), and, with the dataset's first `row` at
    hand, `reset` opens an episode on it within env_timeout_s (`environments.check_reset`). Off the local target a
    file is only read (`user_code.check_file_statically`), never imported, and a module is left to the image.
    Returns (problems, skip notes)."""
    spec = config.environments.environment
    if spec is None:
        return [], []
    from async_grpo.environments import EnvironmentSpecError, check_reset, load_environment
    from async_grpo.environments.loading import parse_environment_spec
    from async_grpo.user_code import check_file_statically

    field = "environments.environment"
    try:
        parsed = parse_environment_spec(spec)
        if not local and spec.startswith("verifiers:") and ":" not in spec.removeprefix("verifiers:"):
            return [], [f"environment: verifiers environment {spec!r} is loaded in the image that runs the rollouts"]
        if not local and parsed.is_file:
            if not os.path.lexists(parsed.target):
                return [], [f"environment: {spec!r} is not on this machine; it is read where it runs"]
            problem = check_file_statically(parsed, what="environment spec")
            return ([Problem(field, problem)] if problem else []), []
        if not local and parsed.kind == "module":
            return [], [f"environment: {spec!r} is resolved in the image that runs the rollouts"]
        env = load_environment(spec)
        if row is None:
            return [], ["environment: reset was not tried (the dataset was not read here)"]
        if isinstance(row.get("prompt"), str):
            return [
                Problem(
                    field,
                    f"environment {spec!r} needs conversational prompts (its observations are chat messages), "
                    f"but dataset {config.data.dataset!r} has string prompts",
                    "use a dataset whose prompts are [{'role': 'user', 'content': ...}] lists (e.g. builtin:guess)",
                )
            ], []
        check_reset(env, spec, row, config.environments.env_timeout_s)
    except EnvironmentSpecError as err:
        message = str(err)
        return [Problem(field, message, None if "Fix:" in message else f"give {_ENV_FORMS}")], []
    return [], []


def check_agent(config: GRPOConfig, local: bool) -> tuple[list[Problem], list[str]]:
    """The agent (`agent` or `agent_command`), checked as `check_environment` checks an environment. `agent`: on the
    local target the function is imported and its signature must take `(row, base_url=, api_key=)`
    (`agents.load_agent`); off it a file is only read (`user_code.check_file_statically`: it exists, parses and
    defines the function; none of its code runs, since this process may hold credentials) and a module is left to
    the image that runs the episodes. `agent_command`: on the local target its program must resolve to an executable
    (`agents.check_agent_command`); off it the program is looked up in the image, not on this machine. Neither is
    called here (that needs the model endpoint). Returns (problems, skip notes)."""
    agents = config.agents
    if agents.agent is None and agents.agent_command is None:
        return [], []
    from async_grpo.agents import AgentSpecError, check_agent_command, load_agent, parse_agent_spec
    from async_grpo.user_code import check_file_statically

    problems, notes = [], []
    if agents.agent is not None:
        spec, field = agents.agent, "agents.agent"
        try:
            parsed = parse_agent_spec(spec)
            if local:
                load_agent(spec)
            elif not parsed.is_file:
                notes.append(f"agent: {spec!r} is resolved in the image that runs the episodes")
            elif not os.path.lexists(parsed.target):
                notes.append(f"agent: {spec!r} is not on this machine; it is read where it runs")
            else:
                problem = check_file_statically(parsed, what="agent spec")
                problems += [Problem(field, problem)] if problem else []
        except AgentSpecError as err:
            message = str(err)
            problems.append(Problem(field, message, None if "Fix:" in message else f"give {_AGENT_FORMS}"))
    if agents.agent_command is not None:
        if local:
            try:
                check_agent_command(agents.agent_command)
            except AgentSpecError as err:
                problems.append(Problem("agents.agent_command", str(err)))
        else:
            notes.append(
                f"agent_command: {agents.agent_command[0]!r} is looked up in the image that runs the episodes, not "
                "on this machine"
            )
    return problems, notes


_AGENT_FORMS = "pkg.module:function or path/to/file.py:function, defined as def agent(row, base_url, api_key)"
_ENV_FORMS = (
    "builtin:<name>, pkg.module:factory or path/to/file.py:factory returning an environment, or "
    "openenv:pkg.module:factory returning an OpenEnv environment, or verifiers:pkg.module:factory returning a "
    "verifiers.v1.Env"
)


def _name(spec: str, func: Callable) -> str:
    return f"{getattr(func, '__name__', spec.rsplit(':', 1)[-1])!s} ({spec})"


def probe_group(row: dict[str, Any]) -> tuple[list, list, list, dict[str, list]]:
    """One group of G = 2 from a dataset row: (prompts, completions, completion_ids, columns), completions as
    strings for a standard prompt and as assistant messages for a conversational one (as the rollout builds them)."""
    prompt = row["prompt"]
    texts = list(PROBE_COMPLETIONS)
    completions = texts if isinstance(prompt, str) else [[{"role": "assistant", "content": t}] for t in texts]
    ids = [list(t.encode("utf-8")) for t in texts]
    columns = {k: [v] * len(texts) for k, v in row.items() if k != "prompt"}
    return [prompt] * len(texts), completions, ids, columns


def check_signatures(funcs: dict[str, Callable], columns: list[str], bound: dict[str, dict]) -> list[Problem]:
    """Each function must accept TRL's keyword call f(prompts=, completions=, completion_ids=, **columns,
    trainer_state=, log_extra=, log_metric=)."""
    problems = []
    for spec, func in funcs.items():
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            continue  # a builtin or C callable without a signature: the probe call decides
        kwargs = dict.fromkeys(
            [
                "prompts",
                "completions",
                "completion_ids",
                *columns,
                "trainer_state",
                "log_extra",
                "log_metric",
                *bound.get(spec, {}),
            ]
        )
        try:
            signature.bind(**kwargs)
        except TypeError as err:
            shown = f"{getattr(func, '__name__', 'f')}{signature}"
            missing = "missing a required argument" in str(err) and any(
                p.kind == p.VAR_KEYWORD for p in signature.parameters.values()
            )
            have = f"; the dataset's columns besides prompt: {columns}" if missing else ""
            fix = "add that column to the dataset, or give the parameter a default" if missing else _SIGNATURE_FIX
            problems.append(
                Problem(
                    "rewards.reward_funcs",
                    f"reward function {_name(spec, func)} has signature "
                    f"{shown}, which cannot take TRL's call ({err}{have})",
                    fix,
                )
            )
    return problems


def probe_rewards(
    config: GRPOConfig, funcs: dict[str, Callable], row: dict[str, Any], timeout_s: float | None = None
) -> list[Problem]:
    """Call every function once on `probe_group(row)` (TRL's call, `rewards.contract.call_reward`) in a daemon
    thread, at most `timeout_s` seconds each (default: reward_timeout_s, at most PROBE_TIMEOUT_S); an exception,
    a hang or a result that is not G numbers or None is a problem naming the function."""
    from async_grpo.rewards import RewardBadOutput
    from async_grpo.rewards.contract import RewardLog, RewardTrainerState, bound_kwargs, call_reward
    from async_grpo.rewards.pool import _check_output

    timeout_s = timeout_s or min(config.rewards.reward_timeout_s, PROBE_TIMEOUT_S)
    prompts, completions, ids, columns = probe_group(row)
    if config.environments.environment is not None:  # what the environment rollout passes per completion
        columns.update({"env_reward": [0.0] * len(completions), "env_state": [{} for _ in completions]})
    if config.agents.agent is not None or config.agents.agent_command is not None:  # the agent's return value
        columns["agent_reward"] = [0.0] * len(completions)
    bound = bound_kwargs(config)
    problems = check_signatures(funcs, list(columns), bound)
    if problems:
        return problems
    for spec, func in funcs.items():
        outcome: dict[str, Any] = {}

        def run(func=func, spec=spec, outcome=outcome) -> None:
            try:
                outcome["out"] = call_reward(
                    func,
                    prompts,
                    completions,
                    ids,
                    columns,
                    trainer_state=RewardTrainerState(0, config.batch.max_steps),
                    log=RewardLog(),
                    bound=bound.get(spec),
                )
            except BaseException as raised:  # reported with the function's name
                outcome["err"] = raised

        thread = threading.Thread(target=run, name=f"preflight-reward-{spec}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        name = _name(spec, func)
        if thread.is_alive():
            problems.append(
                Problem(
                    "rewards.reward_funcs",
                    f"reward function {name} did not return within "
                    f"{timeout_s:g} s on one group of {len(completions)} dummy completions",
                    "make it faster, or raise reward_timeout_s",
                )
            )
        elif "err" in outcome:
            err = outcome["err"]
            problems.append(
                Problem(
                    "rewards.reward_funcs",
                    f"reward function {name} raised {type(err).__name__}: "
                    f"{err} on one group built from the dataset's first row with dummy completions",
                    "make it handle every completion (return None to abstain)",
                )
            )
        else:
            try:
                _check_output(getattr(func, "__name__", spec), outcome["out"], len(completions))
            except RewardBadOutput as err:
                problems.append(Problem("rewards.reward_funcs", str(err)))
    return problems
