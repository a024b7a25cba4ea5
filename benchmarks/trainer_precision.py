"""Trainer step throughput by precision and micro-batch layout: float32 vs bf16 autocast (and liger's fused loss
where installed), and float32 with padding-free `batch_flattening` and/or token-budget micro-batches
(`max_tokens_per_microbatch`, by default micro x (prompt + max completion) tokens: the fixed path's padded size),
and float32 with each distinct prompt run once (`share_prompt_prefix`, variant "+shared").

The same GRPO step (`GRPOLearner.step`, dapo loss, one optimizer step) on the same synthetic batch, per variant:
wall-clock seconds per step (after a warm-up step, CUDA synchronized), trainer tokens/s (prompt + completion
tokens of the step / seconds) and peak accelerator memory, then the ratios against float32, all measured in this one
run. On a GPU the default model is a Qwen2.5-0.5B-shaped Qwen2 built from its config (random weights: speed only);
`--reduced` (the default without CUDA) runs the tiny CPU model so CI checks that the script works; `--shape medium`
is benchmarks/vs_trl.py's 18M Qwen2 (8 x 8 completions of up to 128 tokens, micro-batches of 16) on CPU;
`--shape demo` is the embedded demo's step (the tiny model, 16 x 8 completions of up to 12 tokens after a 37-token
prompt, micro-batches of 64, one thread). `--variants` picks a subset (e.g. `float32 float32+flat float32+budget
float32+flat+budget`, or `float32+sorted float32+sorted+shared`).

    .venv/bin/python benchmarks/trainer_precision.py [--reduced] [--steps 3] [--groups 8 --generations 8]
    .venv/bin/python benchmarks/trainer_precision.py --shape medium --threads 2 --variants float32 float32+flat
    .venv/bin/python benchmarks/trainer_precision.py --shape demo --threads 1 --steps 20 \
        --variants float32+sorted float32+sorted+shared
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

QWEN_0_5B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)  # Qwen2.5-0.5B's config.json shape
MEDIUM = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=1024,
    vocab_size=320,
    max_position_embeddings=512,
)  # benchmarks/vs_trl.py's 18M
TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
    vocab_size=320,
    max_position_embeddings=512,
)


def synthetic_batch(
    groups: int,
    generations: int,
    prompt_len: int,
    max_completion: int,
    vocab: int,
    seed: int = 0,
    min_frac: float = 0.5,
):
    """`groups` x `generations` completions with random ids, lengths uniform in [min_frac x max_completion,
    max_completion] (at least 1)."""
    from async_grpo.transports.messages import RolloutGroup, TrainBatch

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        comps = [
            [rng.randrange(vocab) for _ in range(rng.randint(max(int(min_frac * max_completion), 1), max_completion))]
            for _ in range(generations)
        ]
        out.append(
            RolloutGroup(
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                completion_ids=comps,
                sampling_logprobs=[[-1.0 - rng.random() for _ in c] for c in comps],
                truncated=[False] * generations,
                completions=[""] * generations,
                prompt=f"p{g}",
                columns={},
                policy_version=0,
                advantages=[rng.uniform(-1, 1) for _ in range(generations)],
            )
        )
    return TrainBatch(groups=out)


def build(variant: str, model, micro: int, max_completion: int, max_tokens: int | None = None):
    """The `GRPOLearner` of `variant` ("float32" / "bf16", then "+liger", "+flat", "+budget", "+sorted": the
    config's default `group_by_length`, "+shared": `share_prompt_prefix: true`, "+auto": `share_prompt_prefix: auto`,
    the config's default), dapo loss."""
    from async_grpo.algorithms import LossSettings
    from async_grpo.trainer.trainer import GRPOLearner

    return GRPOLearner(
        model,
        learning_rate=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=micro,
        loss=LossSettings(max_completion_length=max_completion, use_liger_kernel="+liger" in variant),
        pad_token_id=0,
        mixed_precision="bf16" if variant.startswith("bf16") else None,
        batch_flattening="+flat" in variant,
        max_tokens_per_microbatch=max_tokens if "+budget" in variant else None,
        group_by_length="+sorted" in variant,
        share_prompt_prefix="auto" if "+auto" in variant else "+shared" in variant,
    )


def timed_step(learner, batch) -> tuple[float, dict]:
    """Wall-clock seconds of one `learner.step(batch)` (CUDA synchronized), and its metrics with this process's CPU
    seconds added as "cpu_s" (all threads; less sensitive than wall time to other processes on a shared CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = learner.step(copy.deepcopy(batch))
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, {**metrics, "cpu_s": time.process_time() - c0}


def report(variant: str, learner, batch, seconds: list[float], metrics: dict, cpu: list[float]) -> dict:
    """One variant's row: median wall and CPU seconds per step, trainer tokens/s, micro-batches, peak memory, loss."""
    import torch

    tokens = sum(len(g.prompt_ids) * g.size + sum(len(c) for c in g.completion_ids) for g in batch.groups)
    s_per_step = statistics.median(seconds)
    micro = list(learner._micro_batches([batch]))
    # token positions the model runs per forward (padding included): deterministic, unlike the timings
    positions = sum(_positions(mb) for mb in micro)
    return {
        "variant": variant,
        "s_per_step": s_per_step,
        "cpu_s_per_step": statistics.median(cpu),
        "micro_batches": len(micro),
        "model_positions": positions,
        "real_tokens": tokens,
        "trainer_tokens_per_s": tokens / s_per_step,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "loss": metrics["loss"],
    }


def _positions(mb) -> int:
    """Token positions the model runs for micro-batch `mb`: its flat rows, its distinct prompts plus its completions
    (shared prompts), or its padded rows."""
    if hasattr(mb, "layout"):
        return mb.layout.input_ids.numel()
    if hasattr(mb, "sharing"):
        return mb.sharing.prompt_ids.numel() + mb.completion_ids.numel()
    return mb.input_ids.numel()


def run_sequential(variants, base, batch, args, max_tokens) -> list[dict]:
    """Each variant in turn on its own copy of the model (one at a time in memory: the GPU default)."""
    import torch

    results = []
    for variant in variants:
        learner = build(variant, copy.deepcopy(base), args.micro, args.max_completion, max_tokens)
        timed_step(learner, batch)  # warm-up (allocator, kernels)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        runs = [timed_step(learner, batch) for _ in range(args.steps)]
        results.append(
            report(variant, learner, batch, [r[0] for r in runs], runs[-1][1], [r[1]["cpu_s"] for r in runs])
        )
        del learner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def run_interleaved(variants, base, batch, args, max_tokens) -> list[dict]:
    """Every variant's step in turn, `--steps` rounds, medians: on a shared CPU a load change then hits every variant
    alike instead of whichever ran at the time (the CPU default)."""
    learners = [build(v, copy.deepcopy(base), args.micro, args.max_completion, max_tokens) for v in variants]
    for learner in learners:
        timed_step(learner, batch)  # warm-up
    seconds: list[list[float]] = [[] for _ in variants]
    cpu: list[list[float]] = [[] for _ in variants]
    last: list[dict] = [{} for _ in variants]
    for _ in range(args.steps):
        for i, learner in enumerate(learners):
            t, last[i] = timed_step(learner, batch)
            seconds[i].append(t)
            cpu[i].append(last[i]["cpu_s"])
    return [report(v, lrn, batch, s, m, c) for v, lrn, s, m, c in zip(variants, learners, seconds, last, cpu)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reduced", action="store_true", help="tiny model, small batch (default without CUDA)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--groups", type=int, default=None, help="prompts per step (default 8, or the shape's)")
    p.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8, or the shape's)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128, or the shape's)")
    p.add_argument("--max-completion", type=int, default=None, help="default 512, or the shape's")
    p.add_argument("--micro", type=int, default=None, help="completions per micro-batch (default 8, or the shape's)")
    p.add_argument(
        "--shape",
        choices=["qwen0.5b", "medium", "add18m", "tiny", "demo"],
        default=None,
        help="model shape (default: qwen0.5b on CUDA, tiny otherwise); medium = vs_trl.py's 18M workload; add18m = "
        "time_to_reward.py's add18m step on the same model; demo = the embedded demo's step on the tiny model; "
        "--groups, --generations, --prompt-len, --max-completion and --micro change a shape's batch",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the +budget variants' max_tokens_per_microbatch (default micro x (prompt + max completion))",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--variants", nargs="+", default=None, help="variants to time (the first is the reference)")
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="round-robin the variants' timed steps (default on CPU; needs every variant's model in memory)",
    )
    p.add_argument(
        "--min-completion-frac",
        type=float,
        default=0.5,
        help="completion lengths are uniform in [frac x max completion, max completion]",
    )
    args = p.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    reduced = args.reduced or (not cuda and args.shape is None)
    shape = {"qwen0.5b": QWEN_0_5B, "medium": MEDIUM, "add18m": MEDIUM, "tiny": TINY, "demo": TINY}[
        args.shape or ("tiny" if reduced else "qwen0.5b")
    ]
    # (groups, generations, prompt length, max completion, micro-batch); an argument given on the command line wins
    preset = (8, 8, 128, 512, 8)
    if reduced:
        preset = (2, 4, 16, 32, 4)
    elif args.shape == "medium":  # vs_trl.py: 8 prompts x 8 generations, up to 128 tokens, micro-batches of 16
        preset = (8, 8, 24, 128, 16)
    elif args.shape == "add18m":  # time_to_reward_add.yaml: 8 x 8, <= 8 tokens after ~11, micro-batches of 64
        preset = (8, 8, 11, 8, 64)
    elif args.shape == "demo":  # examples/tiny_cpu.yaml: 16 prompts x 8, <= 12 tokens after ~37, micro-batches of 64
        preset = (16, 8, 37, 12, 64)
    names = ("groups", "generations", "prompt_len", "max_completion", "micro")
    for name, value in zip(names, preset, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    max_tokens = args.max_tokens or args.micro * (args.prompt_len + args.max_completion)
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**shape)).to(device=device, dtype=torch.float32)
    batch = synthetic_batch(
        args.groups,
        args.generations,
        args.prompt_len,
        args.max_completion,
        shape["vocab_size"],
        min_frac=args.min_completion_frac,
    )
    variants = ["float32", "bf16"]
    try:
        import liger_kernel.chunked_loss  # noqa: F401

        if cuda:
            variants.append("bf16+liger")
    except ImportError:
        pass
    if cuda:  # what a GPU run would use: bf16 with the layouts, and float32 with both for the precision's share
        variants += ["bf16+flat", "bf16+budget", "bf16+flat+budget", "float32+flat+budget", "bf16+sorted+shared"]
    else:
        variants += ["float32+sorted", "float32+flat", "float32+budget", "float32+flat+budget", "float32+sorted+shared"]
    variants = args.variants or variants
    interleave = (not cuda) if args.interleave is None else args.interleave
    results = (run_interleaved if interleave else run_sequential)(variants, base, batch, args, max_tokens)
    ref = results[0]["s_per_step"]
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "model_params_M": sum(p.numel() for p in base.parameters()) / 1e6,
                "completions_per_step": args.groups * args.generations,
                "micro_batch": args.micro,
                "max_tokens_per_microbatch": max_tokens,
                "threads": torch.get_num_threads(),
                "interleaved": interleave,
                "min_completion_frac": args.min_completion_frac,
                "results": results,
            },
            indent=2,
        )
    )
    ref_cpu = results[0]["cpu_s_per_step"]
    for r in results[1:]:
        print(
            f"{r['variant']}: {ref / r['s_per_step']:.2f}x the {results[0]['variant']} steps/s "
            f"(CPU seconds per step: {ref_cpu / r['cpu_s_per_step']:.2f}x fewer; model positions "
            f"{r['model_positions']} vs {results[0]['model_positions']})"
        )


if __name__ == "__main__":
    main()
