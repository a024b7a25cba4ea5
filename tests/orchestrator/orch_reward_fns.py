"""Reward functions for the orchestrator tests, loaded by the reward workers through a file-path spec.

Behaviour is keyed on the dataset's `answer` column (passed to reward functions as TRL does):
"hang" sleeps 60 s (longer than any test's reward timeout), "raise" raises, anything else scores.
"""

import time

HANG_S = 60


def length_reward(prompts, completions, completion_ids, answer, **kwargs):
    """len(completion) per completion, misbehaving on command through the `answer` column."""
    if answer[0] == "hang":
        time.sleep(HANG_S)
    if answer[0] == "raise":
        raise ValueError("reward function failed on purpose")
    return [float(len(c)) for c in completions]


def constant_reward(prompts, completions, completion_ids, **kwargs):
    return [1.0 for _ in completions]
