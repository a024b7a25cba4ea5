"""Shared-prompt forward passes (`trainer.prefix_sharing`, `share_prompt_prefix`): the layout (which rows share a
prompt), parity with the padded path for the per-token logprobs, entropies, hidden states, the loss and the
gradients (float32, tiny model; prompts of different lengths, ragged completions, tool-output loss masks, a KL
reference and reused pi_old), and the refusals (gradient checkpointing, sliding-window caches, flattening)."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.flattening import completion_hidden_states, completion_logps
from async_grpo.trainer.microbatching import MicroBatching
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.prefix_sharing import SharedPromptBatch, check_model, prompt_order, share_prompts
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_flattening import assert_same_step, completion_real
from .test_flattening import learner as padded_learner
from .test_trainer import PAD, make_group


def grouped_batch() -> TrainBatch:
    """Three groups (prompts of 5, 2 and 5 tokens; the first and last differ only in their last token) of 3, 2 and 3
    completions of 1 to 14 tokens; a tool-output span masked out of one completion; off-policy sampling logprobs."""
    groups = [
        make_group([1, 2, 3, 4, 5], [[10, 11], list(range(30, 44)), [12]], [1.0, -0.5, -0.5]),
        make_group([6, 7], [[20, 21, 22], [23]], [0.5, -0.5]),
        make_group([1, 2, 3, 4, 9], [[40, 41, 42, 43], [44, 45], [46, 47, 48, 49, 50, 51]], [-1.0, 0.25, 0.75]),
    ]
    groups[0].loss_mask[1] = [1] * 4 + [0] * 6 + [1] * 4
    for g in groups:
        g.sampling_logprobs = [[-0.4 + 0.02 * j for j in range(len(c))] for c in g.completion_ids]
    return TrainBatch(groups=groups)


def test_rows_of_a_prompt_share_one_prompt_row():
    packed = pack_batch(grouped_batch(), PAD)
    shared = share_prompts(packed)
    assert isinstance(shared, SharedPromptBatch)
    sh = shared.sharing
    assert sh.prompt_ids.shape == (3, 5)  # three distinct prompts, left-padded to the longest
    owner = sh.owner.tolist()
    assert owner[:3] == [owner[0]] * 3 and owner[3:5] == [owner[3]] * 2 and owner[5:] == [owner[5]] * 3
    assert len({owner[0], owner[3], owner[5]}) == 3
    for row, u in enumerate(owner):  # each row's prompt is its own, padding and mask included
        assert torch.equal(sh.prompt_ids[u], packed.input_ids[row, :5])
        assert torch.equal(sh.prompt_mask[u], packed.attention_mask[row, :5])
        assert torch.equal(sh.prompt_positions[u], packed.position_ids[row, :5])
    with pytest.raises(TypeError, match="cut the PackedBatch first"):
        shared.slice(0, 1)


def test_a_micro_batch_without_a_repeated_prompt_stays_padded():
    packed = pack_batch(TrainBatch(groups=[make_group([1, 2], [[10]], [1.0]), make_group([3], [[11]], [1.0])]), PAD)
    assert share_prompts(packed) is packed


def test_a_leading_real_pad_token_is_another_prompt():
    # [PAD, 5] with PAD as a real token and [5] left-padded to [PAD, 5] have the same ids but different masks
    packed = pack_batch(
        TrainBatch(groups=[make_group([PAD, 5], [[10], [11]], [1.0, -1.0]), make_group([5], [[12]], [1.0])]), PAD
    )
    shared = share_prompts(packed)
    assert isinstance(shared, SharedPromptBatch)
    assert (
        shared.sharing.prompt_ids.size(0) == 2 and shared.sharing.owner.tolist()[0] != shared.sharing.owner.tolist()[2]
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logprobs_and_entropies_match_the_padded_path(tiny_model, attn, chunk_size):
    tiny_model.set_attn_implementation(attn)
    packed = pack_batch(grouped_batch(), PAD)
    want, want_ent = completion_logps(tiny_model, packed, with_entropy=True, chunk_size=chunk_size)
    got, got_ent = completion_logps(tiny_model, share_prompts(packed), with_entropy=True, chunk_size=chunk_size)
    real = completion_real(packed)
    assert got.shape == want.shape == packed.completion_ids.shape
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent[real], want_ent[real], atol=1e-5, rtol=0)
    assert (want[real] - want[real].mean()).abs().max() > 1e-3  # not a constant: the comparison can fail


def test_the_completions_really_attend_to_the_shared_prompt(tiny_model):
    """Giving every row the first distinct prompt's keys changes the other rows' logprobs: the parity above holds
    because each row continues its own prompt."""
    packed = pack_batch(grouped_batch(), PAD)
    shared = share_prompts(packed)
    want, _ = completion_logps(tiny_model, shared)
    wrong = copy.copy(shared)
    wrong.sharing = copy.copy(shared.sharing)
    wrong.sharing.owner = torch.zeros_like(shared.sharing.owner)
    got, _ = completion_logps(tiny_model, wrong)
    real = completion_real(packed)
    others = shared.sharing.owner != 0
    assert (got[others][real[others]] - want[others][real[others]]).abs().max() > 1e-3


def test_one_token_completions_need_only_the_prompt_pass(tiny_model):
    batch = TrainBatch(
        groups=[make_group([1, 2, 3], [[10], [11], [12]], [1.0, 0.0, -1.0]), make_group([4], [[13], [14]], [1.0, -1.0])]
    )
    packed = pack_batch(batch, PAD)
    want, _ = completion_logps(tiny_model, packed)
    got, _ = completion_logps(tiny_model, share_prompts(packed))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_hidden_states_for_the_fused_loss_match_the_padded_path(tiny_model):
    packed = pack_batch(grouped_batch(), PAD)
    real = completion_real(packed)
    want = completion_hidden_states(tiny_model, packed)
    got = completion_hidden_states(tiny_model, share_prompts(packed))
    assert got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def learner(model, *, share: bool, micro: int = 4, **loss_kw) -> GRPOLearner:
    """`test_flattening.learner` (optimizer step a no-op: the gradients stay for comparison), padded, ordered
    (`group_by_length`), with or without shared prompts."""
    return padded_learner(
        model, flattening=False, micro=micro, group_by_length=True, share_prompt_prefix=share, **loss_kw
    )


@pytest.mark.parametrize("micro", [4, 8])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_a_shared_prompt_step_has_the_padded_loss_and_gradients(tiny_model, loss_type, micro):
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type=loss_type, beta=0.05, vllm_importance_sampling_mode="token_truncate")
    padded = learner(tiny_model, share=False, micro=micro, **kw)
    shared = learner(other, share=True, micro=micro, **kw)
    micro_batches = list(shared._micro_batches([grouped_batch()]))
    assert any(isinstance(mb, SharedPromptBatch) for mb in micro_batches)
    # a reuse step: pi_old differs from the current policy (each learner's own micro-batches: the cuts differ)
    old_padded = [o - 0.02 for o in padded.old_logps(grouped_batch())]
    old_shared = [o - 0.02 for o in shared.old_logps(grouped_batch())]
    want = padded.step(grouped_batch(), old_logps=old_padded)
    got = shared.step(grouped_batch(), old_logps=old_shared)
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-5)


def test_a_shared_prompt_step_with_the_fused_liger_loss_has_the_padded_step(tiny_model):
    pytest.importorskip("liger_kernel.chunked_loss")
    other = copy.deepcopy(tiny_model)
    want = learner(tiny_model, share=False, loss_type="dapo", use_liger_kernel=True).step(grouped_batch())
    got = learner(other, share=True, loss_type="dapo", use_liger_kernel=True).step(grouped_batch())
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)


def test_the_order_keeps_a_prompts_completions_together():
    packed = pack_batch(grouped_batch(), PAD)
    owner = share_prompts(packed).sharing.owner
    order = prompt_order(packed).tolist()
    runs = [owner[i].item() for i in order]
    assert sorted(order) == list(range(len(packed)))
    assert sum(a != b for a, b in zip(runs, runs[1:], strict=False)) == 2  # three prompts, three runs
    # zero advantages first, so that a micro-batch of them can still be skipped whole
    packed.advantages[4] = 0.0
    assert prompt_order(packed).tolist()[0] == 4
    # cut into micro-batches of 3: contiguous runs of 3 prompts over 3 micro-batches need at most 3 + 2 prompt rows
    cuts = list(MicroBatching(3, group_by_length=True, share_prompt_prefix=True).cut(pack_batch(grouped_batch(), PAD)))
    assert [len(mb) for mb in cuts] == [3, 3, 2]
    distinct = [mb.sharing.prompt_ids.size(0) if isinstance(mb, SharedPromptBatch) else len(mb) for mb in cuts]
    assert sum(distinct) <= 5, distinct


def test_refusals_name_the_fix(tiny_model):
    with pytest.raises(ValueError, match="batch_flattening"):
        MicroBatching(4, batch_flattening=True, share_prompt_prefix=True)
    tiny_model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing=false"):
        learner(tiny_model, share=True)


def test_a_sliding_window_model_is_refused_before_training():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer.*share_prompt_prefix=false"):
        check_model(Qwen2ForCausalLM(config))


def test_the_config_refuses_combinations_it_cannot_run():
    from async_grpo.config import GRPOConfig

    with pytest.raises(ValueError, match="share_prompt_prefix cannot combine with gradient_checkpointing"):
        GRPOConfig.model_validate(
            {"model_name_or_path": "builtin:tiny", "share_prompt_prefix": True, "gradient_checkpointing": True}
        )
    assert GRPOConfig.model_validate({"model_name_or_path": "builtin:tiny", "share_prompt_prefix": True})


def test_a_lora_step_with_a_kl_reference_has_the_padded_step(tiny_model):
    """use_peft: the adapters' gradients and the KL against the base model (adapters off, `_AdaptersOff`) are the
    padded path's."""
    from async_grpo.trainer.peft import PeftLearner, wrap_with_lora

    def lora(model, share: bool) -> PeftLearner:
        wrapped = wrap_with_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])
        out = PeftLearner(
            wrapped, learning_rate=1e-2, weight_decay=0.0, max_grad_norm=1e9, micro_batch_size=4,
            loss=LossSettings(max_completion_length=32, beta=0.1), pad_token_id=PAD, group_by_length=True,
            share_prompt_prefix=share,
        )  # fmt: skip
        return out

    other = copy.deepcopy(tiny_model)  # before wrapping: peft wraps in place
    padded, shared = lora(tiny_model, False), lora(other, True)
    torch.manual_seed(0)
    for (name, a), b in zip(padded.model.named_parameters(), shared.model.parameters(), strict=True):
        with torch.no_grad():
            if "lora_B" in name:  # B = 0 at the start: nonzero adapters, so that the KL against the base is nonzero
                a.normal_(0.0, 0.05)
            b.copy_(a)  # lora_A too: each wrap draws its own
    for learner in (padded, shared):
        learner.optimizer.step = lambda *a, **k: None
    want, got = padded.step(grouped_batch()), shared.step(grouped_batch())
    assert want["kl"] > 0.0 and want["loss"] != 0.0
    assert got["kl"] == pytest.approx(want["kl"], rel=1e-4)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    trained = [(n, p) for n, p in padded.model.named_parameters() if p.requires_grad]
    others = [p for p in shared.model.parameters() if p.requires_grad]
    assert len(trained) == len(others) > 0
    for (name, a), b in zip(trained, others, strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------ share_prompt_prefix: auto
def long_prompt_batch() -> TrainBatch:
    """Two groups of 4 completions of 1-3 tokens after 12-token prompts: sharing covers far fewer positions."""
    return TrainBatch(groups=[
        make_group(list(range(1, 13)), [[20], [21, 22], [23, 24, 25], [26]], [1.0, -1.0, 0.5, -0.5]),
        make_group(list(range(30, 42)), [[43, 44], [45], [46, 47, 48], [49]], [0.5, -0.5, 1.0, -1.0]),
    ])  # fmt: skip


def long_completion_batch() -> TrainBatch:
    """Two groups of 2 completions of 3-20 tokens after 2-token prompts: sharing would save under 10 %."""
    return TrainBatch(groups=[
        make_group([1, 2], [list(range(10, 30)), [31, 32, 33]], [1.0, -1.0]),
        make_group([3, 4], [list(range(40, 58)), [60, 61, 62, 63]], [0.5, -0.5]),
    ])  # fmt: skip


def positions(micro_batches) -> int:
    """Model positions of the micro-batches as the trainer runs them (distinct prompts once when shared)."""
    return sum(
        mb.sharing.prompt_ids.numel() + mb.completion_ids.numel() if isinstance(mb, SharedPromptBatch)
        else mb.input_ids.numel()
        for mb in micro_batches
    )  # fmt: skip


@pytest.mark.parametrize("micro", [2, 4, 8])
@pytest.mark.parametrize("budget", [None, 40])
def test_auto_shares_exactly_when_it_saves_positions(micro, budget):
    for batch, expect_shared in ((long_prompt_batch, True), (long_completion_batch, False)):
        cuts = {}
        for mode in (False, True, "auto"):
            batching = MicroBatching(micro, budget, group_by_length=True, share_prompt_prefix=mode)
            cuts[mode] = (batching, list(batching.cut(pack_batch(batch(), PAD))))
        padded, shared = positions(cuts[False][1]), positions(cuts[True][1])
        auto_batching, auto = cuts["auto"]
        # auto's plan estimates what the cut then runs, and picks the layout with fewer positions
        assert auto_batching.plan(pack_batch(batch(), PAD)).positions == positions(auto)
        assert positions(auto) == (shared if shared <= 0.9 * padded else padded)
        assert (positions(auto) < padded) == expect_shared
        assert auto_batching.shared_microbatches == sum(isinstance(mb, SharedPromptBatch) for mb in auto)
        assert sum(map(len, auto)) == (8 if batch is long_prompt_batch else 4)  # every completion, once


def test_auto_plans_the_rows_by_length_when_it_does_not_share():
    packed = pack_batch(long_completion_batch(), PAD)
    plan = MicroBatching(2, group_by_length=True, share_prompt_prefix="auto").plan(packed)
    assert not plan.shared
    lengths = plan.packed.attention_mask.sum(1).tolist()
    assert lengths == sorted(lengths)  # `by_length`: no prompt-ordered padding paid for nothing


def test_an_auto_step_has_the_padded_loss_and_gradients_and_counts_its_shared_micro_batches(tiny_model):
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type="dapo", beta=0.05)
    want = learner(tiny_model, share=False, **kw).step(long_prompt_batch())
    auto = learner(other, share="auto", **kw)
    got = auto.step(long_prompt_batch())
    assert auto.batching.share_prompt_prefix == "auto"
    assert got["shared_prompt_microbatches"] == 2.0 and want["shared_prompt_microbatches"] == 0.0
    assert_same_step(tiny_model, want, other, got)


def test_auto_falls_back_to_padding_where_sharing_cannot_run(tiny_model, caplog):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    flat = padded_learner(copy.deepcopy(tiny_model), flattening=True, micro=4, share_prompt_prefix="auto")
    assert flat.batching.share_prompt_prefix is False
    sliding = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    ))  # fmt: skip
    with caplog.at_level("INFO", logger="async_grpo.trainer.trainer"):
        assert learner(sliding, share="auto").batching.share_prompt_prefix is False
        tiny_model.gradient_checkpointing_enable()
        checkpointed = learner(tiny_model, share="auto")
    assert checkpointed.batching.share_prompt_prefix is False
    assert "DynamicSlidingWindowLayer" in caplog.text and "gradient_checkpointing=false" in caplog.text
    got = checkpointed.step(long_prompt_batch())  # trains, padded
    assert got["shared_prompt_microbatches"] == 0.0 and got["loss"] != 0.0


def test_the_config_defaults_to_auto_and_allows_it_beside_every_layout():
    from async_grpo.config import GRPOConfig

    assert GRPOConfig.model_validate({"model_name_or_path": "builtin:tiny"}).compute.share_prompt_prefix == "auto"
    for other in ("gradient_checkpointing", "batch_flattening"):
        cfg = GRPOConfig.model_validate({"model_name_or_path": "builtin:tiny", other: True})
        assert cfg.compute.share_prompt_prefix == "auto"
    with pytest.raises(ValueError, match="share_prompt_prefix"):
        GRPOConfig.model_validate({"model_name_or_path": "builtin:tiny", "share_prompt_prefix": "sometimes"})
