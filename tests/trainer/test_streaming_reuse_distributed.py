"""The learner's three ways of receiving a step: streamed chunks, reused rollouts, and several ranks.

Each must give the update a single process computes on the whole batch (hand-checkable reference:
`GRPOLearner.step(TrainBatch)`, itself checked against TRL's loss in tests/algorithms).
"""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.distributed import DataParallelLearner, DistInfo, follow, shard
from async_grpo.trainer.trainer import GRPOLearner
from async_grpo.transports.messages import TrainBatch
from tests.forkserver import start_ranks

from .test_trainer import PAD, make_group

PROMPTS = [[72, 105, 58], [65, 66], [90, 91, 92, 93], [48, 49]]


def batch_of_four_groups(seed: int = 0) -> TrainBatch:
    """4 groups x 2 completions with ragged prompts/completions, nonzero advantages and off-policy sampling
    logprobs (so the IS weights differ from 1)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i, prompt in enumerate(PROMPTS):
        comps = [[int(t) for t in torch.randint(60, 120, (n,), generator=gen)] for n in (3 + i % 2, 2 + i)]
        logps = [[float(-0.5 - torch.rand(1, generator=gen)) for _ in c] for c in comps]
        groups.append(make_group(prompt, comps, [1.0 - 0.5 * i, -1.0 + 0.25 * i], logprobs=logps))
    return TrainBatch(groups=groups, metrics={"reward": 0.5})


def learner(model, micro_batch_size: int, fsdp: bool = False, **loss_kw) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1e9,
        micro_batch_size=micro_batch_size,
        loss=LossSettings(max_completion_length=8, **loss_kw),
        pad_token_id=PAD,
        fsdp=fsdp,
    )


def step_then_reuse(trainer, batch: TrainBatch) -> tuple[list[dict], list[list[torch.Tensor]]]:
    """Two steps on `batch`, the second on pi_old cached before it; (metrics, gradients) of each.
    `trainer` is a GRPOLearner or rank 0's DataParallelLearner."""
    metrics = [trainer.step(batch)]
    step_grads = [grads(trainer.model)]
    metrics.append(trainer.step(batch, old_logps=trainer.old_logps(batch)))
    step_grads.append(grads(trainer.model))
    return metrics, step_grads


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ streaming group scoring
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "cispo"])
def test_streamed_chunks_give_the_same_update_as_the_whole_batch(tiny_model, loss_type):
    """Chunks of 2 groups (= one 4-completion micro-batch each) streamed in: same loss, same gradients, same
    parameters after the step, although the loss normalizers were unknown until the last chunk."""
    other = copy.deepcopy(tiny_model)
    batch = batch_of_four_groups()
    kw = dict(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.2)  # cispo caps the ratio at it
    whole = learner(tiny_model, 4, **kw).step(copy.deepcopy(batch))
    b = copy.deepcopy(batch)
    chunks = [TrainBatch(b.groups[:2], {}, final=False), TrainBatch(b.groups[2:], dict(b.metrics), final=True)]
    streamed = learner(other, 4, **kw).step(iter(chunks))
    assert streamed["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    # every logged metric on the unstreamed scale (regression: dapo/cispo policy_loss was a raw token sum)
    assert streamed["policy_loss"] == pytest.approx(whole["policy_loss"], rel=1e-5, abs=1e-8)
    assert streamed["num_tokens"] == whole["num_tokens"]
    # the step leaves the normalized gradients in .grad; compare those, not the Adam update (which turns a
    # 1e-9 gradient into a +-lr step and so amplifies float rounding)
    for a, c in zip(grads(tiny_model), grads(other), strict=True):
        torch.testing.assert_close(c, a, atol=1e-6, rtol=1e-5)


def test_streamed_step_runs_each_chunk_before_the_next_arrives(tiny_model):
    """The trainer pulls chunk 2 only after chunk 1's forward/backward left gradients behind: that is the
    overlap with reward scoring that streaming exists for."""
    batch = batch_of_four_groups()
    seen: list[bool] = []

    def chunks():
        yield TrainBatch(batch.groups[:2], {}, final=False)
        seen.append(all(p.grad is not None for p in tiny_model.parameters() if p.requires_grad))
        yield TrainBatch(batch.groups[2:], {}, final=True)

    learner(tiny_model, 4).step(chunks())
    assert seen == [True]


# ------------------------------------------------------------------ rollout reuse (num_iterations / mini_epochs)
def test_first_reuse_step_equals_a_plain_step_and_later_ones_see_the_old_policy(tiny_model):
    """pi_old cached before the first update: the first step is the plain one (ratio 1); the second step's
    ratio pi_theta/pi_old moves away from 1, so PPO clipping can act (it never can without reuse)."""
    other = copy.deepcopy(tiny_model)
    batch = batch_of_four_groups()
    plain = learner(other, 4, epsilon=1e-4, epsilon_high=1e-4).step(copy.deepcopy(batch))
    reuse = learner(tiny_model, 4, epsilon=1e-4, epsilon_high=1e-4)
    old = reuse.old_logps(batch)
    assert len(old) == 2 and all(not t.requires_grad for t in old)
    first = reuse.step(batch, old_logps=old)
    assert first["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    for a, c in zip(grads(tiny_model), grads(other), strict=True):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)
    assert first["clip_ratio/region_mean"] == 0.0
    second = reuse.step(batch, old_logps=old)
    assert second["clip_ratio/region_mean"] > 0.0  # lr 1e-3 moved the policy beyond a 1e-4 trust region
    with pytest.raises(ValueError, match="old_logps has 1 micro-batches"):
        reuse.step(batch, old_logps=old[:1])


# ------------------------------------------------------------------ several ranks
def test_shard_gives_each_rank_a_contiguous_run_of_one_process_micro_batches():
    batch = _five_groups()  # 10 completions, 2 per group
    batch.metrics = {"m": 1.0}
    rows = lambda b: [(g.prompt_ids[0], len(g.completion_ids)) for g in b.groups]  # noqa: E731
    # micro-batches of 4: [g0 g1] [g2 g3] [g4] -> rank 0 the first two, rank 1 the last
    assert [len(shard(batch, r, 2, 4).groups) for r in range(2)] == [4, 1]
    # micro-batches of 3 cut group 1 and group 4 in half: rank 0 rows 0-5, rank 1 rows 6-9
    parts = [shard(batch, r, 2, 3) for r in range(2)]
    assert [sum(len(g.completion_ids) for g in p.groups) for p in parts] == [6, 4]
    assert rows(parts[0])[-1] == (PROMPTS[2][0], 2) and rows(parts[1])[0] == (PROMPTS[3][0], 2)
    split = shard(batch, 0, 4, 3)  # rows 0-2: group 0 and the first completion of group 1
    assert rows(split) == [(PROMPTS[0][0], 2), (PROMPTS[1][0], 1)]
    assert split.groups[1].advantages == batch.groups[1].advantages[:1]
    assert split.groups[1].loss_mask == batch.groups[1].loss_mask[:1]
    assert shard(batch, 1, 2, 4).metrics == {"m": 1.0}
    assert shard(batch, 3, 4, 4).groups == []  # 3 micro-batches, 4 ranks: the last one trains nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: the local shard of an FSDP DTensor, else the tensor itself."""
    return t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone()


def _rank_main(
    rank: int, world: int, port: int, model_path: str, loss_type: str, out_dir: str, fsdp: bool = False
) -> None:
    """One trainer rank: rank 0 drives two steps (the second with reused pi_old), rank 1 follows."""
    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.distributed import broadcast_parameters, close_distributed, init_distributed

    os.environ.update(
        {
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=120)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if rank == 1:  # different weights on purpose: rank 0's must win
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    broadcast_parameters(model)
    local = learner(model, 4, fsdp=fsdp, loss_type=loss_type, beta=0.05 if fsdp else 0.0)
    if fsdp:  # each rank keeps only its shards: save them, the test stitches them together
        batch = batch_of_four_groups()
        if rank == 0:
            dp = DataParallelLearner(local, info)
            # 5 groups: rank 0 trains 3 of them (2 micro-batches), rank 1 two (1 + a placeholder pass)
            batch.groups.append(copy.deepcopy(batch.groups[0]))
            dp.step(batch)
            dp.step(batch, old_logps=dp.old_logps(batch))
            state = dp.state_dict()["model"]  # the full (gathered) state: every rank joins
            dp.close()
        else:
            follow(local, DistInfo(rank=1, world_size=world))
            state = None
        torch.save(
            {"grads": [_local(p.grad) for p in model.parameters()], "state": state},
            os.path.join(out_dir, f"fsdp{rank}.pt"),
        )
        close_distributed()
        return
    if rank == 0:
        dp = DataParallelLearner(local, info)
        batch = batch_of_four_groups()
        metrics, step_grads = step_then_reuse(dp, batch)
        dp.forget(batch)
        dp.close()
        torch.save(
            {"metrics": metrics, "grads": step_grads, "params": [p.detach() for p in model.parameters()]},
            os.path.join(out_dir, "rank0.pt"),
        )
    else:
        steps = follow(local, DistInfo(rank=1, world_size=world))
        torch.save(
            {"steps": steps, "params": [p.detach() for p in model.parameters()]}, os.path.join(out_dir, "rank1.pt")
        )
    close_distributed()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_gloo_ranks_train_like_one_process_on_the_whole_batch(tiny_model_path, tiny_model, tmp_path, loss_type):
    """2 ranks x 1 micro-batch of 4 completions == 1 process x 2 micro-batches of 4 (TRL's DDP semantics:
    dapo divides by the global token count / num_processes, grpo averages per-rank means), two steps."""
    from transformers import AutoModelForCausalLM

    start_ranks(_rank_main, args=(2, _free_port(), str(tiny_model_path), loss_type, str(tmp_path)), nprocs=2)
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    assert rank1["steps"] == 2

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    single = learner(reference, 4, loss_type=loss_type)
    batch = batch_of_four_groups()
    expected, expected_grads = step_then_reuse(single, batch)
    for got, want in zip(rank0["metrics"], expected, strict=True):
        assert got["num_tokens"] == want["num_tokens"]  # global count, all ranks
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)  # merged over the ranks
    # first step: same weights, so the averaged gradient equals the single-process one to float rounding;
    # second step: Adam's first update amplifies rounding on near-zero gradients, hence the looser bound
    for step, atol in ((0, 1e-6), (1, 1e-5)):
        for a, c in zip(rank0["grads"][step], expected_grads[step], strict=True):
            torch.testing.assert_close(a, c, atol=atol, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(rank0["params"], tiny_model.parameters(), strict=True))
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # replicas stay bit-identical


# ------------------------------------------------------------------ sampling temperature and the fused loss
def test_logprobs_are_those_of_the_tempered_sampling_distribution(tiny_model):
    """TRL divides the logits by the sampling temperature; vLLM's processed logprobs are tempered too."""
    from async_grpo.trainer.packing import completion_logps, pack_batch

    mb = pack_batch(batch_of_four_groups(), PAD)
    with torch.no_grad():
        logits = tiny_model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
        ).logits[:, -mb.completion_ids.size(1) - 1 : -1]
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, mb.completion_ids.unsqueeze(-1)).squeeze(-1)
        for chunk in (None, 2):
            got, _ = completion_logps(tiny_model, mb, chunk_size=chunk, temperature=0.7)
            torch.testing.assert_close(got * mb.completion_mask, want * mb.completion_mask, atol=1e-5, rtol=1e-5)
        plain, _ = completion_logps(tiny_model, mb)
        assert not torch.allclose(plain * mb.completion_mask, want * mb.completion_mask, atol=1e-3)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_liger_fused_loss_gives_the_unfused_step(tiny_model, loss_type):
    """use_liger_kernel: the learner's fused path (OPSM + IS weights as liger's per-token weight, temperature)
    yields the unfused gradients, on-policy and with a cached pi_old."""
    pytest.importorskip("liger_kernel.chunked_loss")
    other = copy.deepcopy(tiny_model)
    batch = batch_of_four_groups()
    kw = dict(loss_type=loss_type, off_policy_mask_threshold=0.3, temperature=0.9)
    plain, fused = learner(tiny_model, 4, **kw), learner(other, 4, use_liger_kernel=True, **kw)
    for step in range(2):
        old = None if step == 0 else plain.old_logps(batch)
        old_fused = None if step == 0 else fused.old_logps(batch)
        a = plain.step(copy.deepcopy(batch), old_logps=old)
        b = fused.step(copy.deepcopy(batch), old_logps=old_fused)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        for x, y in zip(grads(tiny_model), grads(other), strict=True):
            torch.testing.assert_close(y, x, atol=1e-5 if step else 1e-6, rtol=1e-4)


def test_fsdp_ranks_shard_the_model_and_train_like_one_process(tiny_model_path, tmp_path):
    """fsdp=true on 2 gloo ranks with uneven shares (3 groups vs 2: the lighter rank runs a placeholder pass),
    KL against a sharded reference, two steps (the second on cached pi_old): the stitched gradient shards equal
    one process on the whole batch, and the gathered full state dict equals the single-process weights."""
    from transformers import AutoModelForCausalLM

    start_ranks(_rank_main, args=(2, _free_port(), str(tiny_model_path), "dapo", str(tmp_path), True), nprocs=2)
    ranks = [torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2)]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    single = learner(reference, 4, loss_type="dapo", beta=0.05)
    batch = batch_of_four_groups()
    batch.groups.append(copy.deepcopy(batch.groups[0]))
    # one process on all 10 rows; dapo divides by the global token count, so the micro-batch cut does not matter
    single.step(batch)
    single.step(batch, old_logps=single.old_logps(batch))
    for name_param, g0, g1 in zip(reference.named_parameters(), ranks[0]["grads"], ranks[1]["grads"], strict=True):
        name, param = name_param
        full = torch.cat([g0, g1]) if g0.shape != param.shape else g0
        assert full.shape == param.shape, name
        torch.testing.assert_close(full, param.grad, atol=1e-5, rtol=1e-4, msg=name)
    state = ranks[0]["state"]
    assert set(state) == set(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert not hasattr(state[name], "to_local")  # gathered, not a shard
        torch.testing.assert_close(state[name], tensor, atol=2e-3, rtol=0)  # Adam: |update| <= lr per step


def test_merge_rank_metrics_keeps_extremes_sums_counts_and_averages_the_rest():
    from async_grpo.trainer.distributed import merge_rank_metrics

    merged = merge_rank_metrics([
        {"loss": 1.0, "x/min": 0.5, "x/max": 2.0, "skipped_zero_adv_microbatches": 1.0, "grad_norm": 3.0, "kl": 0.2},
        {"loss": 3.0, "x/min": 0.1, "x/max": 1.0, "skipped_zero_adv_microbatches": 2.0, "grad_norm": 3.0},
    ])  # fmt: skip
    assert merged == {
        "loss": 2.0,
        "x/min": 0.1,
        "x/max": 2.0,
        "skipped_zero_adv_microbatches": 3.0,
        "grad_norm": 3.0,
        "kl": 0.2,
    }


# ------------------------------------------------------------------ unequal shares, every loss type
ALL_LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


def _loss_kw(loss_type: str) -> dict:
    return dict(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.2)


def _five_groups() -> TrainBatch:
    batch = batch_of_four_groups()
    batch.groups.append(copy.deepcopy(batch.groups[1]))  # 5 groups: rank 0 trains 3, rank 1 trains 2
    return batch


def _uneven_rank_main(rank: int, port: int, model_path: str, out_dir: str, fsdp: bool, micro: int) -> None:
    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.distributed import close_distributed, init_distributed

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
    for loss_type in ALL_LOSSES:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        local = learner(model, micro, fsdp=fsdp, **_loss_kw(loss_type))
        if rank == 0:
            dp = DataParallelLearner(local, info)
            out[loss_type] = dp.step(_five_groups())["loss"]
            dp.close()
        else:
            follow(local, DistInfo(rank=1, world_size=2))
        out[f"{loss_type}/grads"] = [_local(p.grad) for p in model.parameters()]
    torch.save(out, os.path.join(out_dir, f"uneven{'-fsdp' if fsdp else ''}{rank}.pt"))
    close_distributed()


@pytest.mark.parametrize(("fsdp", "micro"), [(False, 3), (True, 4)], ids=["replicas", "fsdp"])
def test_unequal_shares_train_like_one_process_for_every_loss_type(tiny_model_path, tmp_path, fsdp, micro):
    """Regression (shared/repros/fsdp_vs_ddp_grpo.py): 5 groups (10 completions) on 2 ranks. The ranks split one
    process's micro-batches (replicas, micro-batches of 3: 2 + 2, one group split across the ranks; FSDP, of 4:
    2 + 1 and a placeholder pass on rank 1), and the per-micro-batch losses (grpo, bnpo, dr_grpo, sapo) are
    divided by the micro-batches of all ranks / world size, not a rank's own count (34% off) nor with placeholders
    (27-45%). One process on the whole batch is the reference, for every loss type, to 1e-5."""
    from transformers import AutoModelForCausalLM

    start_ranks(_uneven_rank_main, args=(_free_port(), str(tiny_model_path), str(tmp_path), fsdp, micro), nprocs=2)
    tag = "-fsdp" if fsdp else ""
    ranks = [torch.load(tmp_path / f"uneven{tag}{r}.pt") for r in range(2)]
    for loss_type in ALL_LOSSES:
        reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        want = learner(reference, micro, **_loss_kw(loss_type)).step(_five_groups())
        assert ranks[0][loss_type] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), loss_type
        for (name, param), g0, g1 in zip(
            reference.named_parameters(), ranks[0][f"{loss_type}/grads"], ranks[1][f"{loss_type}/grads"], strict=True
        ):
            got = torch.cat([g0, g1]) if g0.shape != param.shape else g0  # FSDP: stitch the two shards
            torch.testing.assert_close(got, param.grad, atol=1e-5, rtol=1e-5, msg=f"{loss_type} {name}")
