"""One step's rollouts from a real vLLM server: each group its own request, against groups coalesced into one call.

The orchestrator sends one `/v1/completions` request per group (`n` = num_generations). With
`vllm_coalesce_window_s` > 0 (`inference.coalescing.RequestCoalescer`) the groups sent within the window share one
multi-prompt call, as TRL's `vllm-serve` client sends a whole batch. This measures, on one server and in one run,
the seconds to get one step's groups back both ways, with the product's client (`AsyncVLLMClient`) and the product's
server flags (`build_server_command` / `server_env`): the demo's shape by default (16 prompts of the `reverse` task
x n=8, up to 12 tokens, temperature 1, the tiny model built locally). The two modes alternate rep by rep (after
`--warmup` reps of each) so that drift of the machine hits both alike; the first `--warmup` reps are left out.

Prints per mode the median and range (min-max) of the seconds per step, the completion tokens per second, and the
ratio coalesced / alone (below 1: coalescing is faster), then one JSON line.

    .venv/bin/python benchmarks/coalescing.py [--model DIR] [--prompts 16 --generations 8 --max-tokens 12]
        [--reps 20 --warmup 3] [--window-s 0.005]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from async_grpo.inference.client import AsyncVLLMClient, GenerationError

MODES = ("alone", "coalesced")


async def one_step(client: AsyncVLLMClient, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[float, int]:
    """Send every prompt as one group request at once (as the orchestrator does) and wait for all.

    Returns:
        (seconds until the last group answered, completion tokens received).

    Raises:
        GenerationError: a group came back without n completions.
    """
    t0 = time.perf_counter()
    groups = await asyncio.gather(*(client.generate(p, n=n, max_tokens=max_tokens, temperature=1.0) for p in prompts))
    seconds = time.perf_counter() - t0
    if any(len(g) != n for g in groups):
        raise GenerationError(f"a group came back with {[len(g) for g in groups]} completions, not n={n}")
    return seconds, sum(len(c.token_ids) for g in groups for c in g)


async def measure(
    url: str, model: str, prompt_sets: list[list[list[int]]], n: int, max_tokens: int, warmup: int, window_s: float
) -> dict[str, dict[str, list[float]]]:
    """Alternate the two modes over `prompt_sets` (one step's prompts each; the same set for both modes of a rep).

    Args:
        url: the vLLM server's base URL.
        model: its served model id.
        prompt_sets: (reps + warmup) steps, each a list of token-id prompts.
        n: completions per prompt (num_generations).
        max_tokens: max completion tokens.
        warmup: leading reps of each mode left out of the result.
        window_s: the coalesced client's `coalesce_window_s` (seconds, > 0).

    Returns:
        {mode: {"seconds": [...], "tokens": [...]}} over the measured reps.
    """
    clients = {
        "alone": AsyncVLLMClient(url, model),
        "coalesced": AsyncVLLMClient(url, model, coalesce_window_s=window_s),
    }
    out: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "tokens": []} for m in MODES}
    try:
        for rep, prompts in enumerate(prompt_sets):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                seconds, tokens = await one_step(clients[mode], prompts, n, max_tokens)
                if rep >= warmup:
                    out[mode]["seconds"].append(seconds)
                    out[mode]["tokens"].append(float(tokens))
    finally:
        for client in clients.values():
            await client.aclose()
    return out


def report(result: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> dict:
    """Print the per-mode medians and ranges and the ratio; return the JSON summary."""
    summary: dict = {"prompts": args.prompts, "generations": args.generations, "max_tokens": args.max_tokens}
    print(f"one step: {args.prompts} prompts x n={args.generations}, up to {args.max_tokens} tokens, {args.reps} reps")
    for mode in MODES:
        s, t = result[mode]["seconds"], result[mode]["tokens"]
        median = statistics.median(s)
        tokens_per_s = sum(t) / sum(s)
        print(f"{mode:>10}: {median * 1e3:7.1f} ms per step (range {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}), "
              f"{tokens_per_s:,.0f} completion tokens/s")  # fmt: skip
        summary[mode] = {"median_s": median, "min_s": min(s), "max_s": max(s), "tokens_per_s": tokens_per_s}
    ratio = summary["coalesced"]["median_s"] / summary["alone"]["median_s"]
    summary["ratio_coalesced_over_alone"] = ratio
    print(f"ratio coalesced / alone (median seconds per step): {ratio:.2f}x")
    print(json.dumps(summary))
    return summary


def prompt_sets(tokenizer, count: int, prompts: int, seed: int = 0) -> list[list[list[int]]]:
    """`count` steps of `prompts` distinct `reverse` task prompts, tokenized."""
    from async_grpo.tasks.reverse import sample_reverse

    rng = random.Random(seed)
    return [[tokenizer(sample_reverse(rng)[1])["input_ids"] for _ in range(prompts)] for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: the tiny model, built here)")
    p.add_argument("--prompts", type=int, default=16, help="groups per step (the demo: 16)")
    p.add_argument("--generations", type=int, default=8, help="completions per group (the demo: 8)")
    p.add_argument("--max-tokens", type=int, default=12, help="max completion tokens (the demo: 12)")
    p.add_argument("--reps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="steps per mode left out first")
    p.add_argument("--window-s", type=float, default=0.005, help="the coalesced client's window (seconds)")
    p.add_argument("--reduced", action="store_true", help="CI size: 6 reps, 1 warm-up")
    args = p.parse_args(argv)
    if args.reduced:
        args.reps, args.warmup = 6, 1
    if min(args.prompts, args.generations, args.max_tokens, args.reps) < 1 or args.warmup < 0 or args.window_s <= 0:
        p.error("--prompts, --generations, --max-tokens and --reps must be >= 1, --warmup >= 0, --window-s > 0")

    from transformers import AutoTokenizer

    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "model", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = VLLMServer(build_server_command(str(model), port=port), server_env(), Path(tmp) / "vllm.log", url, 400)
        with server:
            sets = prompt_sets(tokenizer, args.reps + args.warmup, args.prompts)
            result = asyncio.run(
                measure(url, str(model), sets, args.generations, args.max_tokens, args.warmup, args.window_s)
            )
    report(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
