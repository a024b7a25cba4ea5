"""MLflow tracking as its users expect: MLFLOW_* environment variables (KFP's MLflow integration), a writer that
never blocks a step and survives an outage (counted, reported), the dataset as a run input, report_to none."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest

from async_grpo.config import GRPOConfig
from async_grpo.tracking import Tracker

# what `Tracker.stats` says after a run in which every record was written
CLEAN_STATS = {"failed": 0, "dropped": 0, "pending": 0, "retries": 0, "traces_written": 0, "traces_dropped": 0}


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # an explicit sqlite URI keeps MLflow's default artifact root, ./mlruns of the cwd
    return uri


def test_environment_wins_over_defaults_and_an_injected_run_id_is_continued(tmp_path, store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    config = GRPOConfig(output_dir=str(tmp_path / "run"))
    assert config.tracking_uri == store  # mlflow_tracking_uri unset: the environment's
    first = Tracker(config)
    first.log_metrics({"loss": 1.5}, step=1)
    first.end()
    client = mlflow.MlflowClient(store)
    assert client.get_experiment(client.get_run(first.run_id).info.experiment_id).name == "from-env"
    # KFP 2.17 opens the task's run and injects its id: the trainer logs into it
    monkeypatch.setenv("MLFLOW_RUN_ID", first.run_id)
    second = Tracker(config)
    assert second.run_id == first.run_id
    second.log_metrics({"loss": 0.5}, step=2)
    second.end()
    assert [m.value for m in client.get_metric_history(first.run_id, "loss")] == [1.5, 0.5]
    explicit = GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_experiment_name="mine")
    from async_grpo.tracking import experiment_name

    assert experiment_name(explicit) == "mine"  # a name the user chose wins over the environment


def test_a_tracking_outage_never_blocks_a_step_and_loses_no_record_once_the_server_is_back(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store))
    back = threading.Event()
    real = tracker._client.log_batch
    calls = []

    def down_until_back(*args, **kwargs):
        calls.append(back.is_set())
        if not back.is_set():
            raise ConnectionError("tracking server down")
        return real(*args, **kwargs)

    tracker._client.log_batch = down_until_back
    t0 = time.perf_counter()
    for step in range(50):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert time.perf_counter() - t0 < 0.5  # never waited for MLflow
    time.sleep(2.5)  # the server stays down: the write (the 50 records, merged) is tried again
    assert calls.count(False) >= 2 and not mlflow.MlflowClient(store).get_metric_history(tracker.run_id, "loss")
    back.set()
    tracker.end(timeout_s=60)
    history = mlflow.MlflowClient(store).get_metric_history(tracker.run_id, "loss")
    assert [m.step for m in history] == list(range(50))  # every record, in order
    assert calls.count(True) == 1  # the backlog went in one log_batch, not one per step
    assert tracker.stats["failed"] == 0 and tracker.stats["dropped"] == 0 and tracker.stats["retries"] >= 2


def test_metrics_mlflow_had_not_taken_travel_in_the_checkpoint_and_the_resumed_run_writes_them_once(tmp_path, store):
    from async_grpo.runner.state import TrainState, load_checkpoint, save_checkpoint

    config = GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store)
    killed = Tracker(config)
    real = killed._client.log_batch
    written = threading.Event()

    def down_after_step_1(run_id, metrics, *args, **kwargs):
        if all(m.step == 1 for m in metrics) and not written.is_set():
            real(run_id, metrics, *args, **kwargs)  # step 1 goes in; then the server goes down
            written.set()
            return
        raise ConnectionError("tracking server down")

    killed._client.log_batch = down_after_step_1
    killed.log_metrics({"loss": 1.0}, step=1)
    assert written.wait(10)
    for step in (2, 3):
        killed.log_metrics({"loss": float(step), "reward": 0.5}, step=step)
    deadline = time.monotonic() + 10
    while len(killed.unlogged_metrics()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    pending = killed.unlogged_metrics()
    assert sorted((r["key"], r["step"]) for r in pending) == [("loss", 2), ("loss", 3), ("reward", 2), ("reward", 3)]
    save_checkpoint(TrainState(step=3, unlogged_metrics=pending), tmp_path / "checkpoint-3")
    killed.end(timeout_s=0.5)  # the trainer is gone before MLflow came back: steps 2 and 3 never reached it
    state = load_checkpoint(tmp_path / "checkpoint-3")  # weights_only: the records are plain values
    resumed = Tracker(config, run_id=killed.run_id)
    resumed.resubmit_metrics(state.unlogged_metrics)
    resumed.resubmit_metrics(state.unlogged_metrics[:2])  # written twice (e.g. taken just before the kill): stored once
    resumed.end(timeout_s=30)
    client = mlflow.MlflowClient(store)
    loss = client.get_metric_history(killed.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [m.step for m in client.get_metric_history(killed.run_id, "reward")] == [2, 3]
    assert resumed.unlogged_metrics() == [] and resumed.stats["failed"] == 0


def test_a_refused_record_is_counted_not_retried_and_a_dead_server_is_given_up_at_end(tmp_path, store):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store))

    def refused(*args, **kwargs):
        raise MlflowException("bad metric", error_code=INVALID_PARAMETER_VALUE)

    tracker._client.log_batch = refused
    tracker.log_metrics({"loss": 1.0}, step=1)
    deadline = time.monotonic() + 10
    while tracker.stats["failed"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tracker.stats["failed"] == 1 and tracker.stats["retries"] == 0

    def down(*args, **kwargs):
        raise ConnectionError("tracking server down for good")

    tracker._client.log_batch = down
    for step in range(2, 5):
        tracker.log_metrics({"loss": 1.0}, step=step)
    t0 = time.perf_counter()
    tracker.end(timeout_s=2)
    assert time.perf_counter() - t0 < 10  # end gives the outage its timeout, no more
    stats = tracker.stats
    assert stats["failed"] + stats["dropped"] == 1 + 3 and stats["retries"] >= 1


def test_the_dataset_is_a_run_input_and_tables_keep_logged_columns(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store))
    tracker.log_dataset("openai/gsm8k", ["q1", "q2"])
    tracker.log_completions([{"prompt": "p", "completion": "c", "reward": 1.0, "gold_parsed": "[4]"}], step=3)
    tracker.end()
    run = mlflow.MlflowClient(store).get_run(tracker.run_id)
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "openai/gsm8k" and dataset_input.tags[0].value == "training"
    assert tracker.stats == CLEAN_STATS


def test_a_prepared_dataset_is_logged_with_its_resolved_source_and_content_digest(tmp_path, store):
    from async_grpo.tracking import DIGEST_TAG

    digest = "0123456789abcdef" * 4  # dataset_source.rows_digest: 64 hex characters
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store))
    tracker.log_dataset("/w/run/staging/dataset", ["q1"], digest=digest, source="/w/data/2026-11-26.jsonl")
    tracker.end()
    (dataset_input,) = mlflow.MlflowClient(store).get_run(tracker.run_id).inputs.dataset_inputs
    assert dataset_input.dataset.name == "/w/data/2026-11-26.jsonl"
    assert "/w/data/2026-11-26.jsonl" in dataset_input.dataset.source
    assert dataset_input.dataset.digest == digest[:36]  # MLflow's limit; the whole digest is a tag
    assert {t.key: t.value for t in dataset_input.tags} == {"mlflow.data.context": "training", DIGEST_TAG: digest}
    assert tracker.stats == CLEAN_STATS


def test_report_to_none_tracks_nothing(tmp_path, store):
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), report_to="none"))
    tracker.log_metrics({"loss": 1.0}, step=1)
    assert tracker.log_model(tmp_path) is None and tracker.run_id == ""
    tracker.end()
    assert not (tmp_path / "run" / "mlflow.db").exists()


def test_the_final_model_is_uploaded_from_a_private_copy_and_a_planted_link_never(tmp_path, store):
    """The trainer uploads `<output_dir>/final-model` off the shared volume, and MLflow's own copy follows links: a
    link planted there to this process's environment (the MLflow keys) would reach every reader of the experiment.
    The upload goes through `shared_volume.copy_tree`: the link is refused (reported, None) and nothing is uploaded."""
    from async_grpo.tiny_model import build_tiny_model

    environ = tmp_path / "proc-self-environ"
    environ.write_bytes(b"MLFLOW_TRACKING_PASSWORD=hunter2")
    model = build_tiny_model(tmp_path / "run" / "final-model", seed=0)
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri=store))
    uri = tracker.log_model(model)
    assert uri is not None and tracker.failed == 0  # an honest folder: uploaded, whole
    downloaded = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "back"), tracking_uri=store))
    assert (downloaded / "model" / "config.json").read_bytes() == (model / "config.json").read_bytes()

    (model / "added_tokens.json").symlink_to(environ)
    assert tracker.log_model(model) is None and tracker.failed == 1
    tracker.end()
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and b"hunter2" in p.read_bytes()]
    assert leaked == [environ]


def test_a_run_leaves_the_process_environment_as_it_found_it(tmp_path, store):
    """`mlflow.set_tracking_uri` exports MLFLOW_TRACKING_URI; a finished run must not leak it into the next run's
    config (a second run with another output_dir would write into the first run's store)."""
    import os

    first = GRPOConfig(output_dir=str(tmp_path / "a"))
    tracker = Tracker(first)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.end()
    assert "MLFLOW_TRACKING_URI" not in os.environ
    second = GRPOConfig(output_dir=str(tmp_path / "b"))
    assert second.tracking_uri == f"sqlite:///{(tmp_path / 'b').resolve() / 'mlflow.db'}"
    # with no environment URI, artifacts go beside the run's sqlite store
    experiment = mlflow.MlflowClient(first.tracking_uri).get_experiment_by_name("async-grpo")
    assert experiment is not None and experiment.artifact_location.startswith((tmp_path / "a").resolve().as_uri())


def test_a_sqlite_store_given_by_uri_keeps_the_artifacts_beside_it(tmp_path, store):
    """An explicit sqlite URI (here relative, as a user types it) gets its artifacts in `mlartifacts/` beside the
    database, not in ./mlruns of the working directory (MLflow's default); another store keeps its own root."""
    from async_grpo.tracking import artifact_location

    (tmp_path / "stores").mkdir()
    tracker = Tracker(GRPOConfig(output_dir=str(tmp_path / "run"), mlflow_tracking_uri="sqlite:///stores/m.db"))
    tracker.log_text("hello", "note.txt")
    tracker.end()
    experiment = mlflow.MlflowClient("sqlite:///stores/m.db").get_experiment_by_name("async-grpo")
    assert experiment.artifact_location == (tmp_path / "stores" / "mlartifacts").resolve().as_uri()
    assert (tmp_path / "stores" / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
    assert artifact_location("http://mlflow:5000") is None and artifact_location("databricks") is None


OPEN_ON_GO = """
import sys
from async_grpo.tracking import open_store
print("ready", flush=True)
sys.stdin.readline()  # the test writes "go" to every process once all of them have imported mlflow
open_store(sys.argv[1], retry_s=0.5)
"""


def test_processes_opening_one_new_sqlite_store_at_once_all_get_a_working_store(tmp_path):
    """Four processes open one new sqlite store at the same instant (a run, `mlflow ui`, a test's client). Each one
    migrating it itself failed 3 times in 3 ("Online migration expected to match one row") and left the file broken
    for every later open ("table _alembic_tmp_... already exists"); with `open_store` all four succeed and the store
    takes a run."""
    import subprocess
    import sys

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_ON_GO, uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:  # each line is read under a deadline: a process that died says why
        ready = list(pool.map(lambda p: p.stdout.readline(), procs, timeout=120))
    assert ready == ["ready\n"] * 4, [p.poll() for p in procs]
    for p in procs:  # released together: they open the new store at the same instant
        p.stdin.write("go\n")
        p.stdin.flush()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mlflow.db"]  # no private file left behind
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("after-the-race"))
    client.log_metric(run.info.run_id, "x", 1.0)
    assert client.get_run(run.info.run_id).data.metrics == {"x": 1.0}
