"""Trainer step throughput by precision: float32 vs bf16 autocast (and liger's fused loss where installed).

The same GRPO step (`GRPOLearner.step`, dapo loss, one optimizer step) on the same synthetic batch, per variant:
wall-clock seconds per step (after a warm-up step, CUDA synchronized), trainer tokens/s (prompt + completion
tokens of the step / seconds) and peak accelerator memory, then the ratios against float32, all measured in this one
run. On a GPU the default model is a Qwen2.5-0.5B-shaped Qwen2 built from its config (random weights: speed only);
`--reduced` (the default without CUDA) runs the tiny CPU model so CI checks that the script works.

    .venv/bin/python benchmarks/trainer_precision.py [--reduced] [--steps 3] [--groups 8 --generations 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

QWEN_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)  # Qwen2.5-0.5B's config.json shape
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=384, vocab_size=320, max_position_embeddings=512)


def synthetic_batch(groups: int, generations: int, prompt_len: int, max_completion: int, vocab: int, seed: int = 0):
    """`groups` x `generations` completions with random ids, lengths in [max_completion / 2, max_completion]."""
    from async_grpo.transports.messages import RolloutGroup, TrainBatch

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        comps = [[rng.randrange(vocab) for _ in range(rng.randint(max_completion // 2, max_completion))]
                 for _ in range(generations)]
        out.append(RolloutGroup(
            prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)], completion_ids=comps,
            sampling_logprobs=[[-1.0 - rng.random() for _ in c] for c in comps], truncated=[False] * generations,
            completions=[""] * generations, prompt=f"p{g}", columns={}, policy_version=0,
            advantages=[rng.uniform(-1, 1) for _ in range(generations)]))
    return TrainBatch(groups=out)


def run(variant: str, model, batch, micro: int, steps: int, max_completion: int) -> dict:
    import torch

    from async_grpo.algorithms import LossSettings
    from async_grpo.trainer.trainer import GRPOLearner

    fused = variant.endswith("+liger")
    learner = GRPOLearner(model, learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, micro_batch_size=micro,
                          loss=LossSettings(max_completion_length=max_completion, use_liger_kernel=fused),
                          pad_token_id=0, mixed_precision="bf16" if variant.startswith("bf16") else None)
    cuda = torch.cuda.is_available()
    learner.step(copy.deepcopy(batch))  # warm-up (allocator, kernels)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics = learner.step(copy.deepcopy(batch))
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    tokens = sum(len(g.prompt_ids) * g.size + sum(len(c) for c in g.completion_ids) for g in batch.groups)
    return {"variant": variant, "s_per_step": seconds, "trainer_tokens_per_s": tokens / seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "loss": metrics["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reduced", action="store_true", help="tiny model, small batch (default without CUDA)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-completion", type=int, default=512)
    p.add_argument("--micro", type=int, default=8, help="completions per micro-batch")
    args = p.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    reduced = args.reduced or not cuda
    shape = TINY if reduced else QWEN_0_5B
    if reduced:
        args.groups, args.generations, args.prompt_len, args.max_completion, args.micro = 2, 4, 16, 32, 4
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**shape)).to(device=device, dtype=torch.float32)
    batch = synthetic_batch(args.groups, args.generations, args.prompt_len, args.max_completion, shape["vocab_size"])
    variants = ["float32", "bf16"]
    try:
        import liger_kernel.chunked_loss  # noqa: F401

        if cuda:
            variants.append("bf16+liger")
    except ImportError:
        pass
    results = []
    for variant in variants:
        model = copy.deepcopy(base)
        results.append(run(variant, model, batch, args.micro, args.steps, args.max_completion))
        del model
        if cuda:
            torch.cuda.empty_cache()
    ref = results[0]["s_per_step"]
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                      "model_params_M": sum(p.numel() for p in base.parameters()) / 1e6,
                      "completions_per_step": args.groups * args.generations, "micro_batch": args.micro,
                      "results": results}, indent=2))
    for r in results[1:]:
        print(f"{r['variant']}: {ref / r['s_per_step']:.2f}x the float32 steps/s")


if __name__ == "__main__":
    main()
