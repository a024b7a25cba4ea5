"""Trainer idle time with and without streaming group scoring, on the real CPU stack.

Two short runs of the tiny reverse task share one vLLM server (started here) and differ only in
`streaming_min_groups`. Both use `max_staleness: 0`, the setting where the orchestrator cannot run ahead
of the trainer and each step's groups are generated and scored while the trainer waits, so whatever
streaming overlaps shows up as less trainer idle time. `--reward-latency` adds a sleep to every
group's scoring, standing in for a slow verifier (code execution, a judge model): that is the work
streaming overlaps with the trainer's passes. Prints steps/s and idle fraction of each run and their
ratios, measured in this one run.

    .venv/bin/python benchmarks/streaming_overlap.py [--steps 30 --groups 8 --chunk 2 --reward-latency 0.3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--groups", type=int, default=8, help="groups per step (8 completions each)")
    p.add_argument("--chunk", type=int, default=2, help="streaming_min_groups of the streamed run")
    p.add_argument("--reward-latency", type=float, default=0.3, help="seconds of sleep per group's scoring")
    args = p.parse_args()

    import logging

    from async_grpo.config import GRPOConfig
    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.launch.local import run_local
    from async_grpo.tiny_model import build_tiny_model

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="streaming-bench-"))
    model = build_tiny_model(root / "model", seed=0)
    rewards = root / "slow_reward.py"
    rewards.write_text(
        "import time\nfrom async_grpo.tasks.reverse import reverse_format\n\n\n"
        "def slow_reverse_format(prompts, completions, completion_ids=None, **kw):\n"
        f"    time.sleep({args.reward_latency})\n"
        "    return reverse_format(prompts, completions, completion_ids, **kw)\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VLLMServer(
        build_server_command(model, port=port, dtype="float32", max_model_len=512, weight_transfer_backend="gloo"),
        server_env(1),
        root / "vllm.log",
        url,
        400.0,
    )
    server.start()
    results = {}
    try:
        for name, chunk in (("whole steps", None), (f"streaming_min_groups={args.chunk}", args.chunk)):
            config = GRPOConfig(
                model_name_or_path=str(model), vllm_url=url, dataset="builtin:reverse",
                reward_funcs=[f"{rewards}:slow_reverse_format"], reward_num_workers=2, num_generations=8,
                per_device_train_batch_size=8 * args.chunk, gradient_accumulation_steps=args.groups // args.chunk,
                max_completion_length=12, max_steps=args.steps, max_staleness=0, max_inflight_groups=args.groups,
                torch_num_threads=1, learning_rate=1e-4, eval_dataset=None, eval_num_prompts=1,
                save_model=False, streaming_min_groups=chunk, output_dir=str(root / name.replace("=", "_")),
                log_completions_steps=10**6, seed=0,
            )  # fmt: skip
            summary = run_local(config, progress=False)
            results[name] = summary
            print(f"{name:28s} {summary.steps_per_s:6.2f} steps/s   trainer idle {summary.trainer_idle_fraction:6.1%}")
    finally:
        server.stop()
    (a, b) = results.values()
    print(
        f"ratio streamed/whole: steps/s x{b.steps_per_s / a.steps_per_s:.2f}, "
        f"idle fraction x{b.trainer_idle_fraction / max(a.trainer_idle_fraction, 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
