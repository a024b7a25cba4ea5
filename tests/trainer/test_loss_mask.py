"""The per-token loss mask (`RolloutGroup.loss_mask`): a masked token (0; tool output later) gets exactly zero
gradient from every term (policy loss, KL, IS weight, OPSM, entropy mask), counts in no normalizer, and what vLLM
reported for it changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.algorithms.objective import GRPOObjective, MicroBatchInputs
from async_grpo.trainer.packing import completion_logps, pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import RolloutGroup, TrainBatch

PAD = 256


def masked_batch(sampling_at_masked: float = -0.4) -> TrainBatch:
    """Two groups; in each, the first completion has its middle tokens masked."""

    def grp(prompt, comps, adv):
        masks = [[1] + [0] * (len(comps[0]) - 2) + [1]] + [[1] * len(c) for c in comps[1:]]
        logps = [[sampling_at_masked if m == 0 else -0.7 for m in mask] for mask in masks]
        return RolloutGroup(
            prompt_ids=prompt,
            completion_ids=comps,
            sampling_logprobs=logps,
            truncated=[False] * len(comps),
            completions=[""] * len(comps),
            prompt="p",
            columns={},
            policy_version=0,
            advantages=adv,
            loss_mask=masks,
        )

    return TrainBatch(
        groups=[
            grp([1, 2, 3], [[10, 11, 12, 13], [14, 15]], [1.0, -1.0]),
            grp([4, 5], [[20, 21, 22], [23]], [-0.5, 0.5]),
        ]
    )


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
    LossSettings(loss_type="bnpo", importance_sampling_level="sequence"),
    LossSettings(loss_type="dr_grpo", max_completion_length=4),
    LossSettings(loss_type="cispo", epsilon_high=5.0),
    LossSettings(loss_type="sapo"),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.loss_type)
def test_masked_tokens_get_exactly_zero_gradient(tiny_model, settings):
    packed = pack_batch(masked_batch(), PAD)
    assert packed.completion_mask[0].tolist() == [1, 0, 0, 1]
    logps, entropies = completion_logps(tiny_model, packed, with_entropy=True)
    logps.retain_grad()
    ref = (logps.detach() - 0.3).clone()
    out = GRPOObjective(settings).micro_batch_loss(
        MicroBatchInputs(
            logps=logps,
            entropies=entropies,
            mask=packed.completion_mask,
            advantages=packed.advantages,
            sampling_logps=packed.sampling_logps,
            old_logps=logps.detach() + 0.05,
            ref_logps=ref,
        ),
        num_items_in_batch=packed.completion_mask.sum(),
    )
    out.output.loss.backward()
    masked = packed.completion_mask == 0
    assert torch.count_nonzero(logps.grad[masked]) == 0  # exactly zero, not small
    assert torch.count_nonzero(logps.grad[~masked]) > 0


def test_what_vllm_reported_for_masked_tokens_changes_nothing(tiny_model):
    """Two batches that differ only in the sampling logprobs at masked positions train identically."""
    settings = LossSettings(loss_type="dapo", beta=0.0, off_policy_mask_threshold=0.01)
    grads, metrics = [], []
    for sampling in (-0.4, -9.0):
        model = copy.deepcopy(tiny_model)
        learner = GRPOLearner(
            model,
            learning_rate=1e-3,
            weight_decay=0.0,
            max_grad_norm=1e9,
            micro_batch_size=4,
            loss=settings,
            pad_token_id=PAD,
        )
        metrics.append(learner.step(masked_batch(sampling)))
        grads.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert metrics[0] == metrics[1]
    assert metrics[0]["num_tokens"] == 2 + 2 + 2 + 1  # 7 trained tokens of the 10 sampled
