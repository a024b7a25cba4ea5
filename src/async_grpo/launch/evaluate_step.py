"""The pipeline's evaluate step: the trained checkpoint against the registry's champion, head to head, on real vLLM
servers; the body of `components/evaluate` (whose module docstring tells the whole design), as a package function.

The order is the step's security contract: the run's backend and the platform policy's decision on the step's inputs
(`k8s_policy.check_step`) and, with the kubernetes backend, on the run (`KubernetesBackend.check`) come before the
step loads its MLflow credentials (`step_secrets.load_step_secrets`) or calls MLflow; the reward functions, submitter
code, run on Kubernetes in a reward pod without credentials (`KubernetesBackend.reward_service`), never here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import mlflow
import yaml
from transformers import AutoTokenizer

from async_grpo import step_secrets
from async_grpo.config import GRPOConfig
from async_grpo.data import load_prompt_items
from async_grpo.evaluation import score_held_out
from async_grpo.inference.client import AsyncVLLMClient
from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
from async_grpo.launch import k8s_policy
from async_grpo.launch.pipeline_step import check_backend
from async_grpo.lifecycle import registry
from async_grpo.lifecycle.promotion import decide, paired_bootstrap
from async_grpo.rewards.pool import RewardPool
from async_grpo.rewards.remote import RemoteRewardPool
from async_grpo.runner.builders import build_rollout, sampling_settings
from async_grpo.shared_volume import private_dir
from async_grpo.transports.weights.checkpoint import layout_difference, push_checkpoint
from async_grpo.transports.weights.sync import resolve_backend

logger = logging.getLogger(__name__)


class EvaluateStepResult(NamedTuple):
    """What the evaluate step decided and what its Metrics artifact records.

    Attributes:
        promote: register the model and make it champion (`promotion.decide`).
        metrics: the Metrics artifact's values, in logging order: `eval_reward`, the other held-out metrics without
            their `eval/` prefix, and with a champion `champion_eval_reward` and the head-to-head fields
            (`mean_difference`, `ci_low`, `ci_high`, `confidence`, `num_prompts`, `unpaired_prompts`; a field that is
            not finite is left out).
        decision: the gate's reason, one line.
        champion_version: the champion version scored against; "" for none.
    """

    promote: bool
    metrics: dict[str, float]
    decision: str
    champion_version: str


def run_evaluate_step(
    *,
    model_path: str,
    dataset_path: str,
    mlflow_run_id: str,
    tracking_uri: str,
    resolved_config: str,
    registered_model_name: str = "",
    min_eval_reward: float = 0.0,
    require_improvement: bool = True,
    min_improvement: float = 0.0,
    promotion_confidence: float = 0.95,
    champion_alias: str = "champion",
    num_prompts: int = 0,
    launch_backend: str = "local",
    backend_options: Mapping[str, Any] | None = None,
    run_name: str = "",
    mlflow_parent_run_id: str = "",
) -> EvaluateStepResult:
    """Score the model, and the registry's champion on the same prompts, on the held-out split; log both to MLflow
    and decide registration.

    Args:
        model_path: the `train_grpo` Model artifact's folder (an HF checkpoint).
        dataset_path: the `prepare_dataset` artifact's folder; its `eval` split is scored.
        mlflow_run_id, tracking_uri, resolved_config, registered_model_name, min_eval_reward, require_improvement,
            min_improvement, promotion_confidence, champion_alias, num_prompts, launch_backend, backend_options,
            run_name, mlflow_parent_run_id: the component's parameters of the same names (`components/evaluate`,
            whose docstring gives their meaning and what is logged where).

    Returns:
        The decision and the Metrics artifact's values (`EvaluateStepResult`).

    Raises:
        FileNotFoundError: the model folder holds no HF checkpoint.
        ValueError: no held-out prompt fits max_prompt_length, unknown launch_backend, or promotion_confidence
            outside (0, 1).
        RegistryError (a ValueError): the champion's registered files hold no HF checkpoint.
        PolicyViolation (a ValueError): the platform policy refuses the step or the run; decided before the step
            loads its MLflow credentials or calls MLflow.
        VLLMStartupError: vLLM did not come up (the message has the log tail).
        EvaluationError: every held-out group failed (the first error is chained).
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    config = GRPOConfig.model_validate(yaml.safe_load(resolved_config))
    check_backend(launch_backend)
    if not 0.0 < promotion_confidence < 1.0:
        raise ValueError(f"promotion_confidence={promotion_confidence} is not in (0, 1). Fix: use e.g. 0.95.")
    # The decision, before the credentials are loaded and before any call to MLflow or the cluster: in a cluster pod
    # the tracking URI and the registered model whose champion is read; with the kubernetes backend the whole run's
    # settings (`KubernetesBackend.check`, as `reward_service` judges them again).
    reads = [(registered_model_name, "compare against the champion of")] if registered_model_name else []
    k8s_policy.check_step("evaluate", launch_backend=launch_backend, tracking_uri=tracking_uri, registered_models=reads)
    backend = None
    if launch_backend == "kubernetes":
        from async_grpo.launch.kubernetes import EVAL_SERVICE_TIMEOUT_S, KubernetesBackend

        backend = KubernetesBackend(settings=dict(backend_options or {}))
        backend.check(config)
    step_secrets.load_step_secrets()  # the Secrets mounted as files: never in the container spec, where $(NAME) expands
    model_dir = Path(model_path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model artifact {model_dir} holds no HF checkpoint (config.json missing).")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items, too_long = load_prompt_items(
        tokenizer,
        dataset_path,
        "eval",
        seed=config.seed,
        max_prompt_length=config.data.max_prompt_length,
        limit=num_prompts or config.data.eval_num_prompts,
    )
    if too_long:
        logger.warning("%d held-out prompts are longer than max_prompt_length and were left out", too_long)

    # The champion this step serves and the vLLM logs go to a folder of the step's own, never the run's folder on the
    # tenant-writable volume, where a planted folder or link would be loaded or written through (the model artifact
    # is the train step's copy, made without following links: `async_grpo.shared_volume`)
    work = private_dir("evaluate")
    logger.info("the champion's download and the vLLM logs go to %s (removed once both are scored)", work)
    champion = None  # the registry's current champion (a ModelVersion), found before anything starts
    champion_dir = None
    if registered_model_name:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        champion = registry.champion(client, registered_model_name, champion_alias)
        if champion is not None and champion.run_id == mlflow_run_id:
            champion = None  # this very run is the champion already (a re-run of the step): nothing to compare
        if champion is not None and require_improvement:
            champion_dir = registry.resolve_model_uri(
                f"models:/{registered_model_name}/{champion.version}",
                work / f"champion-v{champion.version}",
                tracking_uri=tracking_uri,
            ).path
    logger.info(
        "champion: %s", f"{registered_model_name} version {champion.version}" if champion is not None else "none"
    )

    backend_name = resolve_backend(config.weight_sync.weight_sync_backend)  # the data plane the champion's push uses

    def server_for(path: Path, label: str) -> tuple[VLLMServer, str]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = build_server_command(
            str(path),
            port=port,
            dtype=config.inference.vllm_dtype,
            max_model_len=config.inference.vllm_max_model_len,
            weight_transfer_backend=backend_name,
            seed=config.seed,
            extra_args=config.vllm_serve_args,
        )
        env = server_env(config.inference.vllm_kv_cache_gib)
        return VLLMServer(cmd, env, work / f"vllm-eval-{label}.log", url, config.inference.vllm_startup_timeout_s), url

    tool_service = None  # tool calls (a run with `tools`) run where the reward functions run
    with contextlib.ExitStack() as stack:
        if backend is not None:  # kubernetes: reward code runs in a pod without credentials, checked by the policy
            reward_url, token = stack.enter_context(
                backend.reward_service(config, run_name or config.tracking.run_name or "async-grpo")
            )
            pool = RemoteRewardPool(
                reward_url,
                config.rewards.reward_timeout_s,
                config.rewards.reward_num_workers,
                token=token,
                connect_timeout_s=EVAL_SERVICE_TIMEOUT_S,
            )
            tool_service = (reward_url, token)
        else:
            pool = RewardPool.from_config(config)
        stack.callback(pool.close)
        rollout = build_rollout(
            config, pool, tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), items, tool_service
        )  # the run's own rollout: multi-turn when it declares tools
        stack.callback(rollout.close)  # `Rollout.close`: a no-op when it holds nothing

        def score(url: str, served: Path):
            return score_held_out(
                rollout,
                lambda: AsyncVLLMClient(url, str(served), timeout_s=config.inference.vllm_request_timeout_s), items,
                sampling_settings(config, evaluation=True), reward_names=pool.names, reward_weights=pool.weights,
                seed=config.seed,
            )  # fmt: skip

        held_out = None
        server, url = server_for(model_dir, "challenger")
        with server:  # one server at a time: a champion that needs its own starts after this one has stopped
            challenger = score(url, model_dir)
            if champion_dir is not None:
                differs = layout_difference(model_dir, champion_dir)
                if differs is None:
                    seconds = push_checkpoint(
                        champion_dir, url, vllm_dtype=config.inference.vllm_dtype, backend=backend_name,
                        timeout_s=config.weight_sync.weight_sync_timeout_s,
                    )  # fmt: skip
                    logger.info(
                        "the champion's weights are served by the challenger's server (pushed in %.2f s)", seconds
                    )
                    held_out = score(url, model_dir)
                else:
                    logger.info("the champion gets a server of its own: %s", differs)
        if champion_dir is not None and held_out is None:
            server, url = server_for(champion_dir, "champion")
            with server:
                held_out = score(url, champion_dir)
    shutil.rmtree(work, ignore_errors=True)  # both scored: the private champion copy and the logs go (kept on failure)
    reward = challenger.metrics["eval/reward"]
    logger.info(
        "held-out reward %.4f over %d prompts x %d samples", reward, len(items), config.data.num_generations_eval
    )
    head_to_head = None
    if held_out is not None:
        head_to_head = paired_bootstrap(
            challenger.per_prompt, held_out.per_prompt, confidence=promotion_confidence, seed=config.seed
        )
        logger.info("champion's held-out reward %.4f; %s", held_out.metrics["eval/reward"], head_to_head)
    decision = decide(
        reward,
        head_to_head,
        min_eval_reward=min_eval_reward,
        min_improvement=min_improvement,
        require_improvement=require_improvement,
    )
    logger.info("registration gate: %s", decision.reason)

    final = {"final_eval/" + k.removeprefix("eval/"): v for k, v in challenger.metrics.items()}
    if held_out is not None:
        final["final_eval/champion_reward"] = held_out.metrics["eval/reward"]
        final.update(head_to_head.as_metrics("final_eval/head_to_head/"))
    champion_version = str(champion.version) if champion is not None else ""
    tags = {"final_eval.decision": decision.reason, "final_eval.champion_version": champion_version}
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=mlflow_run_id):
        mlflow.log_metrics(final, step=config.batch.max_steps)
        rows = challenger.rows
        mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, artifact_file="final_eval/completions.json")
        mlflow.set_tags(tags)
    if mlflow_parent_run_id:  # the pipeline's layout: a nested run for this step, the summary on the parent
        from async_grpo.lifecycle import pipeline_tracking

        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        step_run = pipeline_tracking.open_step_run(client, mlflow_parent_run_id, "evaluate")
        with mlflow.start_run(run_id=step_run):
            mlflow.log_metrics(final, step=config.batch.max_steps)
            mlflow.set_tags(tags)
            if held_out is not None:
                table = {
                    "prompt": [str(item.prompt) for item in items],
                    "challenger": challenger.per_prompt,
                    "champion": held_out.per_prompt,
                    "difference": [a - b for a, b in zip(challenger.per_prompt, held_out.per_prompt, strict=True)],
                }
                mlflow.log_table(table, artifact_file="head_to_head/per_prompt.json")
        with mlflow.start_run(run_id=mlflow_parent_run_id):
            mlflow.log_metrics(final, step=config.batch.max_steps)
            mlflow.set_tags(tags)
    artifact_metrics = {"eval_reward": reward}
    artifact_metrics.update({k.removeprefix("eval/"): v for k, v in challenger.metrics.items() if k != "eval/reward"})
    if head_to_head is not None:
        artifact_metrics["champion_eval_reward"] = held_out.metrics["eval/reward"]
        for key in ("mean_difference", "ci_low", "ci_high", "confidence", "num_prompts", "unpaired_prompts"):
            value = float(getattr(head_to_head, key))
            if math.isfinite(value):  # no interval (fewer than 2 paired prompts): the decision says so
                artifact_metrics[key] = value
    return EvaluateStepResult(decision.promote, artifact_metrics, decision.reason, champion_version)
