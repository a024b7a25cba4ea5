"""Overlap efficiency of the async pipeline: vLLM and the trainer on disjoint cores of one machine.

vLLM's engine is bound to `--vllm-cores` (`VLLM_CPU_OMP_THREADS_BIND`, and its processes' affinity) and the trainer
(this process: torch threads, the orchestrator and the reward workers it spawns) to `--trainer-cores`
(`os.sched_setaffinity`, `torch_num_threads` = their count), so neither time-slices the other's cores. On one
workload (the builtin `add` task, `--prompts` x `--generations` completions of exactly `--max-completion` tokens:
`ignore_eos`), measured in this one run:

- t_gen: vLLM generating one step's completions, the trainer idle (median of `--reps`);
- t_train: one `GRPOLearner.step` on those completions, generation idle (median of `--reps`);
- t_step: the median seconds per step of the async pipeline (`run_local`, `max_staleness` `--staleness`, a weight
  push every step), from the MLflow timestamps of the steps after `--warmup`.

Prints overlap efficiency = (t_gen + t_train) / t_step (1.0: no overlap; the ideal is (t_gen + t_train) /
max(t_gen, t_train), 2.0 when the two are equal) and that efficiency as a fraction of the ideal. The defaults
make t_gen and t_train similar on a 2-core machine (tiny model); `--reduced` shrinks everything for CI.

On a GPU machine (`--device cuda`, the default when nvidia-smi lists one) vLLM gets `CUDA_VISIBLE_DEVICES=--vllm-gpu` and
the trainer `--trainer-gpu`: the same GPU (vLLM capped by `--gpu-memory-utilization`, weights pushed over gloo, as
NCCL refuses two ranks on one device) or two GPUs (NCCL push); both in bfloat16. `--shape qwen0.5b` builds a
Qwen2.5-0.5B-shaped Qwen2 from its config with random weights (and the tiny tokenizer): speed only.

    .venv/bin/python benchmarks/overlap.py [--steps 8 --warmup 2] [--vllm-cores 0 --trainer-cores 1] [--reduced]
    .venv/bin/python benchmarks/overlap.py --device cuda --shape qwen0.5b --vllm-gpu 0 --trainer-gpu 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def split_cores(vllm: str | None, trainer: str | None, *, reduced: bool = False) -> tuple[list[int], list[int]]:
    """The two disjoint core sets: as given ("0,1" or "0-3"), else the first half of this process's cores for vLLM
    and the rest for the trainer. `reduced` (CI's run, which checks that the script measures, not what it measures)
    on a single core with no sets given: both get that core, time-sliced (the test suite's workers own one core each).

    Raises:
        ValueError: overlapping or empty sets, or cores this process may not use.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if reduced and len(allowed) == 1 and not vllm and not trainer:
        return allowed, allowed

    def parse(text: str) -> list[int]:
        out: list[int] = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
        return out

    half = max(len(allowed) // 2, 1)
    v = parse(vllm) if vllm else allowed[:half]
    t = parse(trainer) if trainer else allowed[half:] or allowed[:1]
    if not v or not t or set(v) & set(t) or not set(v + t) <= set(allowed):
        raise ValueError(
            f"--vllm-cores {v} and --trainer-cores {t} must be disjoint, non-empty subsets of this "
            f"process's cores {allowed}. Fix: e.g. --vllm-cores 0 --trainer-cores 1."
        )
    return v, t


def time_generation(url: str, model: str, prompts: list[list[int]], args) -> tuple[float, list]:
    """Median seconds for vLLM to sample every prompt's group at once (one request per group, as the rollout
    sends), and the last round's completions."""
    from async_grpo.inference.client import AsyncVLLMClient

    async def one_round():
        client = AsyncVLLMClient(url, model)
        try:
            return await asyncio.gather(
                *(
                    client.generate(
                        p,
                        n=args.generations,
                        max_tokens=args.max_completion,
                        temperature=1.0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                )
            )
        finally:
            await client.aclose()

    asyncio.run(one_round())  # warm-up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        groups = asyncio.run(one_round())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), groups


def build_model(root: Path, args) -> Path:
    """The benchmark's model folder: the tiny-model builder at --hidden / --layers, or a Qwen2.5-0.5B-shaped Qwen2
    (random weights) with the tiny tokenizer."""
    from async_grpo.tiny_model import build_tiny_model, build_tiny_tokenizer

    if args.shape == "tiny":
        return build_tiny_model(
            root / "model",
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 32,
            num_kv_heads=max(args.hidden // 64, 1),
            intermediate_size=3 * args.hidden,
        )
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
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
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=None,
    )  # Qwen2.5-0.5B's shape
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


def time_training(model_path: Path, prompts: list[list[int]], groups: list, args, threads: int) -> float:
    """Median seconds of one trainer step (dapo, float32) on the generated completions."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from async_grpo.algorithms import LossSettings
    from async_grpo.trainer.trainer import GRPOLearner
    from async_grpo.transports.messages import RolloutGroup, TrainBatch

    torch.set_num_threads(threads)
    rng = random.Random(0)
    batch = TrainBatch(
        groups=[
            RolloutGroup(
                prompt_ids=p,
                completion_ids=[c.token_ids for c in comps],
                sampling_logprobs=[c.logprobs for c in comps],
                truncated=[False] * len(comps),
                completions=[c.text for c in comps],
                prompt="p",
                columns={},
                policy_version=0,
                advantages=[rng.uniform(-1, 1) for _ in comps],
            )
            for p, comps in zip(prompts, groups)
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(args.device)
    learner = GRPOLearner(
        model,
        learning_rate=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        micro_batch_size=args.micro,
        loss=LossSettings(max_completion_length=args.max_completion),
        pad_token_id=0,
        mixed_precision="bf16" if args.device == "cuda" else None,
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    learner.step(batch)  # warm-up
    times = []
    for _ in range(args.reps):
        sync()
        t0 = time.perf_counter()
        learner.step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_pipeline(model_path: Path, url: str, args, threads: int, out: Path) -> float:
    """Median seconds per step of the async pipeline on the same workload (steps after the warm-up)."""
    import mlflow

    from async_grpo.config import GRPOConfig
    from async_grpo.launch.local import run_local

    config = GRPOConfig(
        model_name_or_path=str(model_path), vllm_url=url, dataset="builtin:add",
        reward_funcs=["builtin:add_exact_match"], reward_num_workers=1, num_generations=args.generations,
        max_completion_length=args.max_completion, generation_kwargs={"ignore_eos": True},
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.prompts * args.generations // args.micro,
        loss_type="dapo", learning_rate=1e-5, max_steps=args.warmup + args.steps, max_staleness=args.staleness,
        torch_num_threads=threads, max_inflight_groups=args.prompts * (args.staleness + 1), eval_dataset=None,
        eval_num_prompts=1, save_model=False, output_dir=str(out), log_completions_steps=10**6, seed=0,
        vllm_max_model_len=512, bf16=args.device == "cuda", weight_sync_backend=args.push_backend,
    )  # fmt: skip
    summary = run_local(config, progress=False)
    mlflow.set_tracking_uri(summary.tracking_uri)
    history = sorted(mlflow.MlflowClient().get_metric_history(summary.run_id, "loss"), key=lambda m: m.step)
    stamps = [m.timestamp / 1000.0 for m in history][max(args.warmup - 1, 0) :]
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-cores", default=None, help='cores for vLLM, e.g. "0" or "0-3" (default: first half)')
    p.add_argument("--trainer-cores", default=None, help="cores for the trainer (default: the rest)")
    p.add_argument("--steps", type=int, default=8, help="timed pipeline steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed pipeline steps first")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of t_gen and t_train")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-completion", type=int, default=64)
    p.add_argument("--micro", type=int, default=16, help="completions per micro-batch")
    p.add_argument("--staleness", type=int, default=1, help="max_staleness of the pipeline (>= 1: async)")
    p.add_argument("--hidden", type=int, default=256, help="model width (heads of 32)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", choices=["tiny", "qwen0.5b"], default="tiny", help="tiny: --hidden / --layers")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when nvidia-smi lists a GPU")
    p.add_argument("--vllm-gpu", default="0", help="CUDA_VISIBLE_DEVICES of vLLM (--device cuda)")
    p.add_argument("--trainer-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the trainer (--device cuda)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of its GPU (default 0.35 when it shares the trainer's, else 0.85)",
    )
    p.add_argument("--reduced", action="store_true", help="tiny model, 2 prompts x 4, 16 tokens, 2 steps (CI)")
    args = p.parse_args()
    if args.reduced:
        args.prompts, args.generations, args.max_completion, args.micro = 2, 4, 16, 8
        args.steps, args.warmup, args.reps, args.hidden, args.layers = 2, 1, 1, 128, 2
    vllm_cores, trainer_cores = split_cores(args.vllm_cores, args.trainer_cores, reduced=args.reduced)
    if vllm_cores == trainer_cores:
        print(f"one core ({vllm_cores[0]}): vLLM and the trainer time-slice it, so the overlap ratio below says nothing "
              "about overlap (a --reduced check that the script still measures)", flush=True)  # fmt: skip
    if args.device is None:  # without initializing CUDA here: CUDA_VISIBLE_DEVICES is set per process below
        import shutil
        import subprocess

        smi = shutil.which("nvidia-smi")
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout if smi else ""
        args.device = "cuda" if "GPU" in listed else "cpu"
    gpu = args.device == "cuda"
    shared_gpu = gpu and args.vllm_gpu == args.trainer_gpu
    args.push_backend = "gloo" if not gpu or shared_gpu else "nccl"

    # vLLM first, with this process pinned to vLLM's cores (its processes inherit that affinity); then this
    # process moves to the trainer's cores before torch starts its threads
    os.sched_setaffinity(0, vllm_cores)
    from async_grpo.data import load_prompt_items
    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.tiny_model import build_tiny_tokenizer

    root = Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    model_path = build_model(root, args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(1)
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, vllm_cores))  # the multiprocess executor's binding
    env["OMP_NUM_THREADS"] = str(len(vllm_cores))  # the CPU build's in-process executor (build_server_command)
    extra = []
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = args.vllm_gpu
        share = args.gpu_memory_utilization or (0.35 if shared_gpu else 0.85)
        extra = ["--gpu-memory-utilization", str(share)]
    server = VLLMServer(
        build_server_command(
            str(model_path),
            port=port,
            dtype="bfloat16" if gpu else "float32",
            max_model_len=512,
            weight_transfer_backend=args.push_backend,
            extra_args=extra,
        ),
        env,
        root / "vllm.log",
        url,
        600.0,
    )
    server.start()
    os.sched_setaffinity(0, trainer_cores)
    if gpu:  # torch has not initialized CUDA in this process yet: the trainer sees only its GPU as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = args.trainer_gpu
    threads = len(trainer_cores)
    try:
        items, _ = load_prompt_items(
            build_tiny_tokenizer(), "builtin:add", "train", seed=0, max_prompt_length=256, limit=args.prompts
        )
        prompts = [item.prompt_ids for item in items]
        t_gen, groups = time_generation(url, str(model_path), prompts, args)
        t_train = time_training(model_path, prompts, groups, args, threads)
        t_step = time_pipeline(model_path, url, args, threads, root / "run")
    finally:
        server.stop()
    efficiency = (t_gen + t_train) / t_step
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    print(
        json.dumps(
            {
                "device": args.device,
                "vllm_gpu": args.vllm_gpu if gpu else None,
                "trainer_gpu": args.trainer_gpu if gpu else None,
                "weight_push": args.push_backend,
                "shape": args.shape,
                "vllm_cores": vllm_cores,
                "trainer_cores": trainer_cores,
                "completions_per_step": args.prompts * args.generations,
                "completion_tokens": args.max_completion,
                "model_hidden": args.hidden,
                "model_layers": args.layers,
                "max_staleness": args.staleness,
                "t_gen_s": t_gen,
                "t_train_s": t_train,
                "t_step_s": t_step,
            },
            indent=2,
        )
    )
    print(
        f"overlap efficiency (t_gen + t_train) / t_step: {efficiency:.2f} (ideal {ideal:.2f}); "
        f"{efficiency / ideal:.2f} of ideal"
    )


if __name__ == "__main__":
    main()
