"""Environments for the tests: good ones (async and sync), broken ones, and factories that are not environments."""

from __future__ import annotations

import asyncio
import time

from async_grpo.environments import Observation


class EchoEnv:
    """Async: answers each turn with `echo: <action>` (role user); done after the third turn, reward 1.0."""

    async def reset(self, row, state):
        state["seen"] = []
        return Observation([])

    async def step(self, action, state):
        state["seen"].append(action)
        if state["turn"] >= 3:
            return Observation([], reward=1.0, done=True)
        return Observation([{"role": "user", "content": f"echo: {action}"}], reward=0.25)


class SyncEnv:
    """Synchronous methods (run in a worker thread): a tool-role observation, never done."""

    def reset(self, row, state):
        return Observation([])

    def step(self, action, state):
        return Observation([{"role": "tool", "name": "env", "content": "ok"}])


class RaisingStepEnv(EchoEnv):
    async def step(self, action, state):
        raise RuntimeError("boom")


class RaisingResetEnv(EchoEnv):
    async def reset(self, row, state):
        raise KeyError("secret")


class HangingStepEnv(EchoEnv):
    async def step(self, action, state):
        await asyncio.sleep(60)


class HangingSyncEnv(SyncEnv):
    def step(self, action, state):
        time.sleep(2)
        return Observation([])


class BadObservationEnv(EchoEnv):
    async def step(self, action, state):
        return {"messages": [{"role": "user", "content": "x"}]}


class WrongSignatureEnv:
    async def reset(self):
        return Observation([])

    async def step(self, action, state):
        return Observation([])


class NoStepEnv:
    async def reset(self, row, state):
        return Observation([])


def make_echo():
    """A factory function."""
    return EchoEnv()


def needs_args(size):
    return EchoEnv()


NOT_CALLABLE = 3
