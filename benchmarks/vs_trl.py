"""async-grpo against TRL's GRPOTrainer on the same work, in one invocation.

Same model (a Qwen2 built locally: by default 18M parameters, hidden 512, 8 layers, 16 heads, 4 KV heads,
intermediate 1024), same prompts (the builtin `add` task), same batch (8 prompts x 8 generations per step, up to 128
completion tokens), same loss (dapo, beta 0), same precision (float32), micro-batches of 16 completions and the same
learning rate (`--learning-rate`, by default 1e-8: the policy stays all but fixed, so every system generates from the
same length distribution and a step is the same work in each; at 1e-5 mean lengths drifted from 83 to 50-80 tokens
within 8 steps, differently per system), for:

- TRL 1.16 `GRPOTrainer` (generation with transformers on the same CPU, `use_vllm=False`);
- TRL 1.16 `trl.experimental.async_grpo.AsyncGRPOTrainer` (its rollout worker generates on a vLLM CPU server started
  by our launcher with our flags; max_staleness 2, a weight push after every step; each step trains prompts x
  generations samples: its fixed-count batcher, `token_budget=0`). It is GPU-only as shipped, so on CPU it runs
  through its seams (benchmarks/trl_async_cpu.py): weight pushes through our gloo backend (its `weight_transfer=`
  argument), an SDPA stand-in for its FA3 tree attention, and its MFU metric stubbed; the output names each. Its loss
  is its own (clipped token-level, no KL), its `gradient_checkpointing` TRL's default (true, as for GRPOTrainer);
- async-grpo on-policy (`max_staleness: 0`): a real vLLM CPU server generates, the trainer waits for each step;
- async-grpo async (`max_staleness: 2`, the default mode; with the trainer on every core beside its own vLLM CPU
  server, `resource_sharing: auto` is adaptive: vLLM generates on half the cores, the trainer computes on the
  other half while vLLM generates and on every core while it is idle);
- with `--modes time_slice overlap`, the same async mode under those `resource_sharing` modes too.

The on-policy mode runs with `resource_sharing: auto` too, which is time_slice there (nothing to overlap: vLLM gets
every core while the trainer waits). Both async-grpo modes use the config defaults otherwise (`group_by_length`).

Each system runs `--warmup` steps, then `--steps` timed steps; steps are timed by wall clock (TRL: a callback at
each step end; async-grpo: the MLflow timestamps of each step's metrics). Prints, all measured in this one run:
steady seconds per step, completions/s, trainer tokens/s (the step's prompt + completion tokens over the trainer's
compute seconds), generation tokens/s (the step's completion tokens over the step's wall time) and vLLM's own
tokens/s (over the seconds vLLM had a request in flight), the ratios against TRL, async against on-policy, and the
on-policy step against its own generation plus training time, and trained tokens/s (prompt + completion tokens
trained per second of wall time: the ratio that stays fair if lengths still differ), and the async default against
AsyncGRPOTrainer (trained tokens/s, steps/s). `--systems` picks the systems to run (all by default). `--reduced`
shrinks everything for CI.

    .venv/bin/python benchmarks/vs_trl.py [--steps 3 --warmup 1 --threads 2] [--modes time_slice overlap] [--bf16]
                                          [--systems trl trl_async on_policy async] [--reduced]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SYSTEMS = {  # --systems name: results key
    "trl": "trl_grpo_trainer",
    "trl_async": "trl_async_grpo_trainer",
    "on_policy": "async_grpo_on_policy",
    "async": "async_grpo_async",
}


def trl_step_times(model_path: Path, args, out: Path) -> tuple[list[float], list[float]]:
    """Wall-clock seconds of each TRL GRPOTrainer step, and the prompt + completion tokens it trained (TRL's
    cumulative `num_tokens` log, differenced)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_grpo.tasks import get_task

    task = get_task("add")
    stamps: list[float] = []
    tokens: list[float] = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "num_tokens" in logs:
                tokens.append(float(logs["num_tokens"]))

    torch.set_num_threads(args.threads)
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.prompts * args.generations // args.micro, num_generations=args.generations,
        max_completion_length=args.max_completion, temperature=1.0, loss_type="dapo", beta=0.0, learning_rate=args.learning_rate,
        max_steps=args.warmup + args.steps, logging_steps=1, report_to="none", use_cpu=True, bf16=args.bf16,
        save_strategy="no", seed=0, dataloader_num_workers=0, use_vllm=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=list(task.reward_funcs.values()),
        args=config,
        train_dataset=task.train_dataset(0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[Clock()],
    )
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:])], [b - a for a, b in zip(tokens, tokens[1:])]


def ours_step_times(
    model_path: Path, args, out: Path, max_staleness: int, resource_sharing: str = "auto"
) -> dict[str, list[float]]:
    """Per timed step of an async-grpo run (from MLflow): `wall_s` (wall clock between consecutive steps),
    `train_s` (the trainer's compute), `generating_s` (seconds vLLM had a request in flight), `tokens` (prompt +
    completion tokens trained), `vllm_tokens_per_s` and `tokens_per_s` (generation over the step's wall time)."""
    import mlflow

    from async_grpo.config import GRPOConfig
    from async_grpo.launch.local import run_local

    config = GRPOConfig(
        model_name_or_path=str(model_path), dataset="builtin:add", reward_funcs=["builtin:add_exact_match",
        "builtin:add_format"], num_generations=args.generations, max_completion_length=args.max_completion,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.prompts * args.generations // args.micro,
        loss_type="dapo", beta=0.0, learning_rate=args.learning_rate, max_steps=args.warmup + args.steps, max_staleness=max_staleness,
        torch_num_threads=args.threads, eval_num_prompts=1, num_generations_eval=2, save_model=False,
        output_dir=str(out), max_inflight_groups=args.prompts, seed=0, vllm_max_model_len=512,
        resource_sharing=resource_sharing, bf16=args.bf16, vllm_dtype="bfloat16" if args.bf16 else "float32",
    )  # fmt: skip
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    client = mlflow.MlflowClient()

    def series(key: str) -> list[tuple[float, float]]:  # (timestamp s, value) by step
        return [
            (m.timestamp / 1000.0, m.value)
            for m in sorted(client.get_metric_history(summary.run_id, key), key=lambda m: m.step)
        ]

    stamps = [t for t, _ in series("loss")]
    busy, tokens = [v for _, v in series("inference/generating_s")], [v for _, v in series("num_tokens")]
    return {
        "wall_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "train_s": [v for _, v in series("trainer/step_seconds")][1:],
        "generating_s": [b - a for a, b in zip(busy, busy[1:])],
        "tokens": [b - a for a, b in zip(tokens, tokens[1:])],
        "vllm_tokens_per_s": [v for _, v in series("generation/vllm_tokens_per_s")][1:],
        "tokens_per_s": [v for _, v in series("generation/tokens_per_s")][1:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-completion", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="completions per micro-batch")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 for every system: TRL's and async-grpo's `bf16` "
        "(autocast, float32 master weights), and async-grpo's vLLM server in bfloat16",
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=1e-8,
        help="every system's learning rate; the default keeps the policy all but fixed, so each system "
        "generates completions of the same length distribution (at 1e-5 the lengths drift apart within a "
        "few steps, differently per system, and s/step stops comparing the same work)",
    )
    p.add_argument("--reduced", action="store_true", help="tiny model, 2 prompts x 4, 16 tokens (CI)")
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=list(SYSTEMS),
        help="systems to run (default: all): " + ", ".join(f"{k} ({v})" for k, v in SYSTEMS.items()),
    )
    p.add_argument(
        "--modes",
        nargs="*",
        default=[],
        choices=["time_slice", "overlap", "adaptive"],
        help="also time the async mode under these resource_sharing modes, against the default's choice",
    )
    args = p.parse_args()
    # more torch threads than this process may run on only makes OpenMP threads spin for each other (a test
    # worker's one core: 2 threads took 0.47 s per step against 0.27 s on 1, docs/development.md)
    args.threads = min(args.threads, len(os.sched_getaffinity(0)))
    from async_grpo.tiny_model import build_tiny_model

    dims = dict(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=1024)
    if args.reduced:
        dims = {}
        args.prompts, args.generations, args.max_completion, args.micro = 2, 4, 16, 4
    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    model_path = build_tiny_model(work / "model", seed=0, **dims)
    results = {}
    if "trl" in args.systems:
        trl, trl_tokens = (v[args.warmup :] for v in trl_step_times(model_path, args, work / "trl"))
        results[SYSTEMS["trl"]] = {
            "s_per_step": statistics.median(trl),
            "trained_tokens_per_s": sum(trl_tokens) / sum(trl),
        }
    if "trl_async" in args.systems:
        from trl_async_cpu import trl_async_step_times  # beside this script; imports TRL and vLLM

        run = trl_async_step_times(model_path, args, work / "trl_async")
        steps = {k: v[args.warmup :] for k, v in run.items() if k != "info"}
        results[SYSTEMS["trl_async"]] = {
            "s_per_step": statistics.median(steps["wall_s"]),
            "trained_tokens_per_s": sum(steps["tokens"]) / sum(steps["wall_s"]),
            "trained_tokens_per_step": statistics.median(steps["tokens"]),
            "completion_tokens_per_step": statistics.median(steps["completion_tokens"]),
            "forwarded_unique_tokens_per_step": statistics.median(steps["unique_tokens"]),
            "stale_samples_dropped": sum(steps["stale_dropped"]),
            **run["info"],
        }
    systems = [("async_grpo_on_policy", 0, "auto")] if "on_policy" in args.systems else []
    if "async" in args.systems:
        systems += [("async_grpo_async", 2, "auto")] + [(f"async_grpo_async_{m}", 2, m) for m in args.modes]
    for name, staleness, sharing in systems:
        steps = {
            k: v[max(args.warmup - 1, 0) :]
            for k, v in ours_step_times(model_path, args, work / name, staleness, sharing).items()
        }
        med = {k: statistics.median(v) for k, v in steps.items() if v}
        results[name] = {
            "s_per_step": med["wall_s"],
            "trainer_s_per_step": med["train_s"],
            "vllm_generating_s_per_step": med["generating_s"],
            "trainer_tokens_per_s": statistics.median(t / s for t, s in zip(steps["tokens"], steps["train_s"])),
            "generation_tokens_per_s": med["tokens_per_s"],
            "vllm_tokens_per_s": med["vllm_tokens_per_s"],
            "trained_tokens_per_s": sum(steps["tokens"]) / sum(steps["wall_s"]),
        }
    completions = args.prompts * args.generations
    for r in results.values():
        r["completions_per_s"] = completions / r["s_per_step"]
    print(
        json.dumps(
            {
                "completions_per_step": completions,
                "max_completion_tokens": args.max_completion,
                "threads": args.threads,
                "precision": "bf16" if args.bf16 else "float32",
                "results": results,
            },
            indent=2,
        )
    )
    print_ratios(results, [n for n, _, _ in systems])


def print_ratios(results: dict[str, dict], ours: list[str]) -> None:
    """Print the ratio lines of the systems that ran: each async-grpo system and AsyncGRPOTrainer against TRL's
    GRPOTrainer (steps/s, trained tokens/s), the async default against AsyncGRPOTrainer (trained tokens/s, steps/s),
    async against on-policy, and the on-policy step against its own generation plus training time."""
    trl, trl_async = results.get(SYSTEMS["trl"]), results.get(SYSTEMS["trl_async"])
    on, asy = results.get("async_grpo_on_policy"), results.get("async_grpo_async")
    if trl:
        for name in ([SYSTEMS["trl_async"]] if trl_async else []) + ours:
            print(
                f"{name}: {trl['s_per_step'] / results[name]['s_per_step']:.2f}x TRL's steps/s, "
                f"{results[name]['trained_tokens_per_s'] / trl['trained_tokens_per_s']:.2f}x its trained tokens/s"
            )
    if asy and trl_async:
        print(
            f"async_grpo_async: {asy['trained_tokens_per_s'] / trl_async['trained_tokens_per_s']:.2f}x "
            f"AsyncGRPOTrainer's trained tokens/s, {trl_async['s_per_step'] / asy['s_per_step']:.2f}x its steps/s"
        )
    if on and asy:
        print(f"async / on-policy: {on['s_per_step'] / asy['s_per_step']:.2f}x")
    if on:
        print(
            f"on-policy step / (its generation + its training): {on['s_per_step']:.2f} / "
            f"({on['vllm_generating_s_per_step']:.2f} + {on['trainer_s_per_step']:.2f}) = "
            f"{on['s_per_step'] / (on['vllm_generating_s_per_step'] + on['trainer_s_per_step']):.2f}"
        )


if __name__ == "__main__":
    main()
