"""The guessing game of `builtin:guess` as a verifiers 0.4 environment, defined locally (nothing downloaded).

A `vf.Taskset` of the 16 secrets (each task's prompt is builtin:guess's, its `answer` the secret, as the dataset's
rows), a `vf.Task` whose `@vf.reward` scores the trace (builtin:guess's discounted reward, from the model's
guesses in the trace), and a `vf.Harness` whose program is the game's host: it calls the model through verifiers'
interception endpoint, answers each guess "higher" / "lower" as a user message, and stops at "correct" or after
HOST_TURNS guesses. It runs in-process (`SubprocessConfig`: no sandbox, no container). verifiers finds tasksets and
harnesses by module name, so importing this file registers the two as modules (`TASKSET_ID`, `HARNESS_ID`).

`make_env()` is the factory an `environment: verifiers:<this file>:make_env` spec names.
"""

from __future__ import annotations

import json
import sys
import types

import httpx
import verifiers.v1 as vf
from verifiers.v1.interception import InterceptionServerConfig
from verifiers.v1.runtimes import SubprocessConfig

from async_grpo.tasks import guess

TASKSET_ID = "async_grpo_test_verifiers_guess_taskset"
HARNESS_ID = "async_grpo_test_verifiers_guess_harness"
HOST_TURNS = 8  # the host's own limit (the run's max_turns is lower: the rollout ends the episode first)
CALL_TIMEOUT_S = 300.0  # one model call, as the host waits for it (a CPU rollout under load is slow)


LOOKUP_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look the secret up.", "parameters": {"type": "object"}},
}


def streamed_text(events: str) -> str:
    """The text of a streamed chat completion: its server-sent events' `delta.content`, joined."""
    parts = []
    for line in events.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


class GuessData(vf.TaskData):
    """A game: the secret number, as text (builtin:guess's `answer` column)."""

    answer: str = ""


def model_guesses(trace: vf.Trace) -> list[str]:
    """The model's turns in the trace's last branch, oldest first."""
    messages = trace.branches[-1].messages if trace.branches else []
    return [str(m.content or "") for m in messages if m.role == "assistant"]


class GuessTask(vf.Task[GuessData]):
    """One game; its reward is builtin:guess's: DISCOUNT ** (turns - 1) when a guess hit the secret, else 0."""

    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        secret = int(self.data.answer)
        for turn, text in enumerate(model_guesses(trace), start=1):
            if guess.guess_reply(secret, text)[1]:
                return guess.guess_reward(True, turn)
        return 0.0


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    """The 16 games, one per secret, with builtin:guess's prompt."""

    def load(self):
        return [
            GuessTask(GuessData(prompt=guess.guess_prompt(), answer=str(secret)), self.config.task)
            for secret in range(guess.LOW, guess.HIGH + 1)
        ]


class GuessHostConfig(vf.HarnessConfig):
    """The host's settings."""

    turns: int = HOST_TURNS
    keep_history: bool = True  # False: each call sends the prompt and the last answer only (a rewritten history)
    offer_tools: bool = False  # True: each call offers the model a tool of the harness's own
    stream: bool = False  # True: each call asks for a streamed answer (server-sent events)


class GuessHost(vf.Harness[GuessHostConfig]):
    """The game's host as the agent program: a chat loop against the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime):
        return None

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        number = int(data.answer)
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
            for _ in range(self.config.turns):
                request = {"model": ctx.model, "messages": messages}
                if not self.config.keep_history:
                    request["messages"] = messages[:1] + messages[-1:] if len(messages) > 1 else messages
                if self.config.offer_tools:
                    request["tools"] = [LOOKUP_TOOL]
                if self.config.stream:
                    request["stream"] = True
                reply = await http.post(
                    f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {secret}"}, json=request
                )
                if reply.status_code != 200:
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=reply.text)
                text = (
                    streamed_text(reply.text)
                    if self.config.stream
                    else reply.json()["choices"][0]["message"]["content"]
                )
                text = text or ""
                messages.append({"role": "assistant", "content": text})
                answer, solved = guess.guess_reply(number, text)
                if solved:
                    break
                messages.append({"role": "user", "content": answer})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def _register(name: str, cls: type) -> None:
    module = types.ModuleType(name)
    setattr(module, cls.__name__, cls)
    module.__all__ = [cls.__name__]
    sys.modules[name] = module


_register(TASKSET_ID, GuessTaskset)
_register(HARNESS_ID, GuessHost)


def make_env(turns: int = HOST_TURNS, **host: bool) -> vf.SingleAgentEnv:
    """The guessing game as a `vf.SingleAgentEnv`: the local taskset, the host harness (`host`: its
    GuessHostConfig flags), in-process."""
    harness = GuessHostConfig(id=HARNESS_ID, turns=turns, **host)
    return vf.SingleAgentEnv(
        vf.SingleAgentEnvConfig(
            taskset=vf.TasksetConfig(id=TASKSET_ID),
            agent=vf.AgentConfig(harness=harness, runtime=SubprocessConfig()),
            interception=InterceptionServerConfig(),
        )
    )


def make_forgetful_env() -> vf.SingleAgentEnv:
    """The game with a host that sends the prompt and its last answer only (it drops the earlier turns)."""
    return make_env(keep_history=False)


def make_streaming_env() -> vf.SingleAgentEnv:
    """The game with a host that asks for streamed answers."""
    return make_env(stream=True)


def make_tool_offering_env() -> vf.SingleAgentEnv:
    """The game with a host that offers the model a tool of its own."""
    return make_env(offer_tools=True)
