"""A reward file that fails when imported (the bad-input corpus)."""

raise RuntimeError("this reward module is broken at import time")


def reward(prompts, completions, completion_ids, **kwargs):  # pragma: no cover - never reached
    return [0.0 for _ in completions]
