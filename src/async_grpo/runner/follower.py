"""Trainer ranks > 0: join the process group, take rank 0's weights, then execute rank 0's commands.

A follower never talks to vLLM, the reward workers or MLflow: it builds the same learner as rank 0 and runs
`trainer.distributed.follow`, which dispatches the typed commands of `transports.ranks` until `Stop`.
"""

from __future__ import annotations

import logging

from async_grpo.config import GRPOConfig
from async_grpo.runner import builders
from async_grpo.trainer.distributed import DistInfo, broadcast_parameters, follow

logger = logging.getLogger(__name__)


def run_follower(config: GRPOConfig, info: DistInfo) -> int:
    """Train on the shares rank 0 broadcasts until it says stop; returns the optimizer steps taken.

    Raises:
        RuntimeError / DistBackendError: rank 0 died or a collective timed out (torchrun then ends the job).
    """
    from transformers import AutoTokenizer

    from async_grpo.data import load_prompt_dataset

    builders.seed_trainer(config)
    model_path = builders.follower_model_path(config)
    model = builders.load_policy(config, model_path, weights=False)
    model.to(info.device)
    broadcast_parameters(model)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
    if config.batch.max_steps == -1:  # the same step count as rank 0, for the same learning-rate schedule
        options = {k: v for k, v in builders.dataset_options(config, "train").items() if k != "chat_template_kwargs"}
        rows = len(load_prompt_dataset(config.data.dataset, split="train", seed=config.seed, **options))
        config = builders.with_epochs_resolved(config, rows, info.world_size)
    steps = follow(builders.build_local_learner(config, model, tokenizer.pad_token_id), info)
    logger.info("trainer rank %d: %d steps", info.rank, steps)
    return steps
