"""Reward functions for the dynamic-sampling and batch-shaping tests (loaded by spawned reward workers by file path)."""


def flat_or_length(prompts, completions, completion_ids, answer, **kwargs):
    """Constant 1.0 for prompts whose `answer` is "flat" (a zero-std group), else len(completion)."""
    if answer[0] == "flat":
        return [1.0 for _ in completions]
    return [float(len(c)) for c in completions]


def zero_or_length(prompts, completions, completion_ids, answer, **kwargs):
    """0.0 for every completion of prompts whose `answer` is "zero" (a group that scored ~0), else len(completion)."""
    if answer[0] == "zero":
        return [0.0 for _ in completions]
    return [float(len(c)) for c in completions]
