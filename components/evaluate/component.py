"""`evaluate`: the trained checkpoint against the current champion, head to head, served by real vLLM servers.

It starts its own `vllm serve` on the model artifact, so the number measures the checkpoint that will be registered
(not the trainer's in-memory weights). When the registry has a champion, the champion's registered weights are scored
on the same held-out prompts, with the same per-prompt seeds, sampling and reward functions, so each prompt gives one
paired difference: pushed into the same server through the weight-transfer plane when both checkpoints have the same
layout (`transports.weights.checkpoint`: one server start instead of two), else by a second `vllm serve` after the
first has stopped; the registration gate is the lower bound
of a bootstrap interval of their mean (`async_grpo.lifecycle.promotion`), decided here where both scores are known. The
pipeline only branches on the returned boolean (`dsl.If`). Reward functions are submitter code: on Kubernetes they
run in a reward pod of their own without credentials (`KubernetesBackend.reward_service`), never in this pod, which
holds the MLflow credentials and the launcher's ServiceAccount token.
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
    min_improvement: float = 0.0,
    promotion_confidence: float = 0.95,
    champion_alias: str = "champion",
    num_prompts: int = 0,
    launch_backend: str = "local",
    backend_options: Optional[dict] = None,
    run_name: str = "",
    mlflow_parent_run_id: str = "",
) -> bool:
    """Score the model, and the registry's champion on the same prompts, on the held-out split; decide registration.

    Sampling follows the run's config (`num_generations_eval` completions per prompt at `eval_temperature`, else
    `temperature`; prompt i sampled with seed `seed + i` for both models). Logged to the MLflow run `mlflow_run_id`
    at step `max_steps`: `final_eval/reward`, `final_eval/rewards/<func>/mean`, the completions as the table
    `final_eval/completions.json` and, with a champion, `final_eval/champion_reward` and
    `final_eval/head_to_head/<field>` (`promotion.HeadToHead`: both means, the mean paired difference, its interval,
    the number of paired prompts); tags `final_eval.decision` and `final_eval.champion_version`.

    Args:
        model: the `train_grpo` Model artifact (an HF checkpoint folder).
        dataset: the `prepare_dataset` artifact; its `eval` split is scored.
        mlflow_run_id: the training run to log into.
        tracking_uri: that run's MLflow tracking URI (its registry holds the champion).
        resolved_config: the run's resolved GRPOConfig YAML (`train_grpo` output).
        metrics: output Metrics artifact: `eval_reward`, per-function means and, with a champion,
            `champion_eval_reward`, `mean_difference`, `ci_low`, `ci_high`, `num_prompts`; metadata `decision` and
            `champion_version` (the version scored against, "" for none: `register_model` moves the alias only
            while it still points there).
        registered_model_name: the registry entry whose champion is the bar to beat; empty: no comparison. In a
            cluster pod it must be listed in the policy's `registered_models` (checked before the champion is read).
        min_eval_reward: the held-out reward must be at least this (an absolute floor).
        require_improvement: with a champion, promote only when the lower bound of the interval of the mean paired
            difference (challenger - champion) is above `min_improvement`; False: the floor alone decides.
        min_improvement: that margin, in reward units (0: any improvement the interval shows).
        promotion_confidence: the interval's confidence level, in (0, 1).
        champion_alias: registry alias naming the current best version.
        num_prompts: held-out prompts to score; 0 uses the config's `eval_num_prompts`.
        launch_backend: "local" scores in a process pool here (kfp.local, a laptop); "kubernetes" scores on
            a reward service this step starts for the purpose (objects `<run>-eval-*`, deleted at the end),
            reachable only from pods labelled `async-grpo/role: evaluate`, with a token of its own.
        backend_options: `ClusterSettings` fields (kubernetes only), as given to `train_grpo`.
        run_name: the run's name (`train_grpo`'s run_name output), for the reward service's objects.
        mlflow_parent_run_id: the pipeline run's MLflow parent run (`train_grpo`'s output; "" for none). The step then
            also opens its own nested run `evaluate` (the same metrics, the decision, and with a champion the
            per-prompt table `head_to_head/per_prompt.json`: prompt, challenger, champion, difference) and logs the
            `final_eval/*` metrics and the decision into the parent, which it marks FINISHED.

    Returns:
        True when the model should be registered and made champion (`promotion.decide`), else False.

    Raises:
        FileNotFoundError: the model artifact holds no HF checkpoint.
        ValueError: no held-out prompt fits max_prompt_length, unknown launch_backend, or promotion_confidence
            outside (0, 1).
        RegistryError (a ValueError): the champion's registered files hold no HF checkpoint.
        PolicyViolation (a ValueError): the platform policy refuses the run's images, settings or vLLM flags,
            or the local backend inside a cluster pod, or (in a cluster pod) `tracking_uri` outside
            `mlflow_tracking_uris` or `registered_model_name` outside `registered_models`; decided before the
            step loads its MLflow credentials or calls MLflow (`k8s_policy.check_step`).
        VLLMStartupError: vLLM did not come up (the message has the log tail).
        EvaluationError: every held-out group failed (generation or reward functions; the first error is chained).
        mlflow.exceptions.MlflowException: the run does not exist, or the registry is unreachable.
    """
    import logging

    from async_grpo.launch.evaluate_step import run_evaluate_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = run_evaluate_step(
        model_path=model.path, dataset_path=dataset.path, mlflow_run_id=mlflow_run_id, tracking_uri=tracking_uri,
        resolved_config=resolved_config, registered_model_name=registered_model_name, min_eval_reward=min_eval_reward,
        require_improvement=require_improvement, min_improvement=min_improvement,
        promotion_confidence=promotion_confidence, champion_alias=champion_alias, num_prompts=num_prompts,
        launch_backend=launch_backend, backend_options=backend_options, run_name=run_name,
        mlflow_parent_run_id=mlflow_parent_run_id,
    )  # fmt: skip
    for key, value in out.metrics.items():
        metrics.log_metric(key, value)
    metrics.metadata["decision"] = out.decision
    metrics.metadata["champion_version"] = out.champion_version
    return out.promote
