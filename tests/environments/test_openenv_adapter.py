"""The OpenEnv adapter (`environment: openenv:<module:factory>`) on small OpenEnv environments defined here: the
text action and observation mapping, rewards and done, one environment per episode, the same opening for a group,
and the refusals (non-text observation, structured action, async client, missing package)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from async_grpo.environments import EnvironmentCaller, EnvironmentSpecError, check_reset, load_environment
from async_grpo.environments.openenv_adapter import OpenEnvAdapter, row_seed

interfaces = pytest.importorskip("openenv.core.env_server.interfaces", reason="openenv-core is not installed")
types = pytest.importorskip("openenv.core.env_server.types")

M = "openenv:tests.environments.test_openenv_adapter"


class GuessAction(types.Action):
    message: str


class GuessObservation(types.Observation):
    text: str = ""


class GuessEnv(interfaces.Environment[GuessAction, GuessObservation, types.State]):
    """Find a secret from 1 to 8 (drawn from the reset seed), told higher or lower; reward 1.0 when found."""

    closed = 0

    def __init__(self):
        super().__init__()
        self._state = types.State()
        self.secret = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.secret = (seed or 0) % 8 + 1
        self._state = types.State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="Guess a number from 1 to 8.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            return GuessObservation(text="Answer with a number.", reward=0.0)
        if guess == self.secret:
            return GuessObservation(text="correct", reward=1.0, done=True)
        return GuessObservation(text="higher" if guess < self.secret else "lower", reward=0.0)

    @property
    def state(self):
        return self._state

    def close(self):
        GuessEnv.closed += 1


class ImageObservation(types.Observation):
    pixels: list[float] = []


class ImageEnv(interfaces.Environment[GuessAction, ImageObservation, types.State]):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return ImageObservation(pixels=[0.0])

    def step(self, action, timeout_s=None, **kwargs):
        return ImageObservation(pixels=[1.0])

    @property
    def state(self):
        return types.State()


class MoveAction(types.Action):
    x: int
    y: int


class MoveEnv(interfaces.Environment[MoveAction, GuessObservation, types.State]):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return GuessObservation(text="move")

    def step(self, action, timeout_s=None, **kwargs):
        return GuessObservation(text="moved")

    @property
    def state(self):
        return types.State()


class AsyncClientLike:
    async def reset(self):
        return GuessObservation(text="hi")

    async def step(self, action):
        return GuessObservation(text="hi")


class RaisingEnv(GuessEnv):
    def step(self, action, timeout_s=None, **kwargs):
        raise RuntimeError("boom")


def run(coro):
    return asyncio.run(coro)


def play(env, row, actions):
    caller = EnvironmentCaller(env, timeout_s=5.0)
    state = {"turn": 0}
    try:
        outs = [run(caller.reset(row, state))]
        for i, a in enumerate(actions):
            state["turn"] = i + 1
            outs.append(run(caller.step(a, state)))
    finally:
        caller.close()
    return outs, state


def test_an_openenv_environment_plays_through_the_protocol_text_in_text_out():
    env = load_environment(f"{M}:GuessEnv")
    assert isinstance(env, OpenEnvAdapter) and env.action_field == "message"
    row = {"prompt": [{"role": "user", "content": "play"}], "seed": 2}  # secret 3
    outs, state = play(env, row, ["5", "x", "2", "3"])
    assert [o.failure for o in outs] == [None] * 5
    opening, *steps = [o.observation for o in outs]
    assert opening.messages == [{"role": "user", "content": "Guess a number from 1 to 8."}] and not opening.done
    assert [s.messages[0]["content"] for s in steps[:3]] == ["lower", "Answer with a number.", "higher"]
    assert [s.reward for s in steps] == [0.0, 0.0, 0.0, 1.0] and steps[-1].done
    assert state["openenv_env"].state.step_count == 4


def test_each_episode_gets_its_own_environment_and_a_group_opens_the_same_episode():
    env = load_environment(f"{M}:GuessEnv")
    row = {"prompt": [{"role": "user", "content": "play"}]}
    s1, s2 = {}, {}
    env.reset(row, s1), env.reset(row, s2)
    assert s1["openenv_env"] is not s2["openenv_env"]
    assert s1["openenv_env"].secret == s2["openenv_env"].secret == row_seed(row) % 8 + 1
    other = {"prompt": [{"role": "user", "content": "another"}]}
    assert row_seed(other) != row_seed(row) and row_seed({"seed": 7, **row}) == 7
    cls = type(s1["openenv_env"])  # the class as the spec imported it (pytest may import this file apart)
    before = cls.closed
    env.close_episode(s1)  # the rollout stopped episode 1 (max_turns): its environment is closed now, once
    env.close_episode(s1)
    assert cls.closed == before + 1 and "openenv_env" not in s1
    env.close()  # the one still open
    assert cls.closed == before + 2


def test_the_environments_reward_reaches_env_reward_through_the_rollout_state():
    from async_grpo.orchestrator.env_rollout import EnvironmentRollout, _Episode

    ep = _Episode({"env_reward": None})
    for reward in (0.0, 1.0):
        EnvironmentRollout._add_reward(ep, reward)
    assert ep.state["env_reward"] == 1.0


def test_a_step_that_raises_is_a_counted_failure():
    outs, _ = play(load_environment(f"{M}:RaisingEnv"), {"prompt": []}, ["1"])
    assert outs[1].failure == "step_exception" and "boom" in outs[1].error


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("ImageEnv", ["ImageObservation", "no str field", "Fix:"]),
        ("MoveEnv", ["MoveAction", "one str field", "Fix:"]),
        ("AsyncClientLike", ["AsyncClientLike", "not an in-process OpenEnv", "Fix:"]),
    ],
)
def test_what_the_adapter_cannot_keep_is_refused_at_load(name, words):
    with pytest.raises(EnvironmentSpecError) as err:
        load_environment(f"{M}:{name}")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_first_reset_is_checked_as_preflight_does():
    check_reset(load_environment(f"{M}:GuessEnv"), f"{M}:GuessEnv", {"prompt": []}, timeout_s=5.0)


def test_spec_syntax_is_checked_in_config_and_loading():
    from async_grpo.config.sections.environments import EnvironmentsConfig

    assert EnvironmentsConfig(environment=f"{M}:GuessEnv").environment == f"{M}:GuessEnv"
    for bad in ("openenv:", "openenv:builtin:guess", "openenv:not a module:f"):
        with pytest.raises(ValueError, match="environment spec"):
            EnvironmentsConfig(environment=bad)
    with pytest.raises(EnvironmentSpecError, match="no attribute"):
        load_environment(f"{M}:Nope")


def test_a_missing_openenv_package_is_named_with_the_fix(monkeypatch):
    for name in list(sys.modules):
        if name == "openenv" or name.startswith("openenv."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "openenv", None)  # import openenv raises ImportError
    with pytest.raises(EnvironmentSpecError, match="openenv-core.*Fix: install"):
        load_environment(f"{M}:GuessEnv")


def test_a_sync_client_of_a_real_openenv_server_is_driven_too():
    """OpenEnv's own server (create_app over uvicorn, in a thread) and its EnvClient, wrapped by `.sync()`."""
    import socket
    import threading
    import time

    import uvicorn
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.http_server import create_app

    app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)

    class GuessClient(EnvClient[GuessAction, GuessObservation, types.State]):
        def _step_payload(self, action):
            return action.model_dump()

        def _parse_result(self, payload):
            obs = GuessObservation(**payload.get("observation", {}))
            return StepResult(observation=obs, reward=payload.get("reward"), done=bool(payload.get("done")))

        def _parse_state(self, payload):
            return types.State(**payload)

    module = sys.modules[__name__]
    module.make_client = lambda: GuessClient(base_url=f"http://127.0.0.1:{port}").sync()
    try:
        env = load_environment(f"openenv:{__name__}:make_client")
        assert env.action_field == "message"
        outs, state = play(env, {"prompt": [], "seed": 2}, ["5", "3"])
        assert [o.failure for o in outs] == [None] * 3, outs
        assert outs[0].observation.messages[0]["content"] == "Guess a number from 1 to 8."
        assert outs[1].observation.messages == [{"role": "user", "content": "lower"}]
        assert outs[2].observation.reward == 1.0 and outs[2].observation.done
        env.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
