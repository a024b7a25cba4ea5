"""Resume across trainer world sizes (issue 28, item 3): the learner state a 2-rank FSDP run checkpoints (the full
state, gathered with `torch.distributed.checkpoint`) resumes at 2 ranks and at 1 rank, and a 1-rank state resumes
at 2 FSDP ranks, each with the next step an uninterrupted run takes: the same loss and the same weights after it
(AdamW's moments and step count came along), to float32 tolerance."""

from __future__ import annotations

import copy
import os

import torch

from tests.forkserver import start_ranks

from .test_streaming_reuse_distributed import _free_port, batch_of_four_groups, learner


def _two_ranks(rank: int, port: int, model_path: str, out_dir: str, loads: list[str], save: str | None) -> None:
    """2 gloo ranks with fsdp. With `save`: step on batch 1, save the learner state there, step on batch 2 and save
    that step's loss and weights as `next.pt`. Then for each state in `loads`: load it, step on batch 2, save the
    same as `next-<i>.pt`."""
    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.distributed import (
        DataParallelLearner,
        DistInfo,
        close_distributed,
        follow,
        init_distributed,
    )

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=120)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    local = learner(model, 4, fsdp=True, loss_type="dapo")
    if rank == 1:
        follow(local, DistInfo(rank=1, world_size=2))
        close_distributed()
        return
    dp = DataParallelLearner(local, info)

    def next_step(name: str) -> None:
        metrics = dp.step(copy.deepcopy(batch_of_four_groups(seed=2)))
        torch.save({"loss": metrics["loss"], "model": dp.state_dict()["model"]}, os.path.join(out_dir, name))

    if save is not None:
        dp.step(copy.deepcopy(batch_of_four_groups(seed=1)))
        torch.save(dp.state_dict(), save)
        next_step("next.pt")
    for i, load in enumerate(loads):
        dp.load_state_dict(torch.load(load, weights_only=True))
        next_step(f"next-{i}.pt")
    dp.close()
    close_distributed()


def _run_two_ranks(model_path, out_dir, loads=(), save=None) -> list[dict]:
    """The results of `_two_ranks`: the uninterrupted next step (with `save`), then one per state in `loads`."""
    start_ranks(
        _two_ranks,
        args=(_free_port(), str(model_path), str(out_dir), [str(x) for x in loads], save and str(save)),
        nprocs=2,
    )
    names = (["next.pt"] if save else []) + [f"next-{i}.pt" for i in range(len(loads))]
    return [torch.load(out_dir / name, weights_only=True) for name in names]


def _one_rank(model_path, state: dict | None, save=None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    single = learner(model, 4, loss_type="dapo")
    if state is not None:
        single.load_state_dict(state)
    if save is not None:
        single.step(copy.deepcopy(batch_of_four_groups(seed=1)))
        torch.save(single.state_dict(), save)
    metrics = single.step(copy.deepcopy(batch_of_four_groups(seed=2)))
    return {"loss": metrics["loss"], "model": single.state_dict()["model"]}


def _same(a: dict, b: dict) -> None:
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])
    assert set(a["model"]) == set(b["model"])
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=1e-5, rtol=1e-5, msg=name)


def test_states_resume_across_one_and_two_fsdp_ranks(tiny_model_path, tmp_path):
    """Two torchrun-style launches in all (each costs a few seconds of start-up): the first is the uninterrupted
    2-rank run that saves its state; the second loads that state, then a 1-rank state, each followed by the next
    step. The 2-rank state is also loaded by one process."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    fsdp_state, single_state = tmp_path / "fsdp2.pt", tmp_path / "single.pt"
    (uninterrupted_2,) = _run_two_ranks(tiny_model_path, tmp_path / "a", save=fsdp_state)
    uninterrupted_1 = _one_rank(tiny_model_path, None, save=single_state)
    from_2_at_2, from_1_at_2 = _run_two_ranks(tiny_model_path, tmp_path / "b", loads=[fsdp_state, single_state])
    _same(uninterrupted_2, from_2_at_2)  # same world size
    _same(uninterrupted_2, _one_rank(tiny_model_path, torch.load(fsdp_state, weights_only=True)))  # 2 ranks -> 1
    _same(uninterrupted_1, from_1_at_2)  # 1 rank -> 2
