"""A warm-started model saved as a Hugging Face folder: the policy a run would start GRPO from, without the run.

`GRPORecipe.setup` warm-starts the policy in memory (`builders.warm_start`: `warmup_sft_steps` supervised steps on a
builtin task's reference answers). `save_warm_started_model` does exactly that outside a run and saves the result,
so that it can serve as a fixed starting point shared by several runs (the time-to-reward benchmark's) or as a
teacher for on-policy distillation (`async-grpo make-tiny-model DIR --sft-steps N`: the tiny model trained longer on
the task; examples/distill_cpu.yaml).
"""

from __future__ import annotations

import time
from pathlib import Path

from async_grpo.config import GRPOConfig

__all__ = ["save_warm_started_model"]


def save_warm_started_model(config: GRPOConfig, folder: str | Path) -> tuple[Path, dict[str, float]]:
    """Build the policy of `config` (`builtin:tiny` is built under `<output_dir>/tiny-model` with the config's seed),
    load it in float32 (`builders.load_policy`), seed torch with `config.seed`, run the supervised warm start on the
    config's own torch threads (`warmup_sft_steps` AdamW steps at `warmup_sft_learning_rate` on the builtin task's
    answers; none when `warmup_sft_steps` is 0), and save the model and its tokenizer to `folder`.

    Args:
        config: the run config whose model, dataset (a builtin task when `warmup_sft_steps` > 0), seed and warm
            start are used.
        folder: where the Hugging Face folder is written (created; files in it are replaced).

    Returns:
        (folder, metrics): the `warmup/*` metrics of `builders.warm_start` (`warmup/sft_loss`,
        `warmup/heldout_sequence_accuracy`, ...) plus `warmup/seconds` (wall-clock seconds of build, warm start and
        save), `warmup/steps` and `warmup/learning_rate`.

    Raises:
        ValueError: a model folder that is not one, or `warmup_sft_steps` > 0 on a dataset that is not a builtin task
            (`builders.check_warm_start`).
    """
    import torch
    from transformers import AutoTokenizer

    from async_grpo.runner import builders

    t0 = time.perf_counter()
    builders.check_warm_start(config)
    if config.compute.torch_num_threads:
        torch.set_num_threads(config.compute.torch_num_threads)
    base = builders.resolve_model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=config.trust_remote_code)
    torch.manual_seed(config.seed)
    model = builders.load_policy(config, base)
    metrics = dict(builders.warm_start(config, model, tokenizer, []) or {})
    out = Path(folder)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    metrics["warmup/seconds"] = time.perf_counter() - t0
    metrics["warmup/steps"] = float(config.data.warmup_sft_steps)
    metrics["warmup/learning_rate"] = config.data.warmup_sft_learning_rate
    return out, metrics
