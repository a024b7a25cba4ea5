"""register_model through `python_func`, against a real MLflow sqlite store and registry."""

import mlflow
import pytest
from kfp import dsl
from mlflow import MlflowClient

from components.register_model.component import register_model

NAME = "tiny-reverser"


@pytest.fixture
def store(tmp_path):
    """A tracking URI and an experiment whose artifacts live in tmp_path."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp_id = mlflow.create_experiment("test", artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, exp_id


def _training_run(tmp_path, store, with_model: bool = True) -> str:
    uri, exp_id = store
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp_id) as run:
        if with_model:
            folder = tmp_path / f"model-{run.info.run_id}"
            folder.mkdir()
            (folder / "config.json").write_text("{}")
            mlflow.log_artifacts(str(folder), artifact_path="model")
    return run.info.run_id


def _metrics(tmp_path, reward: float | None) -> dsl.Metrics:
    m = dsl.Metrics(uri=str(tmp_path / "metrics"), name="metrics", metadata={})
    if reward is not None:
        m.log_metric("eval_reward", reward)
    return m


def _model(tmp_path) -> dsl.Model:
    return dsl.Model(
        uri=str(tmp_path / "model"), name="model", metadata={"run_name": "run-a", "base_model": "builtin:tiny"}
    )


def test_registers_versions_and_moves_the_champion_alias(tmp_path, store):
    uri, _ = store
    first_run, second_run = _training_run(tmp_path, store), _training_run(tmp_path, store)

    first = register_model.python_func(
        model=_model(tmp_path),
        metrics=_metrics(tmp_path, 0.25),
        mlflow_run_id=first_run,
        tracking_uri=uri,
        registered_model_name=NAME,
    )
    second = register_model.python_func(
        model=_model(tmp_path),
        metrics=_metrics(tmp_path, 0.5),
        mlflow_run_id=second_run,
        tracking_uri=uri,
        registered_model_name=NAME,
    )

    assert (first.model_version, second.model_version) == ("1", "2")
    assert second.model_uri == f"models:/{NAME}/2"
    client = MlflowClient(uri)
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert str(champion.version) == "2" and champion.run_id == second_run
    assert float(champion.tags["eval_reward"]) == 0.5 and champion.tags["kfp.run_name"] == "run-a"
    assert champion.source.endswith(f"{second_run}/artifacts/model")
    assert client.get_run(first_run).data.tags["registered_model_version"] == f"{NAME}/1"


def test_the_registered_transformers_model_loads_and_generates(tmp_path, store):
    """The trainer logs its final model with the transformers flavour (tracking.log_transformers_model); the
    registered version loads with mlflow.transformers.load_model and generates text."""
    from async_grpo.tiny_model import build_tiny_model
    from async_grpo.tracking import MODEL_URI_TAG, log_transformers_model

    uri, exp_id = store
    with mlflow.start_run(experiment_id=exp_id) as run:
        info = log_transformers_model(build_tiny_model(tmp_path / "final-model", seed=0))
        mlflow.set_tag(MODEL_URI_TAG, info.model_uri)
    out = register_model.python_func(
        model=_model(tmp_path),
        metrics=_metrics(tmp_path, 0.5),
        mlflow_run_id=run.info.run_id,
        tracking_uri=uri,
        registered_model_name=NAME,
    )
    version = MlflowClient(uri).get_model_version(NAME, out.model_version)
    assert version.source == info.model_uri and info.signature is not None  # MLflow's llm/v1/completions schema
    pipe = mlflow.transformers.load_model(out.model_uri)
    text = pipe("abc", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("abc") and len(text) > 3
    served = mlflow.pyfunc.load_model(out.model_uri).predict({"prompt": "abc", "max_tokens": 4})
    assert served[0]["object"] == "text_completion" and served[0]["usage"]["completion_tokens"] == 4


def test_a_run_without_model_artifact_is_refused(tmp_path, store):
    uri, _ = store
    run_id = _training_run(tmp_path, store, with_model=False)
    with pytest.raises(FileNotFoundError, match="logged no model"):
        register_model.python_func(
            model=_model(tmp_path),
            metrics=_metrics(tmp_path, 0.5),
            mlflow_run_id=run_id,
            tracking_uri=uri,
            registered_model_name=NAME,
        )
    assert MlflowClient(uri).search_model_versions(f"name = '{NAME}'") == []


def test_metrics_without_eval_reward_are_refused(tmp_path, store):
    uri, _ = store
    with pytest.raises(ValueError, match="no eval_reward"):
        register_model.python_func(
            model=_model(tmp_path),
            metrics=_metrics(tmp_path, None),
            mlflow_run_id=_training_run(tmp_path, store),
            tracking_uri=uri,
            registered_model_name=NAME,
        )


def test_lineage_tags_and_a_champion_that_moved_meanwhile(tmp_path, store):
    """Every version carries its lineage; a run evaluated against no champion (or another one) is registered but
    not promoted when the alias has moved since its evaluation."""
    uri, _ = store
    first_run, second_run = _training_run(tmp_path, store), _training_run(tmp_path, store)
    data = dsl.Dataset(
        uri=str(tmp_path / "data"), name="dataset",
        metadata={"resolved_uri": "/workspace/data/2026-11-26.jsonl", "train_digest": "ab" * 32, "eval_digest": "cd" * 32},
    )  # fmt: skip
    metrics = _metrics(tmp_path, 0.25)
    metrics.log_metric("mean_difference", 0.05)
    metrics.log_metric("ci_low", float("nan"))
    metrics.metadata.update(decision="register: no champion yet", champion_version="")
    first = register_model.python_func(
        model=_model(tmp_path), metrics=metrics, mlflow_run_id=first_run, tracking_uri=uri, registered_model_name=NAME,
        dataset=data, resolved_config="seed: 1\nlearning_rate: 0.1\n", kfp_run_id="kfp-123",
    )  # fmt: skip
    assert first.promoted
    client = MlflowClient(uri)
    tags = client.get_model_version(NAME, "1").tags
    assert tags["dataset.source"] == "/workspace/data/2026-11-26.jsonl" and tags["dataset.train_digest"] == "ab" * 32
    assert tags["kfp.run_id"] == "kfp-123" and tags["mlflow_run_id"] == first_run
    from async_grpo.lifecycle.lineage import config_digest

    assert tags["config_sha256"] == config_digest("learning_rate: 0.1\nseed: 1\n")  # key order does not matter
    assert float(tags["eval.mean_difference"]) == 0.05 and "eval.ci_low" not in tags  # NaN left out
    assert tags["eval.decision"] == "register: no champion yet" and tags["promoted_by"] == "pipeline:kfp-123"

    stale = _metrics(tmp_path, 0.5)
    stale.metadata.update(decision="register: no champion yet", champion_version="")  # evaluated before v1 existed
    second = register_model.python_func(
        model=_model(tmp_path), metrics=stale, mlflow_run_id=second_run, tracking_uri=uri, registered_model_name=NAME,
    )  # fmt: skip
    assert (second.model_version, second.promoted) == ("2", False)
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    assert client.get_model_version(NAME, "2").tags["promotion"].startswith("skipped")


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")  # the cluster image, ignored locally
def test_runs_under_the_kfp_local_subprocess_runner(tmp_path, store):
    """The component as KFP runs it: its artifacts arrive through importers (their metadata as `train_grpo` and
    `evaluate` write it), its code runs in a subprocess from the IR, and its outputs come back typed."""
    from kfp import local

    uri, _ = store
    run_id = _training_run(tmp_path, store)
    (tmp_path / "model").mkdir()
    (tmp_path / "metrics").write_text("{}")

    @dsl.pipeline
    def register_only(tracking_uri: str, mlflow_run_id: str) -> str:
        model = dsl.importer(
            artifact_uri=str(tmp_path / "model"),
            artifact_class=dsl.Model,
            metadata={"run_name": "run-a", "base_model": "builtin:tiny"},
        )
        metrics = dsl.importer(
            artifact_uri=str(tmp_path / "metrics"), artifact_class=dsl.Metrics, metadata={"eval_reward": 0.75}
        )
        task = register_model(
            model=model.output,
            metrics=metrics.output,
            mlflow_run_id=mlflow_run_id,
            tracking_uri=tracking_uri,
            registered_model_name=NAME,
        )
        return task.outputs["model_uri"]

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    run = register_only(tracking_uri=uri, mlflow_run_id=run_id)

    assert run.output == f"models:/{NAME}/1"
    champion = MlflowClient(uri).get_model_version_by_alias(NAME, "champion")
    assert str(champion.version) == "1" and champion.run_id == run_id
    assert float(champion.tags["eval_reward"]) == 0.75 and champion.tags["kfp.run_name"] == "run-a"
