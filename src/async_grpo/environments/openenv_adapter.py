"""OpenEnv environments (`openenv-core`, TRL's and SkyRL's) driven by the environment protocol, token in and out.

Spec: `environment: openenv:<pkg.module:factory>` or `openenv:<path/to/file.py:factory>`. The factory is called
with no arguments, once per episode (an OpenEnv `Environment` keeps its episode on `self`, one session per object),
and must return an in-process `openenv.core.env_server.interfaces.Environment`, or a `SyncEnvClient` of an OpenEnv
server (`MyEnvClient(base_url=...).sync()`; its action and observation classes are the wrapped client's), or any
object with the same synchronous `reset(seed=..., ...)` / `step(action)` answering an OpenEnv `Observation` or a
`StepResult`.

    OpenEnv                                      this protocol
    factory()                                    one object per episode (state["openenv_env"]; closed when the
                                                 episode stops, `close_episode`)
    env.reset(seed=<the row's seed>)             reset(row, state): its observation text -> one user message
    ActionCls(<its one str field>=<text>)        step(action, state): the model's text, nothing parsed
    env.step(action) -> observation              Observation(messages, reward, done)
    observation.reward / observation.done        Observation.reward (summed into env_reward), Observation.done

The rollout keeps generating with vLLM on the held token ids: the adapter only turns the model's text into the
environment's action and the environment's observation text into a user message (`EnvironmentRollout`). What it
cannot keep it refuses at load (`load_openenv`, before vLLM starts): an action class without exactly one required
`str` field to carry the text, an observation class with no `str` field (an image, a tensor, only numbers), an
object that is not an OpenEnv environment (an async `EnvClient`; MCP tool-calling environments, whose actions are
tool calls, are refused the same way). An observation that holds no text at run time fails its sample
(`step_exception`), never trains on made-up tokens.

Every sample of a group opens the same episode: `reset` gets `seed` = the row's `seed` column when it has one, else
a stable hash of the prompt; columns named like `reset`'s own parameters (e.g. `episode_id`, or an env's own
keyword) are passed too. Importing this module imports no OpenEnv code; `load_openenv` does, and names the package
and the fix when it is missing.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import typing
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from async_grpo.environments.base import EnvironmentSpecError, Observation

PACKAGE = "openenv-core"
INSTALL_FIX = (
    f"Fix: install OpenEnv where the rollouts run: `pip install {PACKAGE}==0.3.0` (its dependencies pin "
    "pillow<13; see docs/environments.md, 'Adapters')."
)
RESERVED_OBSERVATION_FIELDS = ("done", "reward", "metadata")
TEXT_FIELD_PREFERENCE = ("text", "message", "content", "prompt", "feedback", "observation")


def _openenv_types() -> tuple[type, type, type]:
    """(Environment, Action, Observation) of OpenEnv.

    Raises:
        EnvironmentSpecError: openenv-core is not installed (or fails to import); names the package and the fix.
    """
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action
        from openenv.core.env_server.types import Observation as OpenEnvObservation
    except ImportError as err:
        raise EnvironmentSpecError(
            f"`environment`: an openenv: spec needs the {PACKAGE} package, which cannot be imported ({err}). "
            + INSTALL_FIX
        ) from err
    return Environment, Action, OpenEnvObservation


def _generic_args(cls: type) -> list[Any]:
    """Every type argument in `cls`'s generic bases (`Environment[MyAction, MyObs, MyState]` -> the three)."""
    out: list[Any] = []
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            out.extend(typing.get_args(base))
    return out


def _hinted(func: Any, name: str) -> Any:
    """The type hint of parameter `name` ("return" for the result) of `func`, or None when there is none."""
    try:
        return typing.get_type_hints(func).get(name)
    except Exception:  # unresolvable forward references: fall back to the generic arguments
        return None


def _find_class(env_cls: type, method: str, hint: str, base: type) -> type | None:
    """The subclass of `base` that `env_cls.<method>`'s `hint` names, else the first one among its generic
    arguments, else None."""
    candidates = [_hinted(getattr(env_cls, method, None), hint), *_generic_args(env_cls)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, base) and c is not base:
            return c
    return None


def _is_str(annotation: Any) -> bool:
    """True for `str` and `str | None` / `Optional[str]`."""
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    return bool(args) and str in args and all(a in (str, type(None)) for a in args)


def action_text_field(action_cls: type) -> str:
    """The one field of an OpenEnv action class that carries the model's text.

    Returns:
        The name of its only `str` field, all its other fields (`metadata` aside) having defaults.

    Raises:
        EnvironmentSpecError: no `str` field, several, or another required field (the text cannot fill it).
    """
    fields = {k: f for k, f in action_cls.model_fields.items() if k != "metadata"}
    texts = [k for k, f in fields.items() if _is_str(f.annotation)]
    required_others = [k for k, f in fields.items() if f.is_required() and k not in texts]
    if len(texts) != 1 or required_others:
        raise EnvironmentSpecError(
            f"`environment`: OpenEnv action class {action_cls.__name__} has fields {sorted(fields)}; the adapter "
            "puts the model's text into its only str field, and needs every other field defaulted (it parses "
            "nothing: structured or tool-call actions would train on text the environment never read). Fix: give "
            "the action exactly one str field (e.g. `message: str`), or wrap the environment so that it does."
        )
    return texts[0]


def observation_text_field(obs_cls: type) -> str:
    """The field of an OpenEnv observation class whose text the model reads.

    Returns:
        Its only `str` field besides done/reward/metadata; among several, the first of `TEXT_FIELD_PREFERENCE`.

    Raises:
        EnvironmentSpecError: no `str` field (the observation is not text), or several and none preferred.
    """
    fields = {k: f for k, f in obs_cls.model_fields.items() if k not in RESERVED_OBSERVATION_FIELDS}
    texts = [k for k, f in fields.items() if _is_str(f.annotation)]
    if len(texts) == 1:
        return texts[0]
    preferred = [k for k in TEXT_FIELD_PREFERENCE if k in texts]
    if preferred:
        return preferred[0]
    what = "no str field" if not texts else f"several str fields {texts} and none named {list(TEXT_FIELD_PREFERENCE)}"
    raise EnvironmentSpecError(
        f"`environment`: OpenEnv observation class {obs_cls.__name__} has {what} (fields {sorted(fields)}); the "
        "model reads observations as chat text, so an image, tensor or numeric observation cannot be fed to it. "
        "Fix: use an environment whose observation carries its text in one str field (e.g. `text: str`), or wrap "
        "it to render the observation as text."
    )


def row_seed(row: Mapping[str, Any]) -> int:
    """The seed of a row's episode: its `seed` column when that is an int, else a stable hash of its prompt (so the
    G samples of one prompt open the same episode); in [0, 2**31)."""
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    text = json.dumps(row.get("prompt"), sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % (2**31)


class OpenEnvAdapter:
    """An OpenEnv environment behind the environment protocol (see the module docstring); synchronous, so
    `EnvironmentCaller` runs each call in a worker thread under env_timeout_s.

    Args:
        factory: returns a fresh OpenEnv environment (called once per episode, from a worker thread).
        action_cls: the environment's action class (an OpenEnv `Action` subclass).
        action_field: the action's field that gets the model's text (`action_text_field`).
        spec: the spec, for messages.

    Raises:
        nothing at construction; see `load_openenv`, which builds it.
    """

    def __init__(self, factory: Callable[[], Any], action_cls: type, action_field: str, spec: str):
        self.factory, self.action_cls, self.action_field, self.spec = factory, action_cls, action_field, spec
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._obs_fields: dict[type, str] = {}

    def reset(self, row: Mapping[str, Any], state: dict[str, Any]) -> Observation:
        """Make this episode's environment and reset it (seed: `row_seed`); its observation text is the first user
        message after the dataset prompt ([] when empty).

        Raises:
            EnvironmentSpecError: its observation is not text (`observation_text_field`).
            Exception: whatever the factory or the environment's reset raises (counted as reset_exception).
        """
        env = self.factory()
        with self._lock:
            self._live.add(env)
        state["openenv_env"] = env  # not JSON: reward functions never see it (json_safe_state)
        kwargs: dict[str, Any] = {"seed": row_seed(row)}
        try:
            params = inspect.signature(env.reset).parameters
        except (TypeError, ValueError):
            params = {}
        kwargs.update({k: v for k, v in row.items() if k in params and k not in ("seed", "self")})
        return self._convert(env.reset(**kwargs), state)

    def step(self, action: str, state: dict[str, Any]) -> Observation:
        """Send the model's text as the action's text field; the observation's text is the next user message, its
        reward and done are passed on. The episode's environment is closed when it is done.

        Raises:
            EnvironmentSpecError: its observation is not text.
            Exception: whatever the environment's step raises (counted as step_exception).
        """
        env = state["openenv_env"]
        obs = self._convert(env.step(self.action_cls(**{self.action_field: action})), state)
        if obs.done:
            self._close_one(env)
        return obs

    def _convert(self, result: Any, state: dict[str, Any]) -> Observation:
        """An OpenEnv observation (or StepResult) -> an `Observation` with the text as one user message."""
        reward, done = getattr(result, "reward", None), getattr(result, "done", False)
        obs = getattr(result, "observation", result)  # a StepResult carries the observation inside
        if obs is not result:
            reward = reward if reward is not None else getattr(obs, "reward", None)
            done = bool(done or getattr(obs, "done", False))
        cls = type(obs)
        if cls not in self._obs_fields:
            if not hasattr(cls, "model_fields"):
                raise EnvironmentSpecError(
                    f"`environment` {self.spec!r}: the environment answered a {cls.__name__}, not an OpenEnv "
                    "Observation. Fix: return an openenv Observation subclass from reset and step."
                )
            self._obs_fields[cls] = observation_text_field(cls)
        text = getattr(obs, self._obs_fields[cls])
        if not done and not isinstance(text, str):
            raise ValueError(f"the observation's {self._obs_fields[cls]} is {text!r}, not text")
        state["openenv_steps"] = int(state.get("openenv_steps", -1)) + 1
        messages = [{"role": "user", "content": text}] if isinstance(text, str) and text else []
        if isinstance(reward, bool):
            reward = float(reward)
        return Observation(messages, reward=None if reward is None else float(reward), done=bool(done))

    def close_episode(self, state: dict[str, Any]) -> None:
        """The episode stopped (done, max_turns, the length budget, a failure): close its environment now (a
        `SyncEnvClient`'s connection and thread with it), not at the end of the run; once per environment.

        Raises:
            Exception: whatever the environment's close raises (logged by the caller, never counted).
        """
        env = state.pop("openenv_env", None)
        if env is not None:
            self._close_one(env)

    def _close_one(self, env: Any) -> None:
        with self._lock:
            if env not in self._live:
                return  # closed already (done, then the episode's close)
            self._live.discard(env)
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def close(self) -> None:
        """Close every episode's environment still open (an episode whose close never came: the run stopped)."""
        with self._lock:
            live = list(self._live)
            self._live = weakref.WeakSet()
        for env in live:
            try:
                env.close()
            except Exception:  # best effort: the run is ending
                pass


def load_openenv(factory: Callable[[], Any], spec: str) -> OpenEnvAdapter:
    """Check an OpenEnv factory and wrap it (`OpenEnvAdapter`): one probe instance is made to learn its action and
    observation classes, then closed.

    Args:
        factory: what the spec after `openenv:` names (a class or a function returning an environment).
        spec: the whole spec, for messages.

    Raises:
        EnvironmentSpecError: openenv-core is missing, the factory raises or returns no in-process OpenEnv
            environment (an async client, an MCP tool environment), its action class has no single text field, or
            its observation class no text field. Each message names `environment` and the fix.
    """
    env_base, action_base, obs_base = _openenv_types()
    try:
        probe = factory()
    except Exception as err:
        raise EnvironmentSpecError(
            f"`environment` {spec!r}: calling the OpenEnv factory with no arguments raised {err!r}. Fix: make it "
            "callable as factory() (bind settings with a module-level function or functools.partial)."
        ) from err
    try:
        cls = type(probe)
        if getattr(cls, "__module__", "").startswith("openenv.core.env_server.mcp") or any(
            k.__name__ == "MCPEnvironment" for k in cls.__mro__
        ):
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: {cls.__name__} is an MCP tool-calling environment; its actions are tool "
                "calls, which this adapter does not parse from the model's text. Fix: use an environment whose "
                "action is one text field."
            )
        if not isinstance(probe, env_base):
            sync_methods = all(
                callable(getattr(probe, m, None)) and not inspect.iscoroutinefunction(getattr(probe, m))
                for m in ("reset", "step")
            )
            if not sync_methods:
                raise EnvironmentSpecError(
                    f"`environment` {spec!r}: the factory returned a {cls.__name__}, not an in-process OpenEnv "
                    "Environment with synchronous reset/step (an async EnvClient is not driven). Fix: return the "
                    "Environment itself, or a SyncEnvClient (e.g. `MyEnvClient(base_url=...).sync()`)."
                )
        typed = type(getattr(probe, "_async", probe))  # a SyncEnvClient's types are its wrapped EnvClient's
        action_cls = _find_class(cls, "step", "action", action_base) or _find_class(
            typed, "step", "action", action_base
        )
        if action_cls is None:
            raise EnvironmentSpecError(
                f"`environment` {spec!r}: cannot tell {cls.__name__}'s action class. Fix: annotate `step(self, "
                "action: MyAction)` or subclass `Environment[MyAction, MyObservation, MyState]`."
            )
        field = action_text_field(action_cls)
        obs_cls = _find_class(cls, "step", "return", obs_base) or _find_class(typed, "step", "return", obs_base)
        if obs_cls is not None:
            observation_text_field(obs_cls)
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                pass
    return OpenEnvAdapter(factory, action_cls, field, spec)
