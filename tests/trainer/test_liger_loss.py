"""`fused_grpo_loss` (liger-kernel's fused linear GRPO loss) against `grpo_loss` on the full logits.

Loss values and gradients with respect to the hidden states and the LM head (weight and bias) must agree
for every option combination liger can express; the rest must be refused by name. liger-kernel 0.8.5's
GRPO loss is plain torch (its Triton kernels are not involved), so these run on CPU when it is installed
and skip when it is not; `test_cuda_compiled_matches_grpo_loss` repeats a few cases on a GPU with liger's
`torch.compile` on.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys

import pytest
import torch

from async_grpo.algorithms import (
    LossInputs,
    LossSettings,
    detached_completion_logps,
    fused_grpo_loss,
    grpo_loss,
    off_policy_mask,
    selective_log_softmax,
)

N, T, H, V = 5, 7, 16, 48
LENGTHS = [7, 3, 5, 1, 6]  # ragged completions (right padding), one of a single token
ADVANTAGES = [1.0, -1.0, -0.5, 0.7, -0.2]
SAMPLER_DRIFT = [0.0, 1.0, 0.1, 1.0, 0.0]  # per-row mean(sampling - logp): row 1 (A < 0) exceeds OPSM's 0.5
OPSM_THRESHOLD = 0.5
TOL = 1e-6  # absolute, on the loss and on every gradient entry (gradients here are O(1e-2))

GRPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo")
LOSS_CASES = [
    (loss_type, level)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
    for level in ("token", "sequence")
    if not (level == "sequence" and loss_type in ("cispo", "sapo"))  # not in liger 0.8.5: see test below
]
KL_CASES = [(0.0, False), (0.1, False), (0.1, True)]  # (beta, use_bias_correction_kl)


@pytest.fixture(scope="module")
def liger():
    # any ImportError (absent, or present but unusable, e.g. a broken triton): skip rather than error
    return pytest.importorskip("liger_kernel.chunked_loss", exc_type=ImportError)


def make_inputs(device: str = "cpu", *, bias: bool, seed: int = 0) -> dict:
    """Hidden states, an LM head and the per-token tensors of one micro-batch; garbage at padding."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=gen)
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(V, generator=gen) * 0.1)
    ids = torch.randint(0, V, (N, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    pad = ~mask.bool()
    with torch.no_grad():
        logps = selective_log_softmax(head(hidden).float(), ids)
    noise = torch.randn(N, T, generator=gen)
    old = (logps + 0.3 * noise).masked_fill(pad, -1e4)  # ratios beyond both clip bounds; exp(1e4) = inf at padding
    ref = (logps + 0.2 * torch.randn(N, T, generator=gen)).masked_fill(pad, 1e4)
    sampling = (logps + torch.tensor(SAMPLER_DRIFT)[:, None]).masked_fill(pad, float("nan"))
    is_weights = (0.5 + 1.5 * torch.rand(N, T, generator=gen)).masked_fill(pad, float("inf"))
    entropy_mask = torch.rand(N, T, generator=gen) < 0.7
    out = dict(
        hidden=hidden,
        head=head,
        ids=ids,
        mask=mask,
        adv=torch.tensor(ADVANTAGES),
        old=old,
        ref=ref,
        sampling=sampling,
        is_weights=is_weights,
        entropy_mask=entropy_mask,
    )
    return {k: v.to(device) for k, v in out.items()}


SETTING_NAMES = {f.name for f in dataclasses.fields(LossSettings)}


def options(loss_type: str, level: str, beta: float, bias_corr: bool, extras: bool, inputs: dict) -> dict:
    """The options shared by grpo_loss and fused_grpo_loss, flat: LossSettings fields and per-call keywords
    (`split` separates them)."""
    opts = dict(
        loss_type=loss_type, epsilon=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        importance_sampling_level=level, beta=beta, use_bias_correction_kl=bias_corr,
        ref_logps=inputs["ref"] if beta else None, max_completion_length=T + 2,
        num_items_in_batch=inputs["mask"].sum() * 3, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    )  # fmt: skip
    if extras:
        seq = level == "sequence"
        opts.update(
            is_weights=inputs["is_weights"][:, :1].clone() if seq else inputs["is_weights"],
            off_policy_mask_threshold=OPSM_THRESHOLD, sampling_logps=inputs["sampling"],
            entropy_mask=inputs["entropy_mask"], delta=1.5 if loss_type in GRPO_FAMILY else None,
            gradient_accumulation_steps=3, num_processes=2,
        )  # fmt: skip
    return opts


def split(opts: dict) -> tuple[LossSettings, dict]:
    """(LossSettings from the option entries of `opts`, the remaining per-call keywords)."""
    settings = LossSettings(**{k: v for k, v in opts.items() if k in SETTING_NAMES})
    return settings, {k: v for k, v in opts.items() if k not in SETTING_NAMES}


def reference_and_fused(inputs: dict, opts: dict, old: bool, chunk_size: int | None, compiled: bool = False):
    """(loss, metrics, grads) of grpo_loss on full logits and of fused_grpo_loss, from identical leaves."""
    settings, call = split(opts)
    results = []
    for fused in (False, True):
        hidden = inputs["hidden"].clone().requires_grad_(True)
        head = torch.nn.Linear(H, V, bias=inputs["head"].bias is not None).to(hidden.device)
        head.load_state_dict(inputs["head"].state_dict())
        old_logps = inputs["old"] if old else None
        if fused:
            out = fused_grpo_loss(
                hidden,
                head,
                inputs["ids"],
                LossInputs(mask=inputs["mask"], advantages=inputs["adv"], old_logps=old_logps, **call),
                settings,
                chunk_size=chunk_size,
                compiled=compiled,
            )
        else:
            logps = selective_log_softmax(head(hidden).float() / settings.temperature, inputs["ids"])
            out = grpo_loss(
                logps, LossInputs(mask=inputs["mask"], advantages=inputs["adv"], old_logps=old_logps, **call), settings
            )
        out.loss.backward()
        grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
        results.append((out.loss.detach(), out.metrics, grads))
    return results


def assert_same(results, tol: float = TOL) -> None:
    (ref_loss, ref_metrics, ref_grads), (loss, metrics, grads) = results
    assert torch.isfinite(ref_loss) and all(torch.isfinite(g).all() for g in ref_grads)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=tol)
    for name, g, ref_g in zip(("hidden", "lm_head.weight", "lm_head.bias"), grads, ref_grads):
        torch.testing.assert_close(g, ref_g, rtol=0, atol=tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=tol), key


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "off-policy"])
@pytest.mark.parametrize(("beta", "bias_corr"), KL_CASES, ids=["no-kl", "kl", "kl-bias-corr"])
@pytest.mark.parametrize(("loss_type", "level"), LOSS_CASES, ids=[f"{lt}-{lv}" for lt, lv in LOSS_CASES])
def test_fused_matches_grpo_loss(liger, loss_type, level, beta, bias_corr, extras):
    """plain: on-policy (old=None), one liger chunk per row. off-policy: stale old logps (both clip bounds
    hit), IS weights, OPSM dropping a sequence, entropy mask, delta, grad accumulation and 2 ranks, an LM
    head bias, 2-row liger chunks; inf / NaN / huge values at padding everywhere."""
    inputs = make_inputs(bias=extras)
    opts = options(loss_type, level, beta, bias_corr, extras, inputs)
    results = reference_and_fused(inputs, opts, old=extras, chunk_size=2 if extras else 1)
    assert_same(results)
    if extras:  # the off-policy features really act in this case
        with torch.no_grad():
            logps = detached_completion_logps(inputs["hidden"], inputs["head"], inputs["ids"])
        keep = off_policy_mask(inputs["adv"], logps, inputs["sampling"], inputs["mask"], OPSM_THRESHOLD)
        assert keep.flatten().tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
        if loss_type in GRPO_FAMILY and level == "token":
            assert results[0][1]["clip_ratio/low_mean"] > 0 and results[0][1]["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 64, None])  # None: the whole micro-batch (the default)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_liger_chunking_does_not_change_the_result(liger, loss_type, chunk_size):
    inputs = make_inputs(bias=False, seed=1)
    opts = options(loss_type, "token", 0.1, True, True, inputs)
    assert_same(reference_and_fused(inputs, opts, old=True, chunk_size=chunk_size))


def test_temperature_scales_the_logits(liger):
    inputs = make_inputs(bias=True, seed=2)
    opts = {**options("dapo", "token", 0.1, False, True, inputs), "temperature": 0.7}
    assert_same(reference_and_fused(inputs, opts, old=True, chunk_size=2))


def test_current_logps_are_used_when_given(liger):
    """With current_logps given, OPSM reads them: logps shifted by -2 nats make every A < 0 row drift."""
    inputs = make_inputs(bias=False)
    settings, call = split(options("dapo", "token", 0.0, False, True, inputs))
    with torch.no_grad():
        logps = detached_completion_logps(inputs["hidden"], inputs["head"], inputs["ids"])
    loss_inputs = LossInputs(mask=inputs["mask"], advantages=inputs["adv"], old_logps=inputs["old"], **call)
    args = (inputs["hidden"], inputs["head"], inputs["ids"], loss_inputs, settings)
    base = fused_grpo_loss(*args).loss
    same = fused_grpo_loss(*args, current_logps=logps).loss
    shifted = fused_grpo_loss(*args, current_logps=logps - 2.0).loss
    torch.testing.assert_close(same, base, rtol=0, atol=TOL)
    assert abs(shifted.item() - base.item()) > 1e-3


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_sequence_level_cispo_and_sapo_are_refused(loss_type):
    inputs = make_inputs(bias=False)
    settings, call = split(options(loss_type, "sequence", 0.0, False, False, inputs))
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'.*Fix"):
        fused_grpo_loss(
            inputs["hidden"],
            inputs["head"],
            inputs["ids"],
            LossInputs(mask=inputs["mask"], advantages=inputs["adv"], **call),
            settings,
        )
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'.*Fix"):  # and as a setting
        dataclasses.replace(settings, use_liger_kernel=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss_type": "luspo"}, "loss_type='luspo'"),
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"delta": 0.0}, "delta=0.0"),
        ({"num_items_in_batch": None}, "num_items_in_batch"),  # grpo_loss's own validation
        ({"beta": 0.1}, "ref_logps"),
    ],
)
def test_bad_options_are_refused_by_name(change, match):
    """Bad settings are refused when LossSettings is built, bad per-call arguments by fused_grpo_loss."""
    inputs = make_inputs(bias=False)
    opts = {**options("dapo", "token", 0.0, False, False, inputs), **change}
    with pytest.raises(ValueError, match=match):
        settings, call = split(opts)
        chunk_size = call.pop("chunk_size", 1)
        loss_inputs = LossInputs(mask=inputs["mask"], advantages=inputs["adv"], **call)
        fused_grpo_loss(inputs["hidden"], inputs["head"], inputs["ids"], loss_inputs, settings, chunk_size=chunk_size)


def test_a_kl_ratio_other_than_the_policy_ratio_is_refused(liger):
    """liger corrects the KL by the policy ratio only: a LossInputs.kl_ratio_logps is refused by name."""
    inputs = make_inputs(bias=False)
    settings, call = split(options("dapo", "token", 0.1, True, False, inputs))
    loss_inputs = LossInputs(mask=inputs["mask"], advantages=inputs["adv"], kl_ratio_logps=inputs["sampling"], **call)
    with pytest.raises(ValueError, match="kl_ratio_logps.*Fix"):
        fused_grpo_loss(inputs["hidden"], inputs["head"], inputs["ids"], loss_inputs, settings)


def test_hidden_must_be_n_t_h():
    inputs = make_inputs(bias=False)
    settings, call = split(options("dapo", "token", 0.0, False, False, inputs))
    with pytest.raises(ValueError, match=r"hidden \(5, 16\) must be \(N, T, H\)"):
        fused_grpo_loss(
            inputs["hidden"][:, 0],
            inputs["head"],
            inputs["ids"],
            LossInputs(mask=inputs["mask"], advantages=inputs["adv"], **call),
            settings,
        )


def test_missing_liger_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", None)
    inputs = make_inputs(bias=False)
    settings, call = split(options("dapo", "token", 0.0, False, False, inputs))
    with pytest.raises(ImportError, match=r"pip install 'liger-kernel==0\.8\.5'.*gpu"):
        fused_grpo_loss(
            inputs["hidden"],
            inputs["head"],
            inputs["ids"],
            LossInputs(mask=inputs["mask"], advantages=inputs["adv"], **call),
            settings,
        )


GPU_CASES = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], [False, True]))


@pytest.mark.gpu
@pytest.mark.parametrize(("loss_type", "extras"), GPU_CASES)
def test_cuda_compiled_matches_grpo_loss(liger, loss_type, extras):
    """On CUDA with liger's torch.compile'd loss math (float32, no TF32): same results as on CPU."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        inputs = make_inputs("cuda", bias=extras)
        opts = options(loss_type, "token", 0.1 if extras else 0.0, extras, extras, inputs)
        assert_same(reference_and_fused(inputs, opts, old=extras, chunk_size=2, compiled=True), tol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_model_wiring_matches_the_unfused_trainer_path(liger, tiny_model):
    """The trainer's wiring: decoder hidden states + the model's LM head through fused_grpo_loss give the loss
    and parameter gradients of grpo_loss on completion_logps (tiny Qwen2, a packed batch with padding)."""
    from async_grpo.trainer.logprobs import completion_hidden_states
    from async_grpo.trainer.packing import completion_logps, pack_batch

    from .test_trainer import PAD, mixed_batch

    mb = pack_batch(mixed_batch(), PAD)
    models = [tiny_model, copy.deepcopy(tiny_model)]
    with torch.no_grad():
        current, _ = completion_logps(tiny_model, mb)
    gen = torch.Generator().manual_seed(0)
    old = current + 0.3 * torch.randn(current.shape, generator=gen)
    sampling = current + torch.tensor([0.0, 0.0, 0.0, 1.0])[:, None]  # row 3 (A = -0.5) drifts: OPSM drops it
    settings = LossSettings(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, off_policy_mask_threshold=0.5)
    opts = dict(
        num_items_in_batch=mb.completion_mask.sum(), sampling_logps=sampling, is_weights=mb.completion_mask * 1.3
    )
    losses = []
    for fused, model in zip((False, True), models):
        if fused:
            hidden = completion_hidden_states(
                model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.completion_ids.size(1)
            )
            out = fused_grpo_loss(
                hidden,
                model.get_output_embeddings(),
                mb.completion_ids,
                LossInputs(mask=mb.completion_mask, advantages=mb.advantages, old_logps=old, **opts),
                settings,
            )
        else:
            logps, _ = completion_logps(model, mb)
            out = grpo_loss(
                logps, LossInputs(mask=mb.completion_mask, advantages=mb.advantages, old_logps=old, **opts), settings
            )
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=TOL)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=TOL, msg=name)
    assert models[0].lm_head.weight.grad.abs().max() > 1e-3  # a real gradient was compared
    assert off_policy_mask(mb.advantages, current, sampling, mb.completion_mask, 0.5).flatten().tolist() == [1, 1, 1, 0]
