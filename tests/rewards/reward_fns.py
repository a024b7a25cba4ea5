"""Reward functions for the RewardPool tests, loaded by file-path spec (`.../reward_fns.py:<name>`)."""

import asyncio
import os
import time


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) for c in completions]


def answer_reward(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def abstain_odd(prompts, completions, completion_ids, **kwargs):
    return [None if i % 2 else 1 for i in range(len(completions))]


async def async_reward(prompts, completions, completion_ids, **kwargs):
    await asyncio.sleep(0.01)
    return [0.5 for _ in completions]


def sleepy_reward(prompts, completions, completion_ids, **kwargs):
    """Takes 0.2 s for the group (`ScoredGroup.seconds` must show it)."""
    time.sleep(0.2)
    return [0.0 for _ in completions]


def flaky_reward(prompts, completions, completion_ids, **kwargs):
    """Misbehaves on command: a completion "RAISE" raises, "HANG" sleeps 60 s, "SHORT" returns too few values."""
    if "RAISE" in completions:
        raise ZeroDivisionError("boom in the reward")
    if "HANG" in completions:
        time.sleep(60)
    if "SHORT" in completions:
        return [1.0]
    return [1.0 for _ in completions]


def raising_reward(prompts, completions, completion_ids, **kwargs):
    raise ZeroDivisionError("boom in the reward")


def hanging_reward(prompts, completions, completion_ids, **kwargs):
    time.sleep(60)
    return [0.0 for _ in completions]


def wrong_length_reward(prompts, completions, completion_ids, **kwargs):
    return [1.0]


def string_reward(prompts, completions, completion_ids, **kwargs):
    return ["high" for _ in completions]


def crashing_reward(prompts, completions, completion_ids, **kwargs):
    os._exit(3)


NOT_CALLABLE = 3
