"""The learning-rate schedule (transformers.get_scheduler, TRL's knobs), its state in the learner's state dict,
AdamW's betas, gradient checkpointing (same update, less memory) and max_steps from num_train_epochs."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.runner.builders import build_local_learner, lr_schedule, with_epochs_resolved
from async_grpo.trainer.lr_schedule import warmup_steps
from async_grpo.trainer.policy_setup import prepare_policy
from async_grpo.transports.messages import RolloutGroup, TrainBatch

PAD = 256


def batch() -> TrainBatch:
    comps = [[40, 41, 42], [43, 44]]
    group = RolloutGroup(
        prompt_ids=[10, 11],
        completion_ids=comps,
        sampling_logprobs=[[-1.0] * len(c) for c in comps],
        truncated=[False, False],
        completions=["a", "b"],
        prompt="p",
        columns={},
        policy_version=0,
        rewards_per_func=[[1.0], [0.0]],
        rewards=[1.0, 0.0],
        advantages=[0.7, -0.7],
    )
    return TrainBatch(groups=[group])


def config(**fields) -> GRPOConfig:
    return GRPOConfig(per_device_train_batch_size=2, num_generations=2, learning_rate=1e-3, **fields)


def rates(learner, steps: int) -> list[float]:
    return [learner.step(batch())["learning_rate"] for _ in range(steps)]


def test_linear_and_cosine_with_warmup_follow_transformers_formulas(tiny_model):
    linear = build_local_learner(config(max_steps=4), tiny_model, PAD)  # TRL's default: linear decay to 0
    assert rates(linear, 4) == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    cosine = build_local_learner(config(max_steps=6, lr_scheduler_type="cosine", warmup_steps=2), tiny_model, PAD)
    # warm-up: s / 2; then 0.5 (1 + cos(pi (s - 2) / 4))
    expected = [0.0, 0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert rates(cosine, 6) == pytest.approx([1e-3 * e for e in expected])
    constant = build_local_learner(config(max_steps=3, lr_scheduler_type="constant"), tiny_model, PAD)
    assert rates(constant, 3) == [1e-3] * 3


def test_warmup_knobs():
    assert warmup_steps(0, 0.1, 50) == 5 and warmup_steps(0.05, None, 50) == 3 and warmup_steps(4, None, 50) == 4
    assert lr_schedule(config(max_steps=20, warmup_ratio=0.25)).num_warmup_steps == 5
    with pytest.raises(ValueError, match="resolved from num_train_epochs"):
        lr_schedule(config(max_steps=-1))


def test_the_schedule_position_is_in_the_learner_state(tiny_model_path):
    from transformers import AutoModelForCausalLM

    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)  # noqa: E731
    cfg = config(max_steps=6, lr_scheduler_type="cosine", warmup_steps=2, adam_beta2=0.95)
    first = build_local_learner(cfg, load(), PAD)
    rates(first, 3)
    state = first.state_dict()
    assert state["lr_scheduler"]["last_epoch"] == 3 and first.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    second = build_local_learner(cfg, load(), PAD)
    second.load_state_dict(state)
    assert rates(first, 3) == rates(second, 3)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradient_checkpointing_gives_the_same_update(tiny_model_path):
    from transformers import AutoModelForCausalLM

    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)  # noqa: E731
    padded = config(share_prompt_prefix=False)  # the same layout on both sides (auto shares only without checkpointing)
    plain = build_local_learner(padded, load(), PAD)
    saver = build_local_learner(padded, prepare_policy(load(), gradient_checkpointing=True, disable_dropout=True), PAD)
    assert saver.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    a, b = plain.step(batch()), saver.step(batch())
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for p, q in zip(plain.model.parameters(), saver.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_max_steps_from_epochs():
    cfg = config(max_steps=-1, num_train_epochs=2.5)  # 1 group per step
    assert with_epochs_resolved(cfg, num_prompts=7, world_size=1).batch.max_steps == 18  # ceil(2.5 x 7 / 1)
    assert with_epochs_resolved(cfg, num_prompts=7, world_size=2).batch.max_steps == 9
    assert with_epochs_resolved(config(max_steps=5), 7, 1).batch.max_steps == 5
