"""Training on the model's tokens only, with groups made by the multi-turn rollout: a tool-output token gets exactly
zero gradient from every term (policy loss, KL, IS weight, OPSM, entropy mask, each normalizer), and with no tool
called the step is exactly the single-turn rollout's step."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.algorithms.objective import GRPOObjective, MicroBatchInputs
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import SamplingSettings, SingleTurnRollout
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.executor import ToolExecutor
from async_grpo.tools.loading import load_tools
from async_grpo.trainer.packing import completion_logps, pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch
from tests.orchestrator.test_tool_rollout import ExactScorer, Scripted, calculator_agent, item

PAD = 256
SETTINGS = [
    LossSettings(
        loss_type="dapo",
        beta=0.05,
        off_policy_mask_threshold=0.01,
        top_entropy_quantile=0.5,
        vllm_importance_sampling_mode="token_truncate",
    ),
    LossSettings(
        loss_type="grpo", beta=0.05, vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_cap=50.0
    ),
    LossSettings(loss_type="bnpo", importance_sampling_level="sequence", off_policy_mask_threshold=0.01),
    LossSettings(
        loss_type="dr_grpo",
        max_completion_length=200,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_cap=50.0,
    ),
    LossSettings(loss_type="cispo", epsilon_high=5.0),
    LossSettings(loss_type="sapo", off_policy_clip="behaviour"),
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tool_group(tok):
    """One group of 2: sample 0 calls the calculator (tool tokens in the middle), sample 1 answers at once."""
    with ToolExecutor(load_tools(["builtin:calculator"]), num_workers=1) as ex:
        group = asyncio.run(
            EnvironmentRollout.for_tools(ExactScorer(), tok, ex)(
                Scripted(tok, calculator_agent), item("12*34"), SamplingSettings(2, 200, 1.0), version=lambda: 0
            )
        )
    group.advantages = [1.0, -1.0]
    assert 0 in group.loss_mask[0]
    return group


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.loss_type)
def test_tool_tokens_get_exactly_zero_gradient(tiny_model, tool_group, settings):
    packed = pack_batch(TrainBatch(groups=[tool_group]), PAD)
    assert packed.completion_mask[0, : len(tool_group.loss_mask[0])].tolist() == tool_group.loss_mask[0]
    logps, entropies = completion_logps(tiny_model, packed, with_entropy=True)
    logps.retain_grad()
    out = GRPOObjective(settings).micro_batch_loss(
        MicroBatchInputs(
            logps=logps,
            entropies=entropies,
            mask=packed.completion_mask,
            advantages=packed.advantages,
            sampling_logps=packed.sampling_logps,
            old_logps=logps.detach() + 0.05,
            ref_logps=logps.detach() - 0.3,
        ),
        num_items_in_batch=packed.completion_mask.sum(),
    )
    out.output.loss.backward()
    masked = packed.completion_mask == 0  # tool output and padding
    assert torch.count_nonzero(logps.grad[masked]) == 0  # exactly zero, not small
    assert torch.count_nonzero(logps.grad[~masked]) > 0


def test_without_a_tool_call_the_step_is_the_single_turn_step(tiny_model, tok):
    answer = lambda prompt, call, sample: ["1", "22", "333", "4444"][sample]  # noqa: E731
    sampling = SamplingSettings(4, 200, 1.0)
    with ToolExecutor(load_tools(["builtin:calculator"]), num_workers=1) as ex:
        multi = asyncio.run(
            EnvironmentRollout.for_tools(ExactScorer(), tok, ex)(
                Scripted(tok, answer), item(), sampling, version=lambda: 0
            )
        )
    it = item()
    it.prompt_ids = multi.prompt_ids
    single = asyncio.run(
        SingleTurnRollout(ExactScorer(), tok.decode)(Scripted(tok, answer), it, sampling, version=lambda: 0)
    )
    results = []
    for group in (multi, single):
        group.advantages = [1.5, -0.5, 0.5, -1.5]
        model = copy.deepcopy(tiny_model)
        learner = GRPOLearner(
            model,
            learning_rate=1e-2,
            weight_decay=0.0,
            max_grad_norm=1e9,
            micro_batch_size=4,
            loss=LossSettings(loss_type="dapo", beta=0.04),
            pad_token_id=PAD,
        )
        metrics = learner.step(TrainBatch(groups=[group]))
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (m_multi, p_multi), (m_single, p_single) = results
    assert m_multi == m_single
    assert all(torch.equal(a, b) for a, b in zip(p_multi, p_single, strict=True))
