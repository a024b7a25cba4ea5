"""LossSettings validation, and GRPOObjective's micro-batch composition against grpo_loss on hand-built inputs."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from async_grpo.algorithms import (
    LOSS_NORMALIZERS,
    GRPOObjective,
    LossInputs,
    LossSettings,
    MicroBatchInputs,
    grpo_loss,
    selective_log_softmax,
)

# ------------------------------------------------------------------------------------------------
# LossSettings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(importance_sampling_level="chunk"), "importance_sampling_level"),
        (dict(vllm_importance_sampling_mode="token_clip"), "vllm_importance_sampling_mode"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(beta=-0.01), "beta"),
        (dict(delta=1.0), "delta"),
        (dict(off_policy_mask_threshold=0.0), "off_policy_mask_threshold"),
        (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos"),
        (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg"),
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(vllm_importance_sampling_cap=0.0), "vllm_importance_sampling_cap"),
        (dict(vllm_importance_sampling_clip_min=3.0), "vllm_importance_sampling_clip_min"),  # == cap
        (dict(vllm_importance_sampling_clip_min=-0.1), "vllm_importance_sampling_clip_min"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
        (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
        (dict(temperature=0.0), "temperature"),
        (dict(loss_type="cispo", epsilon_high=0.2), "epsilon_high"),  # eps_max below 1 clamps every ratio
        (
            dict(loss_type="sapo", importance_sampling_level="sequence", use_liger_kernel=True),
            "importance_sampling_level",
        ),
    ],
)
def test_settings_refuse_bad_values_by_name(change, field):
    with pytest.raises(ValueError, match=rf"^{field}={change[field]!r} .*Fix: "):
        LossSettings(**change)


@pytest.mark.parametrize(
    "change",
    [
        {},
        dict(loss_type="cispo", epsilon_high=1.0, epsilon=0.0),
        dict(vllm_importance_sampling_clip_min=0.0, top_entropy_quantile=0.0, delta=1.01),
        dict(loss_type="sapo", importance_sampling_level="sequence"),  # sequence-level sapo is fine unfused
        dict(loss_type="dr_grpo", max_completion_length=1, temperature=0.01, off_policy_mask_threshold=1e-3),
    ],
)
def test_settings_accept_edge_values(change):
    assert dataclasses.asdict(LossSettings(**change)).items() >= change.items()


def test_settings_are_frozen():
    settings = LossSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.beta = 0.1
    with pytest.raises(ValueError, match="^beta="):  # replace() validates too
        dataclasses.replace(settings, beta=-1.0)


def test_objective_tells_the_trainer_which_forwards_to_run():
    plain = GRPOObjective(LossSettings(temperature=0.7))
    assert (plain.needs_reference, plain.wants_hidden_states, plain.temperature) == (False, False, 0.7)
    fused = GRPOObjective(LossSettings(beta=0.04, use_liger_kernel=True))
    assert (fused.needs_reference, fused.wants_hidden_states, fused.temperature) == (True, True, 1.0)


def test_objective_hands_the_trainer_its_normalizer_row():
    objective = GRPOObjective(LossSettings(loss_type="bnpo"))
    assert objective.normalizer is LOSS_NORMALIZERS["bnpo"] is objective.settings.normalizer


# ------------------------------------------------------------------------------------------------
# GRPOObjective.micro_batch_loss == grpo_loss with hand-built corrections
# ------------------------------------------------------------------------------------------------

B, T = 5, 6
LENGTHS = [6, 4, 1, 5, 3]
ADVANTAGES = [1.0, -0.8, 0.4, -1.2, -0.3]
REPLAYED = [False, True, False, True, False]
CAP, CLIP_MIN, OPSM, RHO = 1.5, 0.5, 0.3, 0.6


def make_inputs(seed: int = 0) -> dict:
    """One micro-batch with padding holding garbage; rows 1 and 3 are replayed with far-off sampling logps, row 4
    drifted."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()  # (B, T)
    logps = -torch.rand(B, T, generator=gen) * 3  # (B, T) in (-3, 0]
    sampling = logps + torch.randn(B, T, generator=gen) * 0.6
    sampling[1] -= 3.0  # replayed rows: a long-gone policy; row 3 (A < 0) would be OPSM-dropped without recompute
    sampling[3] += 2.0
    sampling[4] += 1.0  # fresh, A < 0, drifted: OPSM drops it
    pad = ~mask.bool()
    return dict(
        mask=mask,
        logps=logps,
        advantages=torch.tensor(ADVANTAGES),
        replayed=torch.tensor(REPLAYED),
        sampling=sampling.masked_fill(pad, float("nan")),
        old=(logps + torch.randn(B, T, generator=gen) * 0.3).masked_fill(pad, -1e4),
        ref=(logps + torch.randn(B, T, generator=gen) * 0.2).masked_fill(pad, 1e4),
        entropies=(torch.rand(B, T, generator=gen) * 4).masked_fill(pad, 9.0),
    )


def hand_corrections(x: dict, old: torch.Tensor, recompute: bool):
    """The trainer-side corrections written out from their formulas: (sampling logps, IS weights, OPSM keep,
    entropy mask)."""
    valid = x["mask"].bool()
    sampling = x["sampling"].clone()
    if recompute:  # replayed rows: pi_old is the sampler
        sampling[x["replayed"]] = old[x["replayed"]]
    rho = torch.exp(torch.where(valid, old - sampling, 0.0)).clamp(CLIP_MIN, CAP)  # token_truncate
    is_weights = torch.where(valid, rho, 0.0)
    drift = torch.where(valid, sampling - x["logps"], 0.0).sum(1) / x["mask"].sum(1)  # mean sampling - current
    keep = ((x["advantages"] >= 0) | (drift <= OPSM)).float()[:, None]  # DeepSeek-V3.2 eq. 9
    tau = torch.quantile(x["entropies"][valid], 1 - RHO)
    entropy_mask = (x["entropies"] >= tau) & valid
    return sampling, is_weights, keep, entropy_mask


def settings(**change) -> LossSettings:
    return LossSettings(
        **{
            **dict(
                loss_type="dapo",
                epsilon=0.2,
                epsilon_high=0.28,
                beta=0.05,
                off_policy_mask_threshold=OPSM,
                max_completion_length=T,
                vllm_importance_sampling_cap=CAP,
                vllm_importance_sampling_clip_min=CLIP_MIN,
                top_entropy_quantile=RHO,
            ),
            **change,
        }
    )


CASES = list(itertools.product(["dapo", "grpo", "bnpo", "dr_grpo"], [False, True], [True, False]))


@pytest.mark.parametrize("loss_type, cached_old, recompute", CASES)
def test_micro_batch_loss_equals_grpo_loss_on_hand_built_corrections(loss_type, cached_old, recompute):
    """Replayed rows' sampling logps, IS weights, OPSM and the entropy mask built by hand and handed to grpo_loss
    (OPSM folded into the IS weights: a 0/1 factor commutes exactly) give the objective's loss, gradient and
    metrics."""
    x = make_inputs()
    objective = GRPOObjective(settings(loss_type=loss_type, replay_recompute_logps=recompute))
    norm = dict(num_items_in_batch=3 * x["mask"].sum(), gradient_accumulation_steps=3, num_processes=2)
    ours_leaf, ref_leaf = x["logps"].clone().requires_grad_(True), x["logps"].clone().requires_grad_(True)
    result = objective.micro_batch_loss(
        MicroBatchInputs(
            ours_leaf,
            x["entropies"],
            x["mask"],
            x["advantages"],
            x["sampling"],
            replayed=x["replayed"],
            old_logps=x["old"] if cached_old else None,
            ref_logps=x["ref"],
        ),
        **norm,
    )

    old = x["old"] if cached_old else x["logps"]
    sampling, is_weights, keep, entropy_mask = hand_corrections(x, old, recompute)
    assert 0 < keep.sum() < B and 0 < entropy_mask.sum() < x["mask"].sum()  # both corrections act
    expected = grpo_loss(
        ref_leaf,
        LossInputs(
            mask=x["mask"],
            advantages=x["advantages"],
            old_logps=old,
            ref_logps=x["ref"],
            is_weights=is_weights * keep,
            sampling_logps=sampling,
            entropy_mask=entropy_mask,
            **norm,
        ),
        dataclasses.replace(objective.settings, off_policy_mask_threshold=None),
    )
    result.output.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(result.output.loss, expected.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_leaf.grad, ref_leaf.grad, rtol=1e-6, atol=1e-7)
    assert ours_leaf.grad.abs().sum() > 0

    valid = x["mask"].bool()
    tokens = x["mask"].sum()
    rho = is_weights[valid]
    hand_metrics = {
        "sampling/importance_sampling_ratio/mean": rho.mean(),
        "sampling/importance_sampling_ratio/min": rho.min(),
        "sampling/importance_sampling_ratio/max": rho.max(),
        **{k: v for k, v in expected.metrics.items()},
        "opsm/masked_fraction": ((1 - keep) * x["mask"]).sum() / tokens,
        "entropy": (x["entropies"] * x["mask"]).sum() / tokens,
        "entropy_mask/kept_fraction": entropy_mask.sum() / tokens,
    }
    for key, value in hand_metrics.items():
        assert result.metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    assert list(result.metrics) == [  # the trainer's logging order
        *(f"sampling/importance_sampling_ratio/{k}" for k in ("mean", "min", "max", "masked_frac")),
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        *expected.metrics,
        "opsm/masked_fraction",
        "entropy",
        "entropy_mask/kept_fraction",
    ]
    assert result.weight == float(tokens)


def test_replay_recompute_gives_replayed_rows_weight_one():
    x = make_inputs()
    inputs = MicroBatchInputs(
        x["logps"],
        x["entropies"],
        x["mask"],
        x["advantages"],
        x["sampling"],
        replayed=torch.ones(B, dtype=torch.bool),
        ref_logps=x["ref"],
    )
    metrics = GRPOObjective(settings()).micro_batch_loss(inputs, num_items_in_batch=x["mask"].sum()).metrics
    assert metrics["sampling/importance_sampling_ratio/min"] == metrics["sampling/importance_sampling_ratio/max"] == 1
    assert metrics["opsm/masked_fraction"] == 0.0  # no drift once the sampler is pi_old


def test_switched_off_corrections_leave_no_metrics():
    x = make_inputs()
    objective = GRPOObjective(
        settings(
            vllm_importance_sampling_correction=False,
            top_entropy_quantile=1.0,
            off_policy_mask_threshold=None,
            beta=0.0,
        )
    )
    leaf = x["logps"].clone().requires_grad_(True)
    result = objective.micro_batch_loss(
        MicroBatchInputs(leaf, x["entropies"], x["mask"], x["advantages"], x["sampling"]),
        num_items_in_batch=x["mask"].sum(),
    )
    expected = grpo_loss(
        x["logps"],
        LossInputs(mask=x["mask"], advantages=x["advantages"], num_items_in_batch=x["mask"].sum()),
        objective.settings,
    )
    assert list(result.metrics) == [*expected.metrics, "entropy"]
    torch.testing.assert_close(result.output.loss, expected.loss, rtol=0, atol=0)


def test_missing_inputs_are_refused():
    x = make_inputs()
    inputs = MicroBatchInputs(x["logps"], x["entropies"], x["mask"], x["advantages"], x["sampling"])
    with pytest.raises(ValueError, match="ref_logps"):  # beta > 0
        GRPOObjective(settings()).micro_batch_loss(inputs, num_items_in_batch=1)
    with pytest.raises(ValueError, match="hidden, lm_head and completion_ids"):
        GRPOObjective(settings(beta=0.0, use_liger_kernel=True)).micro_batch_loss(inputs, num_items_in_batch=1)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fused_path_matches_the_plain_path(loss_type):
    """use_liger_kernel: hidden states + LM head through the fused loss give the plain path's loss, gradients
    (hidden and head) and metrics."""
    pytest.importorskip("liger_kernel.chunked_loss", exc_type=ImportError)
    x = make_inputs(seed=1)
    gen = torch.Generator().manual_seed(2)
    hidden_size, vocab = 8, 24
    base_hidden = torch.randn(B, T, hidden_size, generator=gen)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=gen) * 0.5)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    results = []
    for fused in (False, True):
        objective = GRPOObjective(settings(loss_type=loss_type, temperature=0.8, use_liger_kernel=fused))
        hidden, lm_head = base_hidden.clone().requires_grad_(True), torch.nn.Linear(hidden_size, vocab, bias=False)
        lm_head.load_state_dict(head.state_dict())
        logps = selective_log_softmax(lm_head(hidden) / 0.8, ids)
        extra = dict(hidden=hidden, lm_head=lm_head, completion_ids=ids) if fused else {}
        result = objective.micro_batch_loss(
            MicroBatchInputs(
                logps.detach() if fused else logps,
                x["entropies"],
                x["mask"],
                x["advantages"],
                x["sampling"],
                replayed=x["replayed"],
                old_logps=x["old"],
                ref_logps=x["ref"],
                **extra,
            ),
            num_items_in_batch=x["mask"].sum(),
            gradient_accumulation_steps=2,
        )
        result.output.loss.backward()
        results.append((result, hidden.grad, lm_head.weight.grad))
    (plain, plain_h, plain_w), (fused, fused_h, fused_w) = results
    torch.testing.assert_close(fused.output.loss, plain.output.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(fused_h, plain_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(fused_w, plain_w, rtol=0, atol=1e-6)
    assert list(fused.metrics) == list(plain.metrics)
    for key, value in plain.metrics.items():
        assert fused.metrics[key] == pytest.approx(value, abs=1e-6), key
