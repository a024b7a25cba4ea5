"""`evaluate`: held-out reward of the trained checkpoint, served by a real vLLM, logged to the training's MLflow run.

It starts its own `vllm serve` on the model artifact, so the number measures the checkpoint that
will be registered (not the trainer's in-memory weights), and it decides the registration gate
here, where both the new score and the current champion's score are known; the pipeline only
branches on the returned boolean (`dsl.If`). Reward functions are submitter code: on Kubernetes they
run in a reward pod of their own without credentials (`KubernetesBackend.reward_service`), never in
this pod, which holds the MLflow credentials and the launcher's ServiceAccount token.
"""

from typing import Optional

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components import ASYNC_GRPO_IMAGE


@dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
def evaluate(
    model: Input[Model],
    dataset: Input[Dataset],
    mlflow_run_id: str,
    tracking_uri: str,
    resolved_config: str,
    metrics: Output[Metrics],
    registered_model_name: str = "",
    min_eval_reward: float = 0.0,
    require_improvement: bool = True,
    champion_alias: str = "champion",
    num_prompts: int = 0,
    launch_backend: str = "local",
    backend_options: Optional[dict] = None,
    run_name: str = "",
) -> bool:
    """Score the model on the held-out split with vLLM and the run's reward functions; decide registration.

    Sampling follows the run's config (`num_generations_eval` completions per prompt at
    `eval_temperature`, else `temperature`; per-prompt seeds from `seed`). Metrics are logged to the
    MLflow run `mlflow_run_id` at step `max_steps` as `final_eval/reward` and
    `final_eval/rewards/<func>/mean`, with the completions as the table `final_eval/completions.json`.

    Args:
        model: the `train_grpo` Model artifact (an HF checkpoint folder).
        dataset: the `prepare_dataset` artifact; its `eval` split is scored.
        mlflow_run_id: the training run to log into.
        tracking_uri: that run's MLflow tracking URI (its registry is consulted too).
        resolved_config: the run's resolved GRPOConfig YAML (`train_grpo` output).
        metrics: output Metrics artifact: `eval_reward`, per-function means, and
            `previous_eval_reward` when a champion exists.
        registered_model_name: the registry entry whose champion is the bar to beat; empty skips it.
        min_eval_reward: the held-out reward must be at least this.
        require_improvement: when true, the reward must also be strictly above the champion's
            (its `eval_reward` tag); with no champion yet, the threshold alone decides.
        champion_alias: registry alias naming the current best version.
        num_prompts: held-out prompts to score; 0 uses the config's `eval_num_prompts`.
        launch_backend: "local" scores in a process pool here (kfp.local, a laptop); "kubernetes" scores on
            a reward service this step starts for the purpose (objects `<run>-eval-*`, deleted at the end),
            reachable only from pods labelled `async-grpo/role: evaluate`, with a token of its own.
        backend_options: `ClusterSettings` fields (kubernetes only), as given to `train_grpo`.
        run_name: the run's name (`train_grpo`'s run_name output), for the reward service's objects.

    Returns:
        True when the model should be registered (the gate above), else False.

    Raises:
        FileNotFoundError: the model artifact holds no HF checkpoint.
        ValueError: no held-out prompt fits max_prompt_length, or unknown launch_backend.
        PolicyViolation (a ValueError): the platform policy refuses the run's images, settings or vLLM flags,
            or the local backend inside a cluster pod.
        VLLMStartupError: vLLM did not come up (the message has the log tail).
        EvaluationError: every held-out group failed (generation or reward functions; the first error is chained).
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    import contextlib
    import logging
    import tempfile
    from pathlib import Path

    import mlflow
    import yaml
    from mlflow.exceptions import MlflowException
    from transformers import AutoTokenizer

    from async_grpo.config import GRPOConfig
    from async_grpo.data import load_prompt_items
    from async_grpo.evaluation import evaluate_reward
    from async_grpo.inference.client import AsyncVLLMClient
    from async_grpo.inference.server import VLLMServer, build_server_command, free_port, server_env
    from async_grpo.launch.k8s_policy import check_backend_choice
    from async_grpo.rewards.pool import RewardPool
    from async_grpo.rewards.remote import RemoteRewardPool
    from async_grpo.runner.builders import build_rollout, sampling_settings
    from async_grpo.transports.weights.sync import resolve_backend

    log = logging.getLogger("evaluate")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    config = GRPOConfig.model_validate(yaml.safe_load(resolved_config))
    check_backend_choice(launch_backend)
    if launch_backend not in ("local", "kubernetes"):
        raise ValueError(f"launch_backend={launch_backend!r} is not one of 'local', 'kubernetes'.")
    model_dir = Path(model.path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model artifact {model_dir} holds no HF checkpoint (config.json missing).")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items, too_long = load_prompt_items(
        tokenizer,
        dataset.path,
        "eval",
        seed=config.seed,
        max_prompt_length=config.data.max_prompt_length,
        limit=num_prompts or config.data.eval_num_prompts,
    )
    if too_long:
        log.warning("%d held-out prompts are longer than max_prompt_length and were left out", too_long)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = Path(config.output_dir) if Path(config.output_dir).is_dir() else Path(tempfile.mkdtemp())
    cmd = build_server_command(
        str(model_dir),
        port=port,
        dtype=config.inference.vllm_dtype,
        max_model_len=config.inference.vllm_max_model_len,
        weight_transfer_backend=resolve_backend(config.weight_sync.weight_sync_backend),
        seed=config.seed,
        extra_args=config.vllm_serve_args,
    )
    server = VLLMServer(
        cmd,
        server_env(config.inference.vllm_kv_cache_gib),
        log_dir / "vllm-eval.log",
        url,
        config.inference.vllm_startup_timeout_s,
    )
    tool_service = None  # tool calls (a run with `tools`) run where the reward functions run
    with contextlib.ExitStack() as stack:
        if launch_backend == "kubernetes":  # reward code runs in a pod without credentials, checked by the policy
            from async_grpo.launch.kubernetes import EVAL_SERVICE_TIMEOUT_S, KubernetesBackend

            backend = KubernetesBackend(settings=dict(backend_options or {}))
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
        if hasattr(rollout, "close"):
            stack.callback(rollout.close)
        stack.callback(server.stop)
        server.start()
        scores, rows = evaluate_reward(
            rollout,
            lambda: AsyncVLLMClient(url, str(model_dir), timeout_s=config.inference.vllm_request_timeout_s), items,
            sampling_settings(config, evaluation=True), reward_names=pool.names, reward_weights=pool.weights,
            seed=config.seed,
        )  # fmt: skip
    reward = scores["eval/reward"]
    log.info("held-out reward %.4f over %d prompts x %d samples", reward, len(items), config.data.num_generations_eval)

    previous = None
    if registered_model_name:
        registry = mlflow.MlflowClient(tracking_uri=tracking_uri)
        try:
            champion = registry.get_model_version_by_alias(registered_model_name, champion_alias)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            champion = None
        if champion is not None and "eval_reward" in champion.tags:
            previous = float(champion.tags["eval_reward"])
    if reward < min_eval_reward:
        passed, decision = False, f"skip: reward {reward:.4f} is below min_eval_reward {min_eval_reward:.4f}"
    elif require_improvement and previous is not None and not reward > previous:
        passed, decision = False, f"skip: reward {reward:.4f} does not beat the {champion_alias} ({previous:.4f})"
    else:
        passed, decision = (
            True,
            f"register: reward {reward:.4f}"
            + (f" beats the {champion_alias} ({previous:.4f})" if previous is not None else ""),
        )
    log.info("registration gate: %s", decision)

    final = {"final_eval/" + k.removeprefix("eval/"): v for k, v in scores.items()}
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=mlflow_run_id):
        mlflow.log_metrics(final, step=config.optim.max_steps)
        mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, artifact_file="final_eval/completions.json")
        mlflow.set_tag("final_eval.decision", decision)
    metrics.log_metric("eval_reward", reward)
    for key, value in scores.items():
        if key != "eval/reward":
            metrics.log_metric(key.removeprefix("eval/"), value)
    if previous is not None:
        metrics.log_metric("previous_eval_reward", previous)
    metrics.metadata["decision"] = decision
    return passed
