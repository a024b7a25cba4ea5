"""async-grpo against TRL's GRPOTrainer on the same work, in one invocation.

Same model (a Qwen2 built locally: by default 18M parameters, hidden 512, 8 layers, 16 heads, 4 KV heads,
intermediate 1024), same prompts (the builtin `add` task), same batch (8 prompts x 8 generations per step, up to 128
completion tokens), same loss (dapo, beta 0), same precision (float32) and micro-batches of 16 completions, for:

- TRL 1.16 `GRPOTrainer` (generation with transformers on the same CPU, `use_vllm=False`);
- async-grpo on-policy (`max_staleness: 0`): a real vLLM CPU server generates, the trainer waits for each step;
- async-grpo async (`max_staleness: 2`, the default mode; with the trainer on every core beside its own vLLM CPU
  server, `resource_sharing: auto` time-slices: vLLM pauses while the trainer computes);
- with `--with-overlap`, the same async mode with `resource_sharing: overlap` (both compute at once).

Each system runs `--warmup` steps, then `--steps` timed steps; steps are timed by wall clock (TRL: a callback at
each step end; async-grpo: the MLflow timestamps of each step's metrics). Prints steady seconds per step,
completions/s and the ratios, all measured in this one run. `--reduced` shrinks everything for CI.

    .venv/bin/python benchmarks/vs_trl.py [--steps 3 --warmup 1 --threads 2] [--with-overlap] [--reduced]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def trl_step_times(model_path: Path, args, out: Path) -> list[float]:
    """Wall-clock seconds of each TRL GRPOTrainer step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_grpo.tasks import get_task

    task = get_task("add")
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    torch.set_num_threads(args.threads)
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.prompts * args.generations // args.micro, num_generations=args.generations,
        max_completion_length=args.max_completion, temperature=1.0, loss_type="dapo", beta=0.0, learning_rate=1e-5,
        max_steps=args.warmup + args.steps, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", seed=0, dataloader_num_workers=0, use_vllm=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                          reward_funcs=list(task.reward_funcs.values()), args=config, train_dataset=task.train_dataset(0),
                          processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[Clock()])
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def ours_step_times(model_path: Path, args, out: Path, max_staleness: int,
                    resource_sharing: str = "auto") -> tuple[list[float], float]:
    """Wall-clock seconds between consecutive async-grpo steps (from MLflow), and the mean generation tokens/s."""
    import mlflow

    from async_grpo.config import GRPOConfig
    from async_grpo.launch.local import run_local

    config = GRPOConfig(
        model_name_or_path=str(model_path), dataset="builtin:add", reward_funcs=["builtin:add_exact_match",
        "builtin:add_format"], num_generations=args.generations, max_completion_length=args.max_completion,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.prompts * args.generations // args.micro,
        loss_type="dapo", beta=0.0, learning_rate=1e-5, max_steps=args.warmup + args.steps, max_staleness=max_staleness,
        torch_num_threads=args.threads, eval_num_prompts=1, num_generations_eval=2, save_model=False,
        output_dir=str(out), max_inflight_groups=args.prompts, seed=0, vllm_max_model_len=512,
        resource_sharing=resource_sharing,
    )  # fmt: skip
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    history = sorted(mlflow.MlflowClient().get_metric_history(summary.run_id, "loss"), key=lambda m: m.step)
    stamps = [m.timestamp / 1000.0 for m in history]
    return [b - a for a, b in zip(stamps, stamps[1:])], summary.generation_tokens_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-completion", type=int, default=128)
    p.add_argument("--micro", type=int, default=16, help="completions per micro-batch")
    p.add_argument("--reduced", action="store_true", help="tiny model, 2 prompts x 4, 16 tokens (CI)")
    p.add_argument("--with-overlap", action="store_true", help="also time the async mode with resource_sharing="
                   "overlap (vLLM generating while the trainer computes), against the default's choice")
    args = p.parse_args()
    from async_grpo.tiny_model import build_tiny_model

    dims = dict(hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=1024)
    if args.reduced:
        dims = {}
        args.prompts, args.generations, args.max_completion, args.micro = 2, 4, 16, 4
    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    model_path = build_tiny_model(work / "model", seed=0, **dims)
    results = {}
    trl = trl_step_times(model_path, args, work / "trl")[args.warmup:]
    results["trl_grpo_trainer"] = {"s_per_step": statistics.median(trl)}
    systems = [("async_grpo_on_policy", 0, "auto"), ("async_grpo_async", 2, "auto")]
    systems += [("async_grpo_async_overlap", 2, "overlap")] if args.with_overlap else []
    for name, staleness, sharing in systems:
        times, gen_tps = ours_step_times(model_path, args, work / name, staleness, sharing)
        results[name] = {"s_per_step": statistics.median(times[max(args.warmup - 1, 0):]),
                         "generation_tokens_per_s": gen_tps}
    completions = args.prompts * args.generations
    for r in results.values():
        r["completions_per_s"] = completions / r["s_per_step"]
    print(json.dumps({"completions_per_step": completions, "max_completion_tokens": args.max_completion,
                      "threads": args.threads, "results": results}, indent=2))
    trl_s = results["trl_grpo_trainer"]["s_per_step"]
    for name in [n for n, _, _ in systems]:
        print(f"{name}: {trl_s / results[name]['s_per_step']:.2f}x TRL's steps/s")
    print(f"async / on-policy: {results['async_grpo_on_policy']['s_per_step'] / results['async_grpo_async']['s_per_step']:.2f}x")


if __name__ == "__main__":
    main()
