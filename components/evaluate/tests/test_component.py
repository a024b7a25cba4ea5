"""evaluate through `python_func` with a real vLLM server, real reward workers and a real MLflow store.

The checkpoint is the untrained tiny model and the floor is out of its reach, so the gate must say no; the metrics
must still land in the given MLflow run. The head-to-head path (a champion served by a second vLLM server) runs in
tests/pipelines/test_local_pipeline.py. The platform policy's refusals need no vLLM (they come first).
"""

import shutil

import mlflow
import pytest
from kfp import dsl
from mlflow import MlflowClient

from async_grpo.config import GRPOConfig, dump_config
from async_grpo.tiny_model import build_tiny_model
from components.evaluate.component import evaluate
from components.prepare_dataset.component import prepare_dataset

NAME = "tiny-reverser"


@pytest.mark.integration
@pytest.mark.slow(seconds=28)
def test_scores_with_vllm_logs_to_the_run_and_refuses_below_the_floor(child_pids, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp_id = mlflow.create_experiment("eval-test", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment(experiment_id=exp_id)  # as in the component's own process: no earlier test's experiment
    with mlflow.start_run(experiment_id=exp_id) as run:
        pass
    client = MlflowClient(uri)
    model, data = _artifacts(tmp_path)
    config = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        eval_num_prompts=8,
        num_generations_eval=2,
        max_completion_length=8,
        reward_num_workers=1,
        mlflow_tracking_uri=uri,
    )
    metrics = dsl.Metrics(uri=str(tmp_path / "metrics"), name="metrics", metadata={})
    before = child_pids()

    passed = evaluate.python_func(
        model=model,
        dataset=data,
        mlflow_run_id=run.info.run_id,
        tracking_uri=uri,
        resolved_config=dump_config(config),
        metrics=metrics,
        registered_model_name=NAME,  # not in the registry yet: no champion to compare with
        min_eval_reward=0.99,
    )

    assert passed is False
    assert child_pids() - before == set(), "vLLM or reward workers left running"
    reward = metrics.metadata["eval_reward"]
    assert 0.0 <= reward < 0.99
    assert "champion_eval_reward" not in metrics.metadata and metrics.metadata["champion_version"] == ""
    assert "below min_eval_reward 0.9900" in metrics.metadata["decision"]
    logged = client.get_run(run.info.run_id)
    assert logged.data.metrics["final_eval/reward"] == pytest.approx(reward)
    assert "final_eval/rewards/reverse_format/mean" in logged.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "final_eval/reward")] == [3]
    assert logged.data.tags["final_eval.decision"] == metrics.metadata["decision"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "final_eval")] == ["final_eval/completions.json"]


def _artifacts(tmp_path):
    model = dsl.Model(uri=str(tmp_path / "model-artifact"), name="model")
    shutil.copytree(build_tiny_model(tmp_path / "tiny", seed=0), model.path)
    data = dsl.Dataset(uri=str(tmp_path / "dataset-artifact"), name="dataset", metadata={})
    prepare_dataset.python_func(dataset_uri="builtin:reverse", dataset=data)
    return model, data


@pytest.mark.parametrize(
    "launch_backend, options, env, message",
    [
        (
            "kubernetes",
            {"reward_image": "docker.io/evil/reward:latest"},
            {},
            "reward_image='docker.io/evil/reward:latest'",
        ),
        ("kubernetes", {}, {}, "vllm_extra_args: flag '--trust-remote-code' is not allowed"),
        ("local", {}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "launch_backend='local' inside a cluster pod"),
    ],
)
def test_the_policy_refuses_before_vllm_or_reward_code_starts(
    tmp_path, monkeypatch, child_pids, launch_backend, options, env, message
):
    """On a cluster the reward functions run in a pod without credentials, after the policy said yes."""
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "policy.yaml"))
    (tmp_path / "policy.yaml").write_text("{}\n")  # the built-in defaults
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    model, data = _artifacts(tmp_path)
    config = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        vllm_extra_args=["--trust-remote-code"] if not options else [],
        mlflow_tracking_uri="http://mlflow:5000",
    )
    before = child_pids()
    with pytest.raises(ValueError, match=message):
        evaluate.python_func(
            model=model,
            dataset=data,
            mlflow_run_id="r",
            tracking_uri="http://mlflow:5000",
            resolved_config=dump_config(config),
            metrics=dsl.Metrics(uri=str(tmp_path / "m"), name="metrics", metadata={}),
            launch_backend=launch_backend,
            backend_options=options,
            run_name="run-1",
        )
    assert child_pids() - before == set()


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")  # the cluster image, ignored locally
def test_runs_under_the_kfp_local_subprocess_runner_and_its_refusal_reaches_the_user(tmp_path, monkeypatch, capfd):
    """The component as KFP runs it (artifacts through importers, code in a subprocess from the IR): inside a
    cluster pod the local backend is refused before any server starts, and the task fails with the reason."""
    from kfp import local

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # the component's subprocess inherits it
    model, data = _artifacts(tmp_path)
    config = dump_config(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri="http://mlflow:5000"))

    @dsl.pipeline
    def evaluate_only(resolved_config: str):
        evaluate(
            model=dsl.importer(artifact_uri=model.uri, artifact_class=dsl.Model).output,
            dataset=dsl.importer(artifact_uri=data.uri, artifact_class=dsl.Dataset).output,
            mlflow_run_id="r",
            tracking_uri="http://mlflow:5000",
            resolved_config=resolved_config,
            launch_backend="local",
            run_name="run-1",
        )

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    with pytest.raises(RuntimeError, match="evaluate"):
        evaluate_only(resolved_config=config)
    assert "launch_backend='local' inside a cluster pod" in "".join(capfd.readouterr())
