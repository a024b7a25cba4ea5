"""Trainer step throughput by precision and micro-batch layout: float32 vs bf16 autocast (and liger's fused loss
where installed), and float32 with padding-free `batch_flattening` and/or token-budget micro-batches
(`max_tokens_per_microbatch`, by default micro x (prompt + max completion) tokens: the fixed path's padded size).

The same GRPO step (`GRPOLearner.step`, dapo loss, one optimizer step) on the same synthetic batch, per variant:
wall-clock seconds per step (after a warm-up step, CUDA synchronized), trainer tokens/s (prompt + completion
tokens of the step / seconds) and peak accelerator memory, then the ratios against float32, all measured in this one
run. On a GPU the default model is a Qwen2.5-0.5B-shaped Qwen2 built from its config (random weights: speed only);
`--reduced` (the default without CUDA) runs the tiny CPU model so CI checks that the script works; `--shape medium`
is benchmarks/vs_trl.py's 18M Qwen2 (8 x 8 completions of up to 128 tokens, micro-batches of 16) on CPU.
`--variants` picks a subset (e.g. `float32 float32+flat float32+budget float32+flat+budget`).

    .venv/bin/python benchmarks/trainer_precision.py [--reduced] [--steps 3] [--groups 8 --generations 8]
    .venv/bin/python benchmarks/trainer_precision.py --shape medium --threads 2 --variants float32 float32+flat
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
MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              intermediate_size=1024, vocab_size=320, max_position_embeddings=512)  # benchmarks/vs_trl.py's 18M
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


def run(variant: str, model, batch, micro: int, steps: int, max_completion: int, max_tokens: int | None = None) -> dict:
    """Seconds per `GRPOLearner.step` of `variant` ("float32" / "bf16", then "+liger", "+flat", "+budget")."""
    import torch

    from async_grpo.algorithms import LossSettings
    from async_grpo.trainer.trainer import GRPOLearner

    fused = "+liger" in variant
    learner = GRPOLearner(model, learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, micro_batch_size=micro,
                          loss=LossSettings(max_completion_length=max_completion, use_liger_kernel=fused),
                          pad_token_id=0, mixed_precision="bf16" if variant.startswith("bf16") else None,
                          batch_flattening="+flat" in variant,
                          max_tokens_per_microbatch=max_tokens if "+budget" in variant else None)
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
    return {"variant": variant, "s_per_step": seconds, "micro_batches": len(list(learner._micro_batches([batch]))),
            "trainer_tokens_per_s": tokens / seconds,
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
    p.add_argument("--shape", choices=["qwen0.5b", "medium", "tiny"], default=None,
                   help="model shape (default: qwen0.5b on CUDA, tiny otherwise); medium = vs_trl.py's 18M workload")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the +budget variants' max_tokens_per_microbatch (default micro x (prompt + max completion))")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--variants", nargs="+", default=None, help="variants to time (the first is the reference)")
    args = p.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    reduced = args.reduced or (not cuda and args.shape is None)
    shape = {"qwen0.5b": QWEN_0_5B, "medium": MEDIUM, "tiny": TINY}[args.shape or ("tiny" if reduced else "qwen0.5b")]
    if reduced:
        args.groups, args.generations, args.prompt_len, args.max_completion, args.micro = 2, 4, 16, 32, 4
    elif args.shape == "medium":  # vs_trl.py: 8 prompts x 8 generations, up to 128 tokens, micro-batches of 16
        args.groups, args.generations, args.prompt_len, args.max_completion, args.micro = 8, 8, 24, 128, 16
    max_tokens = args.max_tokens or args.micro * (args.prompt_len + args.max_completion)
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
    variants += ["float32+flat", "float32+budget", "float32+flat+budget"]
    variants = args.variants or variants
    results = []
    for variant in variants:
        model = copy.deepcopy(base)
        results.append(run(variant, model, batch, args.micro, args.steps, args.max_completion, max_tokens))
        del model
        if cuda:
            torch.cuda.empty_cache()
    ref = results[0]["s_per_step"]
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                      "model_params_M": sum(p.numel() for p in base.parameters()) / 1e6,
                      "completions_per_step": args.groups * args.generations, "micro_batch": args.micro,
                      "max_tokens_per_microbatch": max_tokens, "threads": torch.get_num_threads(),
                      "results": results}, indent=2))
    for r in results[1:]:
        print(f"{r['variant']}: {ref / r['s_per_step']:.2f}x the {results[0]['variant']} steps/s")


if __name__ == "__main__":
    main()
