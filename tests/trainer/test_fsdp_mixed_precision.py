"""FSDP2 with bf16 (`fsdp: true`, `bf16: true`): every unit gets FSDP2's `MixedPrecisionPolicy`, so the forward and
backward run on bfloat16 weights while the sharded master weights, their gradients and AdamW's state stay float32;
the step matches a float32 single process to bf16 rounding (2 gloo ranks on CPU)."""

from __future__ import annotations

import os

import torch

from async_grpo.algorithms import LossSettings
from async_grpo.trainer.distributed import DataParallelLearner, DistInfo, follow
from async_grpo.trainer.trainer import GRPOLearner
from tests.forkserver import start_ranks

from .test_streaming_reuse_distributed import _free_port, _local, batch_of_four_groups
from .test_trainer import PAD


def make_learner(model, *, fsdp: bool, mixed_precision: str | None) -> GRPOLearner:
    return GRPOLearner(
        model,
        learning_rate=1e-3,
        weight_decay=0.0,
        max_grad_norm=1e9,
        micro_batch_size=4,
        loss=LossSettings(max_completion_length=8, loss_type="dapo"),
        pad_token_id=PAD,
        fsdp=fsdp,
        mixed_precision=mixed_precision,
    )


def _rank_main(rank: int, port: int, model_path: str, out_dir: str) -> None:
    from torch.distributed.fsdp import FSDPModule
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
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    local = make_learner(model, fsdp=True, mixed_precision="bf16")
    if rank == 0:
        dp = DataParallelLearner(local, info)
        metrics = dp.step(batch_of_four_groups())
        dp.close()
    else:
        follow(local, DistInfo(rank=1, world_size=2))
        metrics = None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    torch.save(
        {
            "grads": [_local(p.grad) for p in model.parameters()],
            "metrics": metrics,
            "param_dtypes": {str(_local(p).dtype) for p in model.parameters()},
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters()},
            "policies": {str(u._get_fsdp_state()._mp_policy.param_dtype) for u in units},
        },
        os.path.join(out_dir, f"bf16-{rank}.pt"),
    )
    close_distributed()


def test_fsdp_bf16_keeps_float32_master_weights_and_matches_float32_to_bf16_rounding(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    start_ranks(_rank_main, args=(_free_port(), str(tiny_model_path), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"bf16-{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["policies"] == {"torch.bfloat16"}  # every FSDP unit computes in bf16
        assert r["param_dtypes"] == {"torch.float32"} and r["grad_dtypes"] == {"torch.float32"}  # master weights
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    single = make_learner(reference, fsdp=False, mixed_precision=None)
    expected = single.step(batch_of_four_groups())
    got = ranks[0]["metrics"]
    assert abs(got["loss"] - expected["loss"]) <= 2e-2 * abs(expected["loss"]) + 1e-3  # bf16 rounding only
    full = [
        torch.cat([g0, g1]) if g0.shape != p.shape else g0
        for p, g0, g1 in zip(reference.parameters(), ranks[0]["grads"], ranks[1]["grads"], strict=True)
    ]
    flat_bf16 = torch.cat([g.flatten() for g in full])
    flat_fp32 = torch.cat([p.grad.flatten() for p in reference.parameters()])
    cosine = torch.nn.functional.cosine_similarity(flat_bf16, flat_fp32, dim=0)
    assert cosine > 0.99, cosine  # the same update direction, up to bf16 noise
    assert not torch.equal(flat_bf16, flat_fp32)  # it really ran in bf16
