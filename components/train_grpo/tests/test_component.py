"""train_grpo through `python_func`, against a recording launch backend.

The backend double stands in for `async_grpo.launch.kubernetes` (the component imports it lazily, by
name), records the GRPOConfig it is handed, and finishes like a real run: an MLflow run in a real
sqlite store and an HF-style checkpoint folder. The local backend's real run is covered by
tests/pipelines/test_local_pipeline.py.
"""

import sys
import types
from pathlib import Path

import datasets
import mlflow
import pytest
import yaml
from kfp import dsl

from async_grpo.config import ConfigError, GRPOConfig
from async_grpo.launch.base import LaunchResult
from components.train_grpo.component import train_grpo

BASE_YAML = (
    "max_steps: 5\nlearning_rate: 0.1\ntorch_num_threads: 1\nnum_generations: 4\nper_device_train_batch_size: 8\n"
)


class RecordingBackend:
    """Records constructor options and launches; each launch makes a real MLflow run and a checkpoint folder."""

    instances: list["RecordingBackend"] = []
    save_checkpoint = True

    def __init__(self, settings=None, tracking=None, **options):
        self.options = {**(settings or {}), **options}
        self.tracking = tracking  # the pipeline's MLflow runs (PipelineRun), opened at launch
        self.launches: list[tuple[GRPOConfig, float]] = []
        self.checked: GRPOConfig | None = None
        RecordingBackend.instances.append(self)

    def check(self, config: GRPOConfig) -> None:
        """The policy gate (the real one is tested in tests/launch); recorded, so its order can be asserted."""
        self.checked = config

    def launch(self, config: GRPOConfig, *, timeout_s: float) -> LaunchResult:
        assert self.checked is config, "the policy must be checked before the launch"
        self.launches.append((config, timeout_s))
        mlflow.set_tracking_uri(config.tracking_uri)
        mlflow.set_experiment(
            config.tracking.mlflow_experiment_name
        )  # not whatever experiment an earlier test left active
        run_id = None
        if self.tracking is not None:
            run_id = self.tracking.create_run(config.tracking_uri, "", config.tracking.run_name)
        with mlflow.start_run(run_id=run_id, run_name=None if run_id else config.tracking.run_name) as run:
            mlflow.log_param("max_steps", config.batch.max_steps)
        model_dir = Path(config.output_dir) / "final-model"
        if self.save_checkpoint:
            model_dir.mkdir(parents=True)
            (model_dir / "config.json").write_text("{}")
            (model_dir / "model.safetensors").write_bytes(b"weights")
        return LaunchResult(
            run.info.run_id,
            config.tracking_uri,
            str(model_dir) if self.save_checkpoint else None,
            {"after/eval/reward": 0.5},
        )


@pytest.fixture
def backend_module(monkeypatch):
    RecordingBackend.instances.clear()
    module = types.ModuleType("async_grpo.launch.kubernetes")
    module.KubernetesBackend = RecordingBackend
    monkeypatch.setitem(sys.modules, "async_grpo.launch.kubernetes", module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return RecordingBackend.instances


def _dataset(tmp_path, source: str) -> dsl.Dataset:
    art = dsl.Dataset(uri=str(tmp_path / "artifacts" / "dataset"), name="dataset", metadata={"source": source})
    rows = {"prompt": ["reverse: abc\n", "reverse: hello\n"], "answer": ["cba", "olleh"]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "eval": datasets.Dataset.from_dict(rows)}
    ).save_to_disk(art.path)
    return art


def _model(tmp_path) -> dsl.Model:
    return dsl.Model(uri=str(tmp_path / "artifacts" / "model"), name="model", metadata={})


def test_precedence_staging_and_outputs(tmp_path, backend_module):
    work = tmp_path / "work"
    model = _model(tmp_path)
    out = train_grpo.python_func(
        dataset=_dataset(tmp_path, "builtin:reverse"), model=model, config_yaml=BASE_YAML, max_steps=7,
        extra_overrides=["learning_rate=0.01"], launch_backend="kubernetes", launch_timeout_s=123.0,
        backend_options={"namespace": "ml"}, work_dir=str(work), run_name="My Run_1",
        pipeline_job_id="3f2a9c1e-77aa-4b1e-9d2c-0123456789ab", mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )  # fmt: skip

    (backend,) = backend_module
    ((config, timeout_s),) = backend.launches
    assert backend.options == {"namespace": "ml"} and timeout_s == 123.0
    assert config.batch.max_steps == 7  # the typed knob beats config_yaml
    assert config.optim.learning_rate == 0.01  # extra_overrides beat both
    assert config.compute.torch_num_threads == 1 and config.sampling.num_generations == 4  # config_yaml fills the rest
    assert config.tracking.run_name == "my-run-1-3f2a9c1e" and out.run_name == "my-run-1-3f2a9c1e"  # + the KFP run id
    assert config.output_dir == str(work / "my-run-1-3f2a9c1e")
    assert config.data.dataset == "builtin:reverse"  # kept for the warm start
    staged = work / "my-run-1-3f2a9c1e" / "staging" / "dataset"
    assert config.data.eval_dataset == str(staged)
    assert len(datasets.load_from_disk(str(staged))["eval"]) == 2

    assert GRPOConfig.model_validate(yaml.safe_load(out.resolved_config)) == config
    assert (Path(model.path) / "model.safetensors").read_bytes() == b"weights"
    assert model.metadata["mlflow_run_id"] == out.mlflow_run_id
    assert model.metadata["after/eval/reward"] == 0.5 and model.metadata["launch_backend"] == "kubernetes"
    client = mlflow.MlflowClient(out.tracking_uri)
    run = client.get_run(out.mlflow_run_id)
    assert run.data.tags["kfp.run_name"] == "my-run-1-3f2a9c1e"
    # the pipeline's MLflow layout: a parent run per pipeline run (flat config params), the training run nested in it
    parent = client.get_run(out.mlflow_parent_run_id)
    assert run.data.tags["mlflow.parentRunId"] == out.mlflow_parent_run_id and run.info.run_name == "train"
    assert parent.info.run_name == "my-run-1-3f2a9c1e" and parent.data.tags["kfp.run_id"].startswith("3f2a9c1e")
    assert parent.data.params["max_steps"] == "7" and parent.data.params["learning_rate"] == "0.01"
    assert parent.data.tags["mlflow_run_id.train"] == out.mlflow_run_id


def test_a_file_dataset_is_trained_from_the_staged_copy(tmp_path, backend_module):
    work = tmp_path / "work"
    train_grpo.python_func(
        dataset=_dataset(tmp_path, "/data/prompts.jsonl"),
        model=_model(tmp_path),
        config_yaml=BASE_YAML,
        launch_backend="kubernetes",
        work_dir=str(work),
        pipeline_job_name="grpo-pipeline-20260101",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )

    ((config, _),) = backend_module[0].launches
    staged = str(work / "grpo-pipeline-20260101" / "staging" / "dataset")
    assert config.data.dataset == staged and config.data.eval_dataset == staged


def test_cluster_secret_uri_applies_only_when_nothing_else_is_set(tmp_path, backend_module, monkeypatch):
    secret_uri = f"sqlite:///{tmp_path / 'from-secret.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret_uri)
    out = train_grpo.python_func(
        dataset=_dataset(tmp_path, "builtin:reverse"),
        model=_model(tmp_path),
        config_yaml=BASE_YAML,
        launch_backend="kubernetes",
        work_dir=str(tmp_path / "w"),
    )
    assert (
        backend_module[0].launches[0][0].tracking.mlflow_tracking_uri == secret_uri and out.tracking_uri == secret_uri
    )

    explicit = f"sqlite:///{tmp_path / 'explicit.db'}"
    train_grpo.python_func(
        dataset=_dataset(tmp_path / "2", "builtin:reverse"),
        model=_model(tmp_path / "2"),
        config_yaml=BASE_YAML,
        launch_backend="kubernetes",
        work_dir=str(tmp_path / "w2"),
        mlflow_tracking_uri=explicit,
    )
    assert backend_module[1].launches[0][0].tracking.mlflow_tracking_uri == explicit


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_generations": 1}, ConfigError, "num_generations"),
        ({"extra_overrides": ["save_model=false"]}, ConfigError, "save_model"),
        ({"extra_overrides": ["no_such_field=1"]}, ConfigError, "unknown config field"),
        ({"config_yaml": "- a list"}, ConfigError, "YAML mapping"),
        ({"launch_backend": "slurm"}, ValueError, "launch_backend='slurm'"),
    ],
)
def test_bad_inputs_fail_before_anything_launches(tmp_path, backend_module, kwargs, error, match):
    args = {"config_yaml": BASE_YAML, "launch_backend": "kubernetes", "work_dir": str(tmp_path / "w"), **kwargs}
    with pytest.raises(error, match=match):
        train_grpo.python_func(dataset=_dataset(tmp_path, "builtin:reverse"), model=_model(tmp_path), **args)
    assert all(not b.launches for b in backend_module)


def test_the_local_backend_is_refused_inside_a_cluster_pod(tmp_path, backend_module, monkeypatch):
    """There it would run the submitter's reward code beside the pipeline's credentials and SA token."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "policy.yaml"))
    (tmp_path / "policy.yaml").write_text("user_code_with_credentials: false\n")
    with pytest.raises(ValueError, match="launch_backend='local' inside a cluster pod"):
        train_grpo.python_func(
            dataset=_dataset(tmp_path, "builtin:reverse"),
            model=_model(tmp_path),
            config_yaml=BASE_YAML,
            launch_backend="local",
            work_dir=str(tmp_path / "w"),
        )


def test_a_run_without_checkpoint_is_an_error(tmp_path, backend_module, monkeypatch):
    monkeypatch.setattr(RecordingBackend, "save_checkpoint", False)
    with pytest.raises(RuntimeError, match="no HF checkpoint"):
        train_grpo.python_func(
            dataset=_dataset(tmp_path, "builtin:reverse"),
            model=_model(tmp_path),
            config_yaml=BASE_YAML,
            launch_backend="kubernetes",
            work_dir=str(tmp_path / "w"),
            mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        )


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")  # the cluster image, ignored locally
def test_runs_under_the_kfp_local_subprocess_runner_and_its_refusal_reaches_the_user(tmp_path, monkeypatch, capfd):
    """The component as KFP runs it (the dataset through an importer, every typed knob as the pipeline passes it,
    the code in a subprocess from the IR): inside a cluster pod the local backend is refused before anything
    launches, and the task fails with the reason. The whole local run is tests/pipelines/test_local_pipeline.py."""
    from kfp import local

    from pipelines.grpo_pipeline import TYPED_KNOBS, knob_defaults

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # the component's subprocess inherits both
    monkeypatch.setenv("ASYNC_GRPO_POLICY_FILE", str(tmp_path / "policy.yaml"))
    (tmp_path / "policy.yaml").write_text("user_code_with_credentials: false\n")
    data = _dataset(tmp_path, "builtin:reverse")
    knobs = {k: v for k, v in knob_defaults(gpu=False).items() if k in TYPED_KNOBS}

    @dsl.pipeline
    def train_only(work_dir: str):
        train_grpo(
            dataset=dsl.importer(artifact_uri=data.uri, artifact_class=dsl.Dataset, metadata=data.metadata).output,
            config_yaml=BASE_YAML,
            launch_backend="local",
            work_dir=work_dir,
            **knobs,
        )

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    with pytest.raises(RuntimeError, match="train-grpo"):
        train_only(work_dir=str(tmp_path / "w"))
    assert "launch_backend='local' inside a cluster pod" in "".join(capfd.readouterr())
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").rglob("*.yaml"))  # nothing was launched
