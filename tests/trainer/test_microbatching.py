"""Token-budget micro-batches (`trainer.microbatching`): where the cuts fall (padded and flattened cost, a single
sequence over the budget), and that a step's loss and gradients do not depend on the cut (grpo, sapo, dr_grpo, dapo,
cispo; bnpo where the cut is the fixed one), streamed or not, padded or flattened."""

from __future__ import annotations

import copy

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.flattening import FlattenedBatch, completion_logps
from async_grpo.trainer.microbatching import MicroBatching, trim
from async_grpo.trainer.packing import pack_batch
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch

from .test_flattening import assert_same_step, completion_real, learner
from .test_trainer import PAD, make_group


def lengths_batch(prompt_lens, comp_lens) -> TrainBatch:
    """Group i holds rows 2i and 2i + 1: a prompt of prompt_lens[i] tokens, completions of comp_lens[2i : 2i + 2]."""
    groups = []
    for i in range(0, len(comp_lens), 2):
        prompt = list(range(1, 1 + prompt_lens[i // 2]))
        comps = [list(range(40, 40 + n)) for n in comp_lens[i : i + 2]]
        groups.append(make_group(prompt, comps, [1.0, -1.0][: len(comps)]))
    return TrainBatch(groups=groups)


def spans(batching: MicroBatching, batch: TrainBatch) -> list[int]:
    return [len(mb) for mb in batching.cut(pack_batch(batch, PAD))]


def test_padded_budget_counts_rows_times_the_longest_row():
    # prompts 2 | 2 | 6, completions 2, 2 | 2, 10 | 2, 2: row lengths 4, 4, 4, 12, 8, 8
    batch = lengths_batch([2, 2, 6], [2, 2, 2, 10, 2, 2])
    cut = MicroBatching(8, max_tokens_per_microbatch=16)
    # by length: 4, 4, 4, 8, 8, 12. 3 x 4 = 12 (+ an 8: 4 x 8 > 16); 2 x 8 = 16; the 12-token row alone
    assert spans(cut, batch) == [3, 2, 1]
    mbs = list(cut.cut(pack_batch(batch, PAD)))
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(3, 4), (2, 8), (1, 12)]  # trimmed to their own rows
    assert cut.oversized == 0


def test_flattened_budget_counts_real_tokens_and_a_long_sequence_stands_alone():
    batch = lengths_batch([2, 2, 6], [2, 2, 2, 10, 2, 2])  # row lengths 4, 4, 4, 12, 8, 8
    cut = MicroBatching(8, max_tokens_per_microbatch=11, batch_flattening=True)
    mbs = list(cut.cut(pack_batch(batch, PAD)))
    assert all(isinstance(mb, FlattenedBatch) for mb in mbs)
    assert [len(mb) for mb in mbs] == [2, 1, 1, 1, 1]  # by length: 4+4; 4 (+8 > 11); 8; 8; 12 alone (over budget)
    assert [mb.layout.input_ids.size(1) for mb in mbs] == [8, 4, 8, 8, 12]
    assert cut.oversized == 1
    got = torch.cat([mb.advantages for mb in mbs])  # nothing dropped or repeated
    assert sorted(got.tolist()) == sorted(pack_batch(batch, PAD).advantages.tolist())


def test_without_a_budget_micro_batches_are_fixed_size_and_untrimmed():
    batch = lengths_batch([2, 2, 6], [2, 2, 2, 10, 2, 2])
    mbs = list(MicroBatching(4).cut(pack_batch(batch, PAD)))
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(4, 16), (2, 16)]


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        MicroBatching(4, max_tokens_per_microbatch=0)


def test_trimmed_micro_batch_has_the_same_logprobs(tiny_model):
    packed = pack_batch(lengths_batch([2, 5], [3, 1, 2, 12]), PAD)
    mb = packed.slice(0, 2)  # short rows, padded to the long ones' width
    small = trim(mb)
    assert small.input_ids.shape == (2, 5) and small.completion_ids.shape == (2, 3)
    want, _ = completion_logps(tiny_model, mb)
    got, _ = completion_logps(tiny_model, small)
    real = completion_real(small)
    torch.testing.assert_close(got[real], want[:, :3][real], atol=1e-5, rtol=0)


def ragged_eight() -> TrainBatch:
    """4 groups x 2, completions of 1 to 20 tokens, prompts of 1 to 4, varied advantages and sampling logprobs."""
    comps = [[3, 20], [1, 7], [12, 2], [5, 16]]
    groups = []
    for i, lens in enumerate(comps):
        c = [[(50 + 7 * i + 3 * j) % 200 + 10 for j in range(n)] for n in lens]
        g = make_group(list(range(1, 2 + i)), c, [1.0 - 0.6 * i, -0.7 + 0.5 * i])
        g.sampling_logprobs = [[-0.4 - 0.02 * j for j in range(n)] for n in lens]
        groups.append(g)
    groups[0].loss_mask[1] = [1] * 8 + [0] * 6 + [1] * 6  # a tool answer inside a completion
    return TrainBatch(groups=groups)


CUT_FREE = ["grpo", "sapo", "dr_grpo", "dapo", "cispo"]


@pytest.mark.parametrize("flattening", [False, True], ids=["padded", "flat"])
@pytest.mark.parametrize("loss_type", CUT_FREE)
def test_token_budget_step_equals_fixed_micro_batches(tiny_model, loss_type, flattening):
    """Fixed: 2 micro-batches of 4 completions. Budget: cuts of 1 to 5 completions (some over budget); the loss
    and the gradients are the same since each micro-batch weighs by its share of the completions."""
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.2, beta=0.05)
    fixed = learner(tiny_model, flattening=False, micro=4, **kw)
    budget = learner(other, flattening=flattening, micro=4, max_tokens=20, **kw)
    want = fixed.step(ragged_eight())
    got = budget.step(ragged_eight())
    sizes = [len(mb) for mb in budget._micro_batches([ragged_eight()])]
    assert sizes != [4, 4] and sum(sizes) == 8  # really another cut
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)
    assert got["oversized_microbatch_sequences"] > 0


def test_bnpo_with_a_budget_that_cuts_like_fixed_gives_the_fixed_step(tiny_model):
    other = copy.deepcopy(tiny_model)
    fixed = learner(tiny_model, flattening=False, micro=4, loss_type="bnpo")
    budget = learner(other, flattening=True, micro=4, max_tokens=10_000, loss_type="bnpo")
    want = fixed.step(TrainBatch(groups=ragged_eight().groups[:2]))
    got = budget.step(TrainBatch(groups=ragged_eight().groups[:2]))
    assert [len(mb) for mb in budget._micro_batches([TrainBatch(groups=ragged_eight().groups[:2])])] == [4]
    assert_same_step(tiny_model, want, other, got)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_streamed_token_budget_step_equals_the_whole_fixed_step(tiny_model, loss_type):
    other = copy.deepcopy(tiny_model)
    fixed = learner(tiny_model, flattening=False, micro=4, loss_type=loss_type)
    budget = learner(other, flattening=True, micro=4, max_tokens=20, loss_type=loss_type)
    want = fixed.step(ragged_eight())
    groups = ragged_eight().groups
    got = budget.step(iter([TrainBatch(groups=groups[:1]), TrainBatch(groups=groups[1:])]))
    assert_same_step(tiny_model, want, other, got)


def test_old_logps_follow_the_token_budget_cut(tiny_model):
    budget = learner(tiny_model, flattening=True, micro=4, max_tokens=20, loss_type="grpo")
    old = budget.old_logps(ragged_eight())
    cuts = list(budget._micro_batches([ragged_eight()]))
    assert [o.shape for o in old] == [mb.completion_ids.shape for mb in cuts]
    metrics = budget.step(ragged_eight(), old_logps=old)
    assert metrics["loss"] != 0.0


def test_group_by_length_orders_fixed_micro_batches_by_length_and_trims_them():
    batch = lengths_batch([2, 2, 6], [2, 2, 2, 10, 2, 2])  # row lengths 4, 4, 4, 12, 8, 8; advantages +1, -1
    mbs = list(MicroBatching(2, group_by_length=True).cut(pack_batch(batch, PAD)))
    # by length 4, 4 | 4, 8 | 8, 12, each trimmed to its longest prompt + longest completion (the last: 6 + 10)
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(2, 4), (2, 8), (2, 16)]
    assert sum(mb.input_ids.numel() for mb in mbs) == 56  # row order, untrimmed: 6 x 16 = 96 positions


def test_group_by_length_puts_zero_advantage_completions_first():
    batch = lengths_batch([2, 2, 2], [5, 1, 3, 2, 4, 6])
    batch.groups[1].advantages = [0.0, 0.0]  # rows 2 and 3: completions of 3 and 2 tokens
    mbs = list(MicroBatching(2, group_by_length=True).cut(pack_batch(batch, PAD)))
    assert mbs[0].advantages.tolist() == [0.0, 0.0]  # a whole micro-batch skip_zero_advantage_batches can skip
    assert [int(mb.completion_mask.sum()) for mb in mbs] == [2 + 3, 1 + 4, 5 + 6]  # then by length


@pytest.mark.parametrize("loss_type", CUT_FREE)
def test_group_by_length_step_equals_the_row_order_step(tiny_model, loss_type):
    """Same completions per micro-batch, other companions: the loss and gradients are those of TRL's row order."""
    other = copy.deepcopy(tiny_model)
    kw = dict(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.2, beta=0.05)
    rows = learner(tiny_model, flattening=False, micro=4, **kw)
    by_length = learner(other, flattening=False, micro=4, **kw)
    by_length.batching = MicroBatching(4, group_by_length=True)
    want, got = rows.step(ragged_eight()), by_length.step(ragged_eight())
    firsts = [mb.advantages.tolist() for mb in by_length._micro_batches([ragged_eight()])]
    assert firsts != [mb.advantages.tolist() for mb in rows._micro_batches([ragged_eight()])]  # really regrouped
    assert want["loss"] != 0.0
    assert_same_step(tiny_model, want, other, got)


def test_bnpo_keeps_the_row_order():
    model = torch.nn.Linear(2, 2)
    model.config = None
    lrn = GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=2,
        loss=LossSettings(loss_type="bnpo"),
        pad_token_id=PAD,
        group_by_length=True,
    )
    assert lrn.batching.group_by_length is False
    lrn = GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=2,
        loss=LossSettings(loss_type="dapo"),
        pad_token_id=PAD,
        group_by_length=True,
    )
    assert lrn.batching.group_by_length is True


# ------------------------------------------------------------------ several ranks
def _budget_rank_main(rank: int, port: int, model_path: str, out_dir: str, fsdp: bool) -> None:
    import os

    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.distributed import (
        DataParallelLearner,
        DistInfo,
        close_distributed,
        follow,
        init_distributed,
    )

    os.environ.update(
        {
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=120)
    out = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        local = GRPOLearner(
            model,
            learning_rate=1e-3,
            weight_decay=0.0,
            max_grad_norm=1e9,
            micro_batch_size=2,
            loss=LossSettings(max_completion_length=32, loss_type=loss_type),
            pad_token_id=PAD,
            fsdp=fsdp,
            batch_flattening=True,
            max_tokens_per_microbatch=20,
        )
        if rank == 0:
            dp = DataParallelLearner(local, info)
            out[loss_type] = dp.step(ragged_ten())["loss"]
            dp.close()
        else:
            follow(local, DistInfo(rank=1, world_size=2))
        out[f"{loss_type}/grads"] = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()
        ]
        out[f"{loss_type}/micro"] = sum(1 for _ in local.batching.cut(pack_batch(local_share(rank), PAD)))
    torch.save(out, os.path.join(out_dir, f"budget{rank}.pt"))
    close_distributed()


def ragged_ten() -> TrainBatch:
    """5 groups (10 completions): rank 0 trains 3 of the 5 fixed micro-batches of 2, rank 1 two."""
    batch = ragged_eight()
    batch.groups.append(copy.deepcopy(batch.groups[0]))
    return batch


def local_share(rank: int) -> TrainBatch:
    from async_grpo.trainer.distributed import shard

    return shard(ragged_ten(), rank, 2, 2)


def test_two_fsdp_ranks_with_a_token_budget_train_like_one_process_with_fixed_micro_batches(tiny_model_path, tmp_path):
    """Each rank cuts its share by tokens (4 and 3 micro-batches: FSDP pads rank 1 with a placeholder pass); the
    averaged gradient equals one process's on fixed micro-batches of 2 (equal sizes), for grpo, dr_grpo, dapo.
    (Replicas share the weighting and skip the placeholders; FSDP is the stricter case.) About 20 s: 2 spawns."""
    import socket

    from transformers import AutoModelForCausalLM

    from tests.forkserver import start_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_budget_rank_main, args=(port, str(tiny_model_path), str(tmp_path), True), nprocs=2)
    ranks = [torch.load(tmp_path / f"budget{r}.pt") for r in range(2)]
    assert (ranks[0]["grpo/micro"], ranks[1]["grpo/micro"]) == (4, 3)  # unequal micro-batch counts
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        single = GRPOLearner(
            reference,
            learning_rate=1e-3,
            weight_decay=0.0,
            max_grad_norm=1e9,
            micro_batch_size=2,
            loss=LossSettings(max_completion_length=32, loss_type=loss_type),
            pad_token_id=PAD,
        )
        want = single.step(ragged_ten())
        assert ranks[0][loss_type] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), loss_type
        for (name, param), g0, g1 in zip(
            reference.named_parameters(), ranks[0][f"{loss_type}/grads"], ranks[1][f"{loss_type}/grads"], strict=True
        ):
            got = torch.cat([g0, g1]) if g0.shape != param.shape else g0  # FSDP: stitch the two shards
            torch.testing.assert_close(got, param.grad, atol=1e-5, rtol=1e-5, msg=f"{loss_type} {name}")


def test_a_budget_below_every_sequence_warns_once_and_counts_each(caplog):
    """Issue 28: a budget below one sequence logged one warning per sequence per step (hundreds a step)."""
    batch = lengths_batch([2, 2, 6], [2, 2, 2, 10, 2, 2])  # six rows, every one longer than 3 tokens
    cut = MicroBatching(8, max_tokens_per_microbatch=3)
    with caplog.at_level("WARNING", logger="async_grpo.trainer.microbatching"):
        for _ in range(2):  # two steps
            assert [len(mb) for mb in cut.cut(pack_batch(batch, PAD))] == [1] * 6
    assert cut.oversized == 12
    assert len([r for r in caplog.records if "max_tokens_per_microbatch" in r.getMessage()]) == 1


def test_a_group_split_across_ranks_keeps_every_per_completion_field_aligned():
    """`shard` cuts a group between two ranks: each share's rollout stats, reward extras, spans and teacher logprobs
    (top-k included) are the rows it trains (a multi-turn or traced group used to raise in `RolloutGroup`'s check)."""
    from async_grpo.trainer.distributed import shard
    from async_grpo.transports.messages import EpisodeSpan

    grp = make_group([1, 2], [[10], [11, 12], [13], [14, 15]], [1.0, -1.0, 0.5, -0.5])
    grp.rollout_stats = {"tools/calls": [0.0, 1.0, 2.0, 3.0]}
    grp.reward_extra = {"judge": ["a", "b", "c", "d"]}
    grp.spans = [[EpisodeSpan("generation", "LLM", 0, 1)] for _ in range(4)]
    grp.teacher_logprobs = [[-float(i)] * len(c) for i, c in enumerate(grp.completion_ids)]
    grp.teacher_topk_ids = [[[i, 0]] * len(c) for i, c in enumerate(grp.completion_ids)]
    grp.teacher_topk_logprobs = [[[-0.1, -2.0]] * len(c) for c in grp.completion_ids]
    grp.check_teacher_logprobs()
    shares = [shard(TrainBatch(groups=[grp]), rank, 2, 1).groups[0] for rank in (0, 1)]
    assert [s.completion_ids for s in shares] == [[[10], [11, 12]], [[13], [14, 15]]]
    assert [s.rollout_stats["tools/calls"] for s in shares] == [[0.0, 1.0], [2.0, 3.0]]
    assert [s.reward_extra["judge"] for s in shares] == [["a", "b"], ["c", "d"]]
    assert [len(s.spans) for s in shares] == [2, 2]
    assert shares[1].teacher_logprobs == [[-2.0], [-3.0, -3.0]]
    assert shares[1].teacher_topk_ids == [[[2, 0]], [[3, 0], [3, 0]]]
