"""verifiers environments (prime-rl's, `verifiers` 0.4.0) driven by the environment protocol, token in and out.

Spec: `environment: verifiers:<pkg.module:Name>` or `verifiers:<path/to/file.py:Name>`, naming a `verifiers.v1.Env`
instance or a factory called with no arguments that returns one (a configured `vf.SingleAgentEnv(...)`), or
`verifiers:<taskset-id>` / `verifiers:<env-id>+<taskset-id>` (installed packages, built as `vf-eval` builds them).

A verifiers 0.4 episode is driven by the environment: `Env.run_episode(task, ctx)` launches the agent's harness,
and the harness calls the model itself, through verifiers' interception server, whose model client
(`verifiers.v1.Client`, the class prime-rl's training client implements) answers each call. The adapter turns that
around so the rollout keeps sampling, token in and token out (`orchestrator.env_rollout.EnvironmentRollout`):

    verifiers 0.4                                     this protocol
    Env.run_episode(task, ctx) in the adapter's loop  reset(row, state): the row picks the task; the episode starts
    the harness's first model call (its messages)     reset's Observation: the messages after the dataset prompt
    the model client's answer (an assistant message)  the rollout's sampled turn: step(action, state)'s `action`
    the harness's next model call (the history + the  step's Observation: the messages the harness added (user or
      messages it added since the last one)            tool role); the history must be the rollout's, unchanged
    the harness finishes; the trace is scored         step's Observation(done=True, reward=trace.reward)
    (the rollout stops early: max_turns, budget, ...)  close_episode(state): the episode is cancelled, no reward

What the adapter cannot keep it refuses rather than train on wrong tokens. The episode's sample fails
(`step_exception` / `reset_exception`, the harness getting an HTTP 400 error) when the harness sends a history other
than the rollout's (it rewrote or dropped a turn: the held ids would no longer be what it shows the model), offers
tools of its own (their calls would need its parser), speaks another dialect than chat completions (verifiers'
own training client refuses those too), or runs several agents in one episode; and when the episode ends with an
error (a harness that failed, a reward that raised). The harness's own sampling arguments (temperature,
max_tokens) are ignored: the run's sampling applies.

Each row picks its task: by a `task_idx` column (the task's `idx` in the taskset), else the first task whose prompt
(system prompt, then prompt, as chat messages) is the row's prompt and whose data agree with every other column the
row shares with it (e.g. `answer`); `task_row(task)` gives the row a task trains from. The taskset is read once, at
load (an unbounded taskset is refused).

All verifiers code runs on the adapter's own event loop in one thread (`Env.serving()` held for the adapter's life),
so the rollout's loop, the evaluation's and the load-time reset check (`environments.check_reset`) share one
environment. Importing this module imports no verifiers code; `load_verifiers` does, and names the packages and the
fix when they are missing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from async_grpo.environments.base import EnvironmentSpecError, Observation
from async_grpo.user_code import import_target, parse_spec

logger = logging.getLogger(__name__)

PACKAGE = "verifiers"
INSTALL_FIX = (
    "Fix: install it where the rollouts run: `pip install --no-deps verifiers==0.4.0 prime-pydantic-config==0.4.3 "
    "renderers==0.1.12 prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1 pyqwest==0.12.0 "
    "tenacity==9.2.1 aiofiles==25.1.0 tomli-w==1.2.0` (its declared dependencies pin openai<3 and mcp==2.0.0, older than this project's; "
    "scripts/install.sh does this, see docs/environments.md, 'Adapters')."
)
TASK_INDEX_COLUMN = "task_idx"  # a row column naming its task by the task's `idx` in the taskset
MAX_TASKS = 1_000_000  # most tasks read from a taskset at load (its rows are matched against them)
START_TIMEOUT_S = 120.0  # most seconds the adapter waits for verifiers' serving resources to come up
STOP_TIMEOUT_S = 30.0  # most seconds `close` waits for the episodes and the serving resources to shut down
CLOSE_EPISODE_TIMEOUT_S = 10.0  # most seconds `close_episode` waits for a cancelled episode to unwind
HISTORY_FIELDS = ("role", "content")  # what must match between the harness's history and the rollout's
_NO_KEY = "ASYNC_GRPO_VERIFIERS_NO_API_KEY"  # the model client reads no key: it never leaves the process


class VerifiersRefusal(Exception):
    """A model call the adapter refuses to answer (a rewritten history, the harness's own tools, another dialect):
    the episode's sample fails with this message, and the harness gets it as an HTTP 400 error."""


@dataclass
class _ModelCall:
    """One model call of the harness, waiting for the rollout's turn.

    Attributes:
        messages: the call's whole conversation as chat messages (`{"role", "content"}`), oldest first.
        reply: resolved with the turn's text, or failed with the refusal the harness gets.
        session_id: verifiers' trace id of the agent making the call.
    """

    messages: list[dict]
    reply: asyncio.Future
    session_id: str | None


@dataclass
class _VerifiersEpisode:
    """One verifiers episode bridged to one rollout sample (lives on the adapter's loop).

    Attributes:
        model: the unique model name its calls carry (`ModelContext.model`): the model client routes by it.
        calls: its harness's model calls and, last, the finished `vf.Episode` (or the exception it raised).
        task: the `Env.run_episode` task.
        pending: the model call the rollout's next turn answers.
        session_id: the trace id of its first call (a second agent's call is refused).
        expected: the conversation the next call must start with (the rollout's history).
    """

    model: str
    calls: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    pending: _ModelCall | None = None
    session_id: str | None = None
    expected: list[dict] = field(default_factory=list)


_EPISODES: dict[str, _VerifiersEpisode] = {}  # live episodes by model name, across adapters (unique names)
_ROUTING_LOCK = threading.Lock()


def live_episodes() -> int:
    """How many verifiers episodes are open in this process (started by a `reset`, not yet finished and closed)."""
    return len(_EPISODES)


def _import_verifiers() -> Any:
    """`verifiers.v1`.

    Raises:
        EnvironmentSpecError: verifiers (or one of its dependencies) cannot be imported; names the fix.
    """
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise EnvironmentSpecError(
            f"`environment`: a verifiers: spec needs the {PACKAGE} package, which cannot be imported ({err}). "
            + INSTALL_FIX
        ) from err
    return vf


def _wire(message: Any) -> dict:
    """A verifiers message as a chat message dict (verifiers' own `message_to_wire`)."""
    from verifiers.v1.dialects.chat import message_to_wire

    return message_to_wire(message)


def _same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two chat messages have the same role and content (None content counts as "")."""
    return all((a.get(k) or "") == (b.get(k) or "") for k in HISTORY_FIELDS)


def _starts_with(messages: list[dict], prefix: list[dict]) -> bool:
    """Whether `messages` opens with `prefix`, message for message (`_same_message`)."""
    return len(messages) >= len(prefix) and all(_same_message(a, b) for a, b in zip(messages, prefix, strict=False))


def task_prompt(data: Any) -> list[dict]:
    """A task's opening conversation as chat messages: its `system_prompt` (when set) as a system message, then its
    `prompt` (a string as one user message). The row a task trains from has this as its `prompt` (`task_row`).

    Args:
        data: the task's `TaskData`.
    """
    messages = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(_wire(m) for m in data.prompt or [])
    return messages


def _data_columns(data: Any) -> dict[str, Any]:
    """A task's own data as JSON values (the row columns they are compared with): `idx`, `id` and `name` when set,
    and every field its `TaskData` subclass adds (e.g. `answer`); not the prompt, nor verifiers' runtime settings
    (image, network, artifacts, timeouts, resources)."""
    from verifiers.v1 import TaskData

    own = {"idx", "id", "name"} | (set(type(data).model_fields) - set(TaskData.model_fields))
    out = data.model_dump(mode="json", include=own)
    return {k: v for k, v in out.items() if v is not None}


def task_row(task: Any) -> dict[str, Any]:
    """The dataset row a verifiers task trains from: `prompt` (`task_prompt`), `task_idx` (its `idx`) and its other
    data fields that are set (e.g. `answer`), JSON values. Write `[task_row(t) for t in env.taskset]` to a JSON
    lines file to train on a taskset (docs/environments.md).

    Args:
        task: a `verifiers.v1.Task` read from a taskset (its `idx` set).
    """
    columns = _data_columns(task.data)
    return {"prompt": task_prompt(task.data), TASK_INDEX_COLUMN: columns.pop("idx", None), **columns}


def _column_equal(value: Any, expected: Any) -> bool:
    """A row column equals a task's field: as JSON, or as text (a dataset may hold the number 7 for "7")."""
    return value == expected or str(value) == str(expected)


class _RolloutClient:
    """verifiers' model client for the adapter's episodes (an instance of a `verifiers.v1.Client` subclass made by
    `_client_class`): each call goes to the episode its model name names and waits for the rollout's turn."""

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """One model call (`verifiers.v1.Client.get_response`): the rollout's next turn, as verifiers' `Response`.

        Raises:
            verifiers.v1.errors.ProviderError: (status 400) a refused call, or no episode by the call's model name.
        """
        import verifiers.v1 as vf
        from verifiers.v1.clients.train import serialize_completion
        from verifiers.v1.dialects import ChatDialect
        from verifiers.v1.errors import ProviderError

        model = str(body.get("model", ""))
        episode = _EPISODES.get(model)
        if episode is None:
            raise ProviderError(f"async-grpo: no episode is waiting for model {model!r}", status_code=400)
        call = _ModelCall([], asyncio.get_running_loop().create_future(), session_id)
        try:
            if not isinstance(dialect, ChatDialect):
                raise VerifiersRefusal(
                    f"the harness speaks {type(dialect).__name__}; the adapter answers chat completions only "
                    "(as verifiers' training client). Fix: use a harness on the chat-completions API."
                )
            request = None if turn is not None else dialect.parse_request(body)
            prompt = turn.prompt if turn is not None else request.messages
            tools = turn.tools if turn is not None else request.tools
            if tools:
                raise VerifiersRefusal(
                    f"the harness offers the model its own tools ({len(tools)}); their calls would be parsed by "
                    "the harness, not by the rollout's tokenizer. Fix: declare the tools in the run's `tools` and "
                    "use an environment without them, or a harness that offers none."
                )
            call.messages = [_wire(m) for m in prompt]
        except VerifiersRefusal as err:
            call.reply.set_exception(err)
        await episode.calls.put(call)
        try:
            text = await call.reply
        except VerifiersRefusal as err:
            raise ProviderError(f"async-grpo refused the call: {err}", status_code=400) from err
        response = vf.Response(
            id=f"async-grpo-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            message=vf.AssistantMessage(content=text),
            finish_reason="stop",
        )
        response.raw = serialize_completion(response, model)
        return response

    async def close(self) -> None:
        """Nothing to close: the client holds no connection."""


def _client_class() -> type:
    """`_RolloutClient` as a `verifiers.v1.Client` subclass (made on first use: verifiers is imported lazily)."""
    import verifiers.v1 as vf

    return type("AsyncGrpoRolloutClient", (_RolloutClient, vf.Client), {})


def _client_config_class() -> type:
    """The client config the adapter's `ModelContext` carries: a `TrainClientConfig` of its own type, so verifiers'
    interception server builds the adapter's client for it (`_route_model_calls`) and never contacts `base_url`.
    A training client's config, because the adapter is one: it generates each response whole, so the interception
    server serves a harness that streams (`stream: true`) from the whole response, as for verifiers' own training
    client, instead of relaying a provider's stream."""
    from verifiers.v1.configs.client import TrainClientConfig

    class AsyncGrpoClientConfig(TrainClientConfig):
        """The rollout answers this context's model calls (no endpoint, no API key, no renderer)."""

        base_url: str = "http://127.0.0.1:9/async-grpo-rollout"  # never contacted
        api_key_var: str = _NO_KEY
        rollout: Literal["async-grpo"] = "async-grpo"  # tells its JSON (the server's client key) from a real one's

    return AsyncGrpoClientConfig


_CONFIG_CLASS: type | None = None


def _route_model_calls() -> type:
    """Make verifiers' interception server answer the adapter's model contexts with the adapter's client, and
    return their client config class. verifiers picks a context's model client with the module-level
    `resolve_client(config)` of `verifiers.v1.interception.server` (an eval or a training client, by the config's
    type) and offers no other seam to bring one: the adapter wraps that function once per process, building its
    client for its own config type and calling verifiers' function for every other config unchanged."""
    global _CONFIG_CLASS
    with _ROUTING_LOCK:
        if _CONFIG_CLASS is None:  # not routed yet
            import verifiers.v1.interception.server as interception_server

            config_class, client = _client_config_class(), _client_class()()
            verifiers_resolve = interception_server.resolve_client

            def resolve_client(config: Any) -> Any:
                if isinstance(config, config_class):
                    return client
                return verifiers_resolve(config)

            interception_server.resolve_client = resolve_client
            _CONFIG_CLASS = config_class  # set last: routed only once the wrapper is in place
    assert _CONFIG_CLASS is not None
    return _CONFIG_CLASS


class VerifiersEnvironment:
    """A verifiers 0.4 `Env` as an environment of the protocol (see the module docstring).

    Args:
        env: the `verifiers.v1.Env` (configured; its taskset loaded).
        spec: the `environment` spec, for messages.

    Raises:
        EnvironmentSpecError: the taskset is unbounded, empty, or holds more than MAX_TASKS tasks.
    """

    def __init__(self, env: Any, spec: str):
        self.env, self.spec = env, spec
        if not env.taskset.bounded:
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: the taskset of {type(env).__name__} is unbounded, so rows cannot be "
                "matched to its tasks. Fix: bound it (`taskset.take(n)`) in the factory."
            )
        self.tasks = list(itertools.islice(iter(env.taskset), MAX_TASKS + 1))
        if not self.tasks or len(self.tasks) > MAX_TASKS:
            what = "no tasks" if not self.tasks else f"more than {MAX_TASKS} tasks"
            raise EnvironmentSpecError(f"`environment` {spec!r}: the taskset holds {what}. Fix: load 1..{MAX_TASKS}.")
        self._by_idx = {t.data.idx: t for t in self.tasks}
        self._prompts = [json.dumps(task_prompt(t.data), sort_keys=True) for t in self.tasks]
        self._columns = [_data_columns(t.data) for t in self.tasks]
        self._config_class = _route_model_calls()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._serve_error: BaseException | None = None
        self._closed = False  # set by `close`: no call reaches the adapter's loop after it
        self._live: set[str] = set()

    # -- the protocol (called on any loop; the work runs on the adapter's) -------------------------------------

    async def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> Observation:
        """Start the row's episode and wait for its harness's first model call.

        Returns:
            The call's messages after the row's prompt (user or tool role), as the episode's opening.

        Raises:
            LookupError: no task matches the row. VerifiersRefusal: the call does not start with the row's prompt,
            or is refused (see the module docstring). RuntimeError: the episode ended before calling the model.
        """
        return await self._on_env_loop(self._reset(dict(row), state))

    async def step(self, action: str, state: dict[str, Any]) -> Observation:
        """Answer the pending model call with `action` and wait for the next call or the episode's end.

        Returns:
            The next call's new messages; or, when the episode finished, done with the trace's reward
            (`trace.reward`, the weighted sum of its rewards; state["verifiers_rewards"] holds each by name).

        Raises:
            VerifiersRefusal: the next call does not extend the rollout's history, or is refused. RuntimeError:
            the episode ended with errors (each named) or without a trace.
        """
        return await self._on_env_loop(self._step(action, state))

    async def close_episode(self, state: dict[str, Any]) -> None:
        """End the sample's episode if it still runs (the rollout stopped it: max_turns, the length budget, a
        failure): its pending call is refused and its task cancelled; it gives no reward."""
        model = state.get("verifiers_model")
        if model is not None and self._loop is not None and not self._closed:
            await self._on_env_loop(self._close_episode(str(model)))

    def close(self) -> None:
        """Cancel every live episode, leave verifiers' serving context and stop the adapter's thread (waits at
        most STOP_TIMEOUT_S)."""
        with self._start_lock:
            self._closed = True
            loop, thread, stop = self._loop, self._thread, self._stop
        if loop is None or thread is None or loop.is_closed():
            return
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("the verifiers environment did not stop within %.0f s", STOP_TIMEOUT_S)

    # -- the adapter's loop ------------------------------------------------------------------------------------

    async def _on_env_loop(self, coro: Coroutine) -> Any:
        """Run `coro` on the adapter's loop (started on first use); cancelling the caller cancels it there.

        Raises:
            RuntimeError: the adapter was closed, or could not start (`_started`).
        """
        try:
            if self._ready.is_set():
                loop = self._started()
            else:  # the first call waits for serving in a worker thread, not on the caller's loop
                loop = await asyncio.to_thread(self._started)
        except BaseException:
            coro.close()
            raise
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def _started(self) -> asyncio.AbstractEventLoop:
        """The adapter's loop, its thread started and verifiers' serving context entered on first use.

        Raises:
            RuntimeError: serving did not come up within START_TIMEOUT_S, or raised (its error chained).
        """
        with self._start_lock:
            if self._closed:
                raise RuntimeError("the verifiers environment was closed")
            if self._thread is None:
                self._loop, self._stop = asyncio.new_event_loop(), asyncio.Event()
                self._thread = threading.Thread(target=self._run, name="async-grpo-verifiers", daemon=True)
                self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the verifiers environment did not start serving within {START_TIMEOUT_S:.0f} s")
        if self._serve_error is not None:
            raise RuntimeError(f"the verifiers environment failed to serve: {self._serve_error!r}")
        assert self._loop is not None
        return self._loop

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        assert self._stop is not None
        try:
            async with self.env.serving():
                self._ready.set()
                await self._stop.wait()
                await asyncio.gather(*(self._close_episode(m) for m in list(self._live)), return_exceptions=True)
        except Exception as err:  # reported to every caller by `_started`
            logger.warning("the verifiers environment's serving context raised", exc_info=True)
            self._serve_error = err
        finally:
            self._ready.set()

    def _task_for(self, row: Mapping[str, Any]) -> Any:
        if TASK_INDEX_COLUMN in row and row[TASK_INDEX_COLUMN] is not None:
            task = self._by_idx.get(int(row[TASK_INDEX_COLUMN]))
            if task is None:
                raise LookupError(f"no task has {TASK_INDEX_COLUMN}={row[TASK_INDEX_COLUMN]!r}")
            return task
        prompt = json.dumps(row.get("prompt") or [], sort_keys=True)
        for task, task_prompt_key, columns in zip(self.tasks, self._prompts, self._columns, strict=True):
            if task_prompt_key != prompt:
                continue
            if all(_column_equal(row[k], v) for k, v in columns.items() if k in row and k != "idx"):
                return task
        raise LookupError(
            f"no task of the taskset opens with this row's prompt and agrees with its columns {sorted(row)}. Fix: "
            f"give rows a {TASK_INDEX_COLUMN} column, or build them with verifiers_adapter.task_row(task)."
        )

    async def _reset(self, row: dict[str, Any], state: dict[str, Any]) -> Observation:
        import verifiers.v1 as vf

        task = self._task_for(row)
        episode = _VerifiersEpisode(model=f"async-grpo/{uuid.uuid4().hex}")
        _EPISODES[episode.model] = episode
        self._live.add(episode.model)
        state["verifiers_model"] = episode.model
        state["verifiers_task_idx"] = task.data.idx
        ctx = vf.ModelContext(model=episode.model, client=self._config_class(), sampling=vf.Sampling())
        episode.task = asyncio.ensure_future(self._run_episode(episode, task, ctx))
        call = await self._next_call(episode, state)
        if call is None:
            raise RuntimeError(f"the episode ended before its harness called the model: {_errors(state)}")
        prompt = list(row.get("prompt") or [])
        if not _starts_with(call.messages, prompt):
            raise self._refuse(
                call,
                "the harness's first call opens with other messages than the row's prompt "
                f"({_brief(call.messages)} against {_brief(prompt)}). Fix: make the rows' prompt the task's "
                "(verifiers_adapter.task_row).",
            )
        opening = call.messages[len(prompt) :]
        self._check_roles(call, opening)
        episode.expected = list(call.messages)
        return Observation(messages=opening)

    async def _step(self, action: str, state: dict[str, Any]) -> Observation:
        episode = _EPISODES.get(str(state.get("verifiers_model")))
        if episode is None or episode.pending is None:
            raise RuntimeError("step without a model call waiting (the episode was closed)")
        episode.expected = list(state.get("messages") or episode.expected + [{"role": "assistant", "content": action}])
        pending, episode.pending = episode.pending, None
        if not pending.reply.done():
            pending.reply.set_result(action)
        call = await self._next_call(episode, state)
        if call is None:
            return self._finished(state)
        history = episode.expected
        if len(call.messages) == len(history) or not _starts_with(call.messages, history):
            raise self._refuse(
                call,
                f"the harness's call does not extend the conversation so far ({len(history)} messages; it sent "
                f"{_brief(call.messages)}): it rewrote or dropped a turn, so the sampled tokens would not be what "
                "it shows the model. Fix: a harness that resends the whole history unchanged each turn.",
            )
        tail = call.messages[len(history) :]
        self._check_roles(call, tail)
        episode.expected = list(call.messages)
        return Observation(messages=tail)

    async def _next_call(self, episode: _VerifiersEpisode, state: dict[str, Any]) -> _ModelCall | None:
        """The episode's next model call (kept as `pending`), or None when it finished (its outcome in `state`)."""
        item = await episode.calls.get()
        if not isinstance(item, _ModelCall):
            state["_verifiers_outcome"] = item
            return None
        if item.reply.done():  # refused by the client itself
            raise VerifiersRefusal(str(item.reply.exception()))
        if episode.session_id is None:
            episode.session_id = item.session_id
        elif item.session_id != episode.session_id:
            raise self._refuse(
                item,
                "a second agent called the model in one episode; a sample is one agent's turns. Fix: an "
                "environment with one agent per episode (vf.SingleAgentEnv).",
            )
        episode.pending = item
        return item

    @staticmethod
    def _refuse(call: _ModelCall, why: str) -> VerifiersRefusal:
        err = VerifiersRefusal(why)
        if not call.reply.done():
            call.reply.set_exception(err)
        return err

    def _check_roles(self, call: _ModelCall, messages: list[dict]) -> None:
        for m in messages:
            if m.get("role") not in ("user", "tool") or not isinstance(m.get("content"), str):
                raise self._refuse(
                    call,
                    f"the harness added a {m.get('role')!r} message with {type(m.get('content')).__name__} content; "
                    "an observation is user or tool messages with text content.",
                )

    @staticmethod
    def _finished(state: dict[str, Any]) -> Observation:
        outcome = state.pop("_verifiers_outcome", None)
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"the verifiers episode raised {outcome!r}") from outcome
        if outcome is None or not outcome.traces:
            raise RuntimeError(f"the verifiers episode ended without a trace: {_errors_of(outcome)}")
        trace = outcome.traces[-1]
        if not outcome.ok or not trace.ok:
            raise RuntimeError(f"the verifiers episode ended with errors: {_errors_of(outcome)}")
        state["verifiers_rewards"] = {k: (None if r is None else r.value) for k, r in trace.rewards.items()}
        state["verifiers_stop_condition"] = trace.stop_condition
        return Observation(done=True, reward=float(trace.reward))

    async def _run_episode(self, episode: _VerifiersEpisode, task: Any, ctx: Any) -> None:
        try:
            outcome: Any = await self.env.run_episode(task, ctx)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            outcome = err
        await episode.calls.put(outcome)

    async def _close_episode(self, model: str) -> None:
        episode = _EPISODES.pop(model, None)
        self._live.discard(model)
        if episode is None:
            return
        if episode.task is not None and not episode.task.done():
            episode.task.cancel()  # verifiers' unwinding releases the harness's pending call with the episode
            await asyncio.wait({episode.task}, timeout=CLOSE_EPISODE_TIMEOUT_S)
        if episode.pending is not None and not episode.pending.reply.done():  # whatever still waits on it
            episode.pending.reply.set_exception(VerifiersRefusal("the rollout ended this episode"))


def _brief(messages: list[dict], chars: int = 60) -> str:
    return "[" + ", ".join(f"{m.get('role')}: {str(m.get('content'))[:chars]!r}" for m in messages) + "]"


def _errors_of(outcome: Any) -> str:
    if outcome is None:
        return "no outcome"
    errors = [f"{e.type}: {e.message}" for e in outcome.errors]
    for trace in outcome.traces:
        errors.extend(f"{e.type}: {e.message}" for e in trace.errors)
    return "; ".join(errors)[:300] or "none recorded"


def _errors(state: dict[str, Any]) -> str:
    outcome = state.pop("_verifiers_outcome", None)
    return repr(outcome) if isinstance(outcome, BaseException) else _errors_of(outcome)


def load_by_id(inner: str, spec: str) -> Any:
    """The environment a verifiers id names, built as `vf-eval <id>` builds it: `<taskset-id>` (the taskset's own
    `Env`, else `SingleAgentEnv`) or `<env-id>+<taskset-id>` (verifiers' own notation, e.g. `best-of-n+gsm8k-v1`),
    on the env config's defaults (`vf.resolve_env_config`, `vf.load_environment`).

    Raises:
        EnvironmentSpecError: the taskset or env is not installed, or building the env raised; names the fix.
    """
    vf = _import_verifiers()
    env_id, _, taskset_id = inner.rpartition("+")
    try:
        return vf.load_environment(vf.resolve_env_config({"id": env_id, "taskset": {"id": taskset_id}}))
    except Exception as err:
        raise EnvironmentSpecError(
            f"`environment` {spec!r}: verifiers cannot load environment {inner!r} (taskset {taskset_id!r}"
            f"{f', env {env_id!r}' if env_id else ''}): {err!r}. Fix: install the taskset's package, write "
            "verifiers:<env-id>+<taskset-id> for an env that needs a taskset, or name a factory returning a "
            "configured Env (verifiers:pkg.module:make_env)."
        ) from err


def resolve_verifiers(inner: str, spec: str) -> Any:
    """The verifiers environment a `module:Name` / `file.py:Name` inner spec names (imported).

    Args:
        inner: what follows `verifiers:`.
        spec: the whole spec, for messages.

    Returns:
        The `Env` class, object or factory named.

    Raises:
        EnvironmentSpecError: verifiers is missing, the module or attribute is missing.
    """
    _import_verifiers()
    parsed = parse_spec(inner, what="`environment`: verifiers spec", error=EnvironmentSpecError)
    if parsed.kind == "builtin":
        raise EnvironmentSpecError(f"`environment` {spec!r}: write builtin environments without `verifiers:`.")
    module = import_target(parsed, what="`environment`: verifiers spec", error=EnvironmentSpecError, prefix="_vf")
    if not hasattr(module, parsed.name):
        raise EnvironmentSpecError(f"`environment` {spec!r}: {parsed.target} has no attribute {parsed.name!r}.")
    return getattr(module, parsed.name)


def load_verifiers(inner: str, spec: str) -> VerifiersEnvironment:
    """Build the verifiers environment a spec names and wrap it: an id (`load_by_id`), or what `module:Name` /
    `file.py:Name` names (`resolve_verifiers`): an `Env` instance is used as is, an `Env` subclass is built on its
    config type's defaults, any other callable is called with no arguments and must return an `Env`.

    Raises:
        EnvironmentSpecError: see `load_by_id` and `resolve_verifiers`; building the env raised; the result is not
            a `verifiers.v1.Env`; see `VerifiersEnvironment`.
    """
    vf = _import_verifiers()
    if ":" not in inner:
        return VerifiersEnvironment(load_by_id(inner, spec), spec)
    target = resolve_verifiers(inner, spec)
    env = target
    if isinstance(target, type) and issubclass(target, vf.Env):
        from verifiers.v1.utils.generic import concrete_type  # the config type an Env subclass declares

        config_type = concrete_type(target, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
        try:
            env = target(config_type())
        except Exception as err:
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: building {target.__name__} on {config_type.__name__}'s defaults raised "
                f"{err!r}. Fix: name a factory that returns a configured Env (verifiers:pkg.module:make_env)."
            ) from err
    elif callable(target) and not isinstance(target, vf.Env):
        try:
            env = target()
        except Exception as err:
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: calling the factory with no arguments raised {err!r}. Fix: make it "
                "callable as factory() and return a configured verifiers.v1.Env."
            ) from err
    if not isinstance(env, vf.Env):
        raise EnvironmentSpecError(
            f"`environment` {spec!r}: {type(env).__name__} is not a verifiers.v1.Env. Fix: name an Env, an Env "
            "subclass, or a factory returning one."
        )
    return VerifiersEnvironment(env, spec)
