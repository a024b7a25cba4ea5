"""Reward functions for the TRL-contract tests: TRL's own (built by its factories) and probes of the call."""

import asyncio

from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

soft_overlong = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)


def contract_probe(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """1.0 per completion; None for completions longer than 3 tokens (not applicable); logs what it saw."""
    log_extra("kind", [type(c).__name__ for c in completions])
    log_extra("step", [trainer_state.global_step] * len(completions))
    log_metric("probe/columns", float(len(kwargs)))
    log_metric("probe/max_steps", float(trainer_state.max_steps))
    return [None if len(ids) > 3 else 1.0 for ids in completion_ids]


async def async_probe(prompts, completions, completion_ids, **kwargs):
    """An async reward function (TRL awaits them): 0.25 per completion."""
    await asyncio.sleep(0.01)
    return [0.25 for _ in completions]
