"""What tracing costs the step loop: the demo's steps/s with episode traces on against off, in one invocation.

The demo config (`examples/tiny_cpu.yaml`: the tiny model, 8 groups of 8 per step, a weight push every step) runs
against one vLLM server started here, `--pairs` times with traces off and on, alternating which goes first so that a
drift of the machine (a busy neighbour, thermal) falls on both. "On" traces `--traces-per-step` groups every
`--traces-every` steps (default: every step, eight episodes each: ten times the demo's own setting), so the ratio
bounds what a user pays. No warm start (speed only: the model's outputs do not matter), the held-out evaluation on 8
prompts. Prints each run's steps/s (the step loop's, `RunSummary.steps_per_s`), the traces MLflow kept, and the
ratio of the medians, on/off, with the spread of the off runs as the noise.

    .venv/bin/python benchmarks/tracing.py [--steps 60 --pairs 3] [--traces-every 1] [--reduced]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"


def one_run(model: Path, url: str, out: Path, args: argparse.Namespace, traced: bool) -> tuple[float, int]:
    """One run of the demo config for `args.steps` steps; returns (steps/s of the step loop, traces MLflow kept)."""
    import mlflow

    from async_grpo.config import load_config
    from async_grpo.launch.local import run_local

    overrides = [
        f"model_name_or_path={model}", f"vllm_url={url}", f"output_dir={out}", f"max_steps={args.steps}",
        "warmup_sft_steps=0", "eval_num_prompts=8", "save_model=false", "log_plots_steps=0",
        f"log_traces_steps={args.traces_every if traced else 0}", f"log_traces_per_step={args.traces_per_step}",
    ]  # fmt: skip
    summary = run_local(load_config(EXAMPLE, overrides), progress=False)
    traces = mlflow.search_traces(run_id=summary.run_id, return_type="list") if traced else []
    return summary.steps_per_s, len(traces)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--pairs", type=int, default=3, help="runs with traces off and on, each")
    p.add_argument("--traces-every", type=int, default=1, help="log_traces_steps of the traced runs")
    p.add_argument("--traces-per-step", type=int, default=1, help="log_traces_per_step of the traced runs")
    p.add_argument("--reduced", action="store_true", help="CI size: 6 steps, one pair")
    args = p.parse_args(argv)
    if args.reduced:
        args.steps, args.pairs = 6, 1
    if min(args.steps, args.pairs, args.traces_every, args.traces_per_step) < 1:
        p.error("--steps, --pairs, --traces-every and --traces-per-step must be >= 1")

    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.tiny_model import build_tiny_model

    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = build_server_command(model, port=port, dtype="float32", max_model_len=512,
                                       weight_transfer_backend="gloo")  # fmt: skip
        with VLLMServer(command, server_env(1), Path(tmp) / "vllm.log", url, 400.0):
            for pair in range(args.pairs):
                for traced in (False, True) if pair % 2 == 0 else (True, False):
                    rate, kept = one_run(model, url, Path(tmp) / f"run-{pair}-{int(traced)}", args, traced)
                    rates[traced].append(rate)
                    label = "on " if traced else "off"
                    print(
                        f"pair {pair} traces {label}: {rate:.3f} steps/s" + (f", {kept} traces kept" if traced else "")
                    )
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    spread = (max(rates[False]) - min(rates[False])) / off if len(rates[False]) > 1 else float("nan")
    print(f"median steps/s: traces off {off:.3f}, on {on:.3f} ({args.steps} steps, {args.pairs} runs each)")
    print(f"ratio on/off: {on / off:.3f} (noise: the off runs span {100 * spread:.1f}% of their median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
