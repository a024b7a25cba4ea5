"""cleanup through `python_func`: the staging folder goes, outputs stay, and the kubernetes backend is asked by run name."""

import sys
import types

import pytest
from kfp import dsl

from components import ASYNC_GRPO_IMAGE
from components.cleanup.component import cleanup
from components.train_grpo.component import train_grpo


def _status(state: str = "FAILED") -> dsl.PipelineTaskFinalStatus:
    return dsl.PipelineTaskFinalStatus(
        state=state,
        pipeline_job_resource_name="jobs/42",
        pipeline_task_name="grpo-run",
        error_code=None,
        error_message="train-grpo failed",
    )


def test_local_removes_only_the_staging_folder(tmp_path):
    run = tmp_path / "demo-1"
    (run / "staging" / "dataset").mkdir(parents=True)
    (run / "final-model").mkdir()
    (run / "final-model" / "config.json").write_text("{}")

    summary = cleanup.python_func(
        pipeline_status=_status(), launch_backend="local", run_name="demo-1", work_dir=str(tmp_path)
    )

    assert not (run / "staging").exists()
    assert (run / "final-model" / "config.json").is_file()
    assert summary == f"run demo-1 (FAILED): {run / 'staging'}"


def test_nothing_to_remove_is_not_an_error(tmp_path):
    summary = cleanup.python_func(
        pipeline_status=_status("SUCCEEDED"), launch_backend="local", pipeline_job_name="job-7", work_dir=str(tmp_path)
    )
    assert summary == "run job-7 (SUCCEEDED): nothing to remove"


def test_kubernetes_objects_are_deleted_by_the_same_run_name_train_grpo_uses(tmp_path, monkeypatch):
    calls = []

    class Backend:
        def __init__(self, settings=None, tracking=None, **options):
            calls.append(("init", {**(settings or {}), **options}))
            self.tracking = tracking  # the pipeline's MLflow runs, opened by a real backend once the policy allows

        def check(self, config):
            calls.append(("check", config.tracking.run_name))

        def cleanup(self, run_name):
            calls.append(("cleanup", run_name))
            return [f"deployment/{run_name}-vllm", f"pytorchjob/{run_name}"]

    module = types.ModuleType("async_grpo.launch.kubernetes")
    module.KubernetesBackend = Backend
    monkeypatch.setitem(sys.modules, "async_grpo.launch.kubernetes", module)

    job_id = "9b1d0c2e-0000-4000-8000-000000000000"
    summary = cleanup.python_func(
        pipeline_status=_status(),
        launch_backend="kubernetes",
        run_name="Nightly Run_3!",
        pipeline_job_id=job_id,
        backend_options={"namespace": "ml"},
    )

    # train_grpo names the run identically (its resolved run_name output); compare with a real call
    class Stop(Exception):
        pass

    def stop(self, config, timeout_s):
        assert self.tracking.run_name == config.tracking.run_name and not self.tracking.parent_run_id  # none yet
        raise Stop(config.tracking.run_name)

    module.KubernetesBackend.launch = stop
    with pytest.raises(Stop) as trained_as:
        train_grpo.python_func(
            dataset=dsl.Dataset(uri=str(tmp_path / "d"), name="d", metadata={"source": "builtin:add"}),
            model=dsl.Model(uri=str(tmp_path / "m"), name="m"),
            launch_backend="kubernetes",
            run_name="Nightly Run_3!",
            pipeline_job_id=job_id,
            mlflow_tracking_uri="sqlite:///unused.db",
        )
    assert calls == [
        ("init", {"namespace": "ml"}),
        ("cleanup", "nightly-run-3-9b1d0c2e"),
        ("init", {}),
        ("check", "nightly-run-3-9b1d0c2e"),
    ]
    assert str(trained_as.value) == "nightly-run-3-9b1d0c2e"
    assert summary == (
        "run nightly-run-3-9b1d0c2e (FAILED): deployment/nightly-run-3-9b1d0c2e-vllm, pytorchjob/nightly-run-3-9b1d0c2e"
    )


def test_two_runs_with_the_same_name_clean_up_only_their_own_staging(tmp_path):
    """The second run's exit handler (it failed early) leaves the first run's staged data alone."""
    first, second = "11111111-aaaa", "22222222-bbbb"
    for job in (first, second):
        (tmp_path / f"weekly-{job[:8]}" / "staging" / "dataset").mkdir(parents=True)
    summary = cleanup.python_func(
        pipeline_status=_status(),
        launch_backend="local",
        run_name="weekly",
        pipeline_job_id=second,
        work_dir=str(tmp_path),
    )
    assert not (tmp_path / "weekly-22222222" / "staging").exists()
    assert (tmp_path / "weekly-11111111" / "staging" / "dataset").is_dir()
    assert summary == f"run weekly-22222222 (FAILED): {tmp_path / 'weekly-22222222' / 'staging'}"


def test_unknown_backend_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="launch_backend='nomad'"):
        cleanup.python_func(pipeline_status=_status(), launch_backend="nomad", run_name="x")


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")  # the cluster image, ignored locally
def test_runs_as_the_exit_task_under_the_kfp_local_subprocess_runner(tmp_path):
    """The component as KFP runs it: the exit task of an ExitHandler whose body failed, its final status filled in
    by the local runner, its code in a subprocess from the IR. The staging folder goes; the outputs stay."""
    from kfp import local

    run = tmp_path / "demo-1"
    (run / "staging" / "dataset").mkdir(parents=True)
    (run / "final-model").mkdir()
    (run / "final-model" / "config.json").write_text("{}")

    @dsl.component(base_image=ASYNC_GRPO_IMAGE, install_kfp_package=False)
    def failing_body():
        raise RuntimeError("the run failed")

    @dsl.pipeline
    def body_then_cleanup(work_dir: str):
        with dsl.ExitHandler(cleanup(launch_backend="local", run_name="demo-1", work_dir=work_dir)):
            failing_body()

    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=False
    )
    body_then_cleanup(work_dir=str(tmp_path))

    assert not (run / "staging").exists()
    assert (run / "final-model" / "config.json").is_file()
