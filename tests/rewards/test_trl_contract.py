"""TRL's reward contract through the local pool and the reward service: TRL's own `trl.rewards` functions score
standard and conversational groups built by the rollout (`score_group`), with completion_ids, trainer_state,
log_extra / log_metric, None for "not applicable" and async functions, and no group is dropped."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import yaml

from async_grpo.config import GRPOConfig
from async_grpo.orchestrator.rollout import score_group
from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool
from async_grpo.transports.messages import RolloutGroup

pytest.importorskip("trl")
pytest.importorskip("math_verify")

FNS = Path(__file__).with_name("trl_fns.py")
CONVERSATIONAL = [
    "trl.rewards:think_format_reward",
    "trl.rewards:accuracy_reward",
    f"{FNS}:contract_probe",
    f"{FNS}:async_probe",
]
STANDARD = [f"{FNS}:soft_overlong", f"{FNS}:repetition", f"{FNS}:contract_probe", "builtin:math_accuracy"]
PROMPT = [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "1/3 + 0?"}]
TEXTS = ["<think>easy</think>The answer is $\\frac{1}{3}$", "no thinking, \\boxed{\\frac{1}{2}}", "<think>a</think>b"]
IDS = [[1, 2], [3, 3, 3, 3, 3, 3], [7, 8, 9, 9, 9, 9, 9, 9]]  # 2, 6 and 8 tokens


def make_group(prompt) -> RolloutGroup:
    return RolloutGroup(
        prompt_ids=[5, 6],
        completion_ids=[list(i) for i in IDS],
        sampling_logprobs=[[-1.0] * len(i) for i in IDS],
        truncated=[False] * 3,
        completions=list(TEXTS),
        prompt=prompt,
        columns={"solution": "$\\frac{1}{3}$", "answer": "1/3"},
        policy_version=0,
    )


def scored(pool, prompt) -> RolloutGroup:
    group = make_group(prompt)
    asyncio.run(asyncio.wait_for(score_group(pool, group), timeout=60))
    return group


def check_conversational(group: RolloutGroup) -> None:
    think, accuracy, probe, asynchronous = (list(col) for col in zip(*group.rewards_per_func))
    assert think == [1.0, 0.0, 1.0]  # TRL's think_format_reward read completion[0]["content"]
    assert accuracy == [1.0, 0.0, 0.0]  # math-verify: 1/3 == 1/3, 1/2 != 1/3, "b" unparseable
    assert probe[0] == 1.0 and math.isnan(probe[1]) and math.isnan(probe[2])  # None: not applicable
    assert asynchronous == [0.25] * 3
    assert group.reward_extra["kind"] == ["list"] * 3  # conversational: [{"role": "assistant", "content": ...}]
    assert group.reward_extra["step"] == [7] * 3
    assert group.reward_metrics["probe/columns"] == [2.0]  # the dataset columns solution and answer
    assert group.reward_metrics["probe/max_steps"] == [50.0]


def check_standard(group: RolloutGroup) -> None:
    overlong, repeated, probe, math_acc = (list(col) for col in zip(*group.rewards_per_func))
    assert overlong == [0.0, -0.5, -1.0]  # TRL's DAPO punishment, L=8, cache=4: 2 -> 0, 6 -> -2/4, 8 -> -4/4
    assert repeated == pytest.approx([0.0, -0.8, -4 / 7])  # 1 - distinct/total bigrams: 1 - 1/5; 1 - 3/7
    assert group.reward_extra["kind"] == ["str"] * 3
    assert math_acc == [1.0, 0.0, 0.0]


def test_trl_reward_functions_through_the_local_pool():
    with RewardPool(CONVERSATIONAL, num_workers=1, timeout_s=60) as pool:
        pool.set_trainer_state(global_step=7, max_steps=50)
        check_conversational(scored(pool, PROMPT))
    with RewardPool(STANDARD, num_workers=1, timeout_s=60) as pool:
        pool.set_trainer_state(global_step=7, max_steps=50)
        check_standard(scored(pool, "1/3 + 0?"))


def test_trl_reward_functions_through_the_reward_service(tmp_path):
    from tests.rewards.test_reward_server import start_server, stop_server

    for specs, prompt, check in (
        (CONVERSATIONAL, PROMPT, check_conversational),
        (STANDARD, "1/3 + 0?", check_standard),
    ):
        config = tmp_path / f"config-{len(specs)}-{check.__name__}.yaml"
        config.write_text(yaml.safe_dump({"reward_funcs": specs, "reward_timeout_s": 60.0, "reward_num_workers": 1}))
        proc, url = start_server(config, tmp_path / f"{check.__name__}.log")
        try:
            with RemoteRewardPool(url, 60.0, 1) as pool:
                pool.set_trainer_state(global_step=7, max_steps=50)
                check(scored(pool, prompt))
        finally:
            assert stop_server(proc) == 0


def test_the_overlong_builtin_is_bound_from_the_config():
    config = GRPOConfig(
        reward_funcs=["builtin:soft_overlong_penalty"],
        max_completion_length=8,
        overlong_buffer_len=4,
        overlong_penalty_factor=0.5,
    )
    with RewardPool.from_config(config) as pool:
        rows = pool.submit(["p"] * 3, TEXTS, IDS).result(timeout=60).rows
    assert [r[0] for r in rows] == [0.0, -0.25, -0.5]  # -(6 - 4) / 4 x 0.5, then the full factor at L
