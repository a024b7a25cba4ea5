"""MLflow tracking: params, the resolved config, the dataset, per-step metrics, sample tables and the final model.

A thin layer over `mlflow`, with the behaviour MLflow users expect:

- The standard environment wins over our defaults: `MLFLOW_TRACKING_URI` (when `mlflow_tracking_uri` is unset),
  `MLFLOW_EXPERIMENT_NAME` (when `mlflow_experiment_name` is at its default) and `MLFLOW_RUN_ID`: KFP 2.17's
  MLflow integration opens a nested run per task and injects `MLFLOW_TRACKING_URI` and `MLFLOW_RUN_ID` into the
  task's container, so the trainer logs into that task's run (and the PyTorchJob it launches inherits both).
- Nothing blocks a training step: metrics, tables and text artifacts go through a bounded queue to one
  background thread that writes them with `MlflowClient`, in order. A tracking server that is down or restarting
  costs no record: a write that fails for want of the server (`is_transient`: a transport error, or a 5xx, after
  MLflow's own retries) is tried again with a capped backoff until it succeeds, while training goes on and the queue
  holds the later records; `end` gives it `FLUSH_TIMEOUT_S`. Records the server refuses (4xx), and records dropped
  because the queue was full, are counted, reported as warnings, and given in `stats`.
- A checkpoint keeps the metrics MLflow has not taken yet (`unlogged_metrics`, in the `TrainState`), and the run
  resumed from it writes them again (`resubmit_metrics`): a trainer killed while MLflow was catching up loses no
  step's metrics. MLflow stores an identical metric (key, value, step, timestamp) once, so one written between the
  checkpoint and the kill is not doubled.
- The final model is logged with the `transformers` flavour (task `llm/v1/completions`, so the signature is
  MLflow's completions schema, the tokenizer is saved with it), which `mlflow.transformers.load_model` loads and
  `mlflow models serve` serves; the run gets the tag `async_grpo.model_uri` naming it (register_model uses it).
- The training dataset is recorded with `mlflow.log_input` (context "training"); a dataset prepared by the pipeline
  carries its resolved source and its content digest (`digests.json`, `dataset_source.DatasetRecord`).
- `log_system_metrics` turns on MLflow's system metrics (CPU, memory, GPU) for the run.
- `report_to: none` gives a tracker that records nothing.
- A sqlite store keeps a new experiment's artifacts in `mlartifacts/` beside the database (`artifact_location`), not
  in `./mlruns` of the working directory, MLflow's default.
- A new sqlite store is created whole before another process can open it (`open_store`): two processes migrating one
  new file at once break it for good.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow

from async_grpo import shared_volume
from async_grpo.config import GRPOConfig, dump_config, flat_params
from async_grpo.transports.messages import EpisodeSpan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

MAX_PARAM_CHARS = 500
MAX_PENDING = 10_000  # records waiting for the background writer; beyond this, new records are dropped (counted)
# episode traces are skipped (counted in `traces_dropped`) while this many records wait: a writer that falls behind
# (traces every few steps, or MLflow slow to take them) never makes the step metrics wait behind traces
TRACE_BACKLOG_LIMIT = 200
FLUSH_TIMEOUT_S = 120.0  # `end` waits this long for pending records before giving up on them (counted)
MODEL_URI_TAG = "async_grpo.model_uri"  # run tag: the logged model's URI (models:/m-...), for registration
DIGEST_TAG = "async_grpo.digest"  # dataset input tag: the full content digest (MLflow keeps 36 chars of a digest)
MAX_DIGEST_CHARS = 36  # MLflow's limit on a dataset digest (mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE)
_DEFAULT_EXPERIMENT = "async-grpo"
STORE_OPEN_ATTEMPTS = 3  # an existing sqlite store is opened this often before its set-up error is raised
STORE_RETRY_S = 2.0  # seconds between the attempts (another process finishing its migration)
WRITE_RETRY_MIN_S = 1.0  # first wait before a failed write is tried again (doubles each time)
WRITE_RETRY_MAX_S = 10.0  # longest wait between two tries of one write, once the server is back
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit on the metrics of one log_batch (mlflow.utils.validation)
ABANDON_JOIN_S = 5.0  # after the flush timeout, how long `end` lets the writer finish its last try


# trace tags: the optimizer step that trained the episode (`tag.async_grpo.step = '3'`), and "<group>/<sample>", the
# episode within its step
TRACE_STEP_TAG = "async_grpo.step"
TRACE_EPISODE_TAG = "async_grpo.episode"


@dataclass(frozen=True)
class EpisodeTrace:
    """One sampled episode as an MLflow trace: a root span "episode" (type AGENT) and, under it, the episode's spans.

    Built by the runner (`runner.report.episode_traces`); written by `Tracker.log_episode_traces`.

    Attributes:
        inputs: the root span's inputs, e.g. {"prompt": the dataset prompt (text or chat messages)}.
        outputs: the root span's outputs, e.g. {"completion", "reward", "advantage", "rewards"}.
        attributes: the root span's attributes (JSON-safe): the step, the group and sample index, the policy version
            that sampled it, its staleness, ...
        tags: the trace's tags, searchable (`mlflow.search_traces(filter_string="tag.async_grpo.step = '3'")`): the
            step (`TRACE_STEP_TAG`) and the episode within it (`TRACE_EPISODE_TAG`), both required.
        spans: the episode's `EpisodeSpan`s (generation turns, tool calls, environment steps, reward functions), in
            the order they happened; empty when the rollout recorded none.
        start_ns, end_ns: the root span's times, nanoseconds since the epoch (`time.time_ns()`).
    """

    inputs: dict
    outputs: dict
    attributes: dict
    tags: dict[str, str]
    start_ns: int
    end_ns: int
    spans: tuple[EpisodeSpan, ...] = field(default_factory=tuple)


@dataclass
class _TraceBatch:
    """One step's episode traces on their way to MLflow (a writer record): which of them MLflow holds so far
    (`TRACE_EPISODE_TAG`s), and whether a write was tried (a retry first asks MLflow what it has)."""

    traces: list[EpisodeTrace]
    kept: set[str] = field(default_factory=set)
    tried: bool = False


def is_transient(err: BaseException) -> bool:
    """Whether a failed MLflow write may succeed later: a transport error (the server is down, restarting or
    unreachable: `requests`' exceptions, which MLflow's REST client re-raises as the context of an MlflowException)
    or an HTTP 5xx; a 4xx (a refused record) is not."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(err, requests.RequestException | ConnectionError | TimeoutError):
        return True
    cause = err.__cause__ or err.__context__
    if cause is not None and isinstance(cause, requests.RequestException):
        return True
    return isinstance(err, MlflowException) and err.get_http_status_code() >= 500


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a local sqlite tracking URI, or None for any other store.

    `sqlite:////abs/path.db` names an absolute path and `sqlite:///rel/path.db` one relative to the working directory,
    as MLflow's sqlalchemy engine reads them; a query string (`?timeout=30`) is not part of the path.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///").split("?", 1)[0])


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: for a local sqlite store, `mlartifacts/` beside the database file
    (as a `file://` URI); None for any other store, whose own default artifact root applies (a tracking server's
    `--default-artifact-root`). MLflow's default for a sqlite store is `./mlruns` of whatever directory the process
    started in, which scatters one store's artifacts over every working directory that logged to it."""
    path = sqlite_path(tracking_uri)
    return None if path is None else (path.resolve().parent / "mlartifacts").as_uri()


def open_store(tracking_uri: str, *, attempts: int = STORE_OPEN_ATTEMPTS, retry_s: float = STORE_RETRY_S) -> None:
    """Make the first contact with the tracking store; a sqlite store that does not exist yet is created whole before
    any other process can open it.

    MLflow creates and migrates a sqlite store in whichever process opens it first, and two processes migrating one
    new file at once break it for good (leftover `_alembic_tmp_*` tables: "table ... already exists" on every later
    open). So a new store is migrated in a private file beside it (`<name>.<pid>.creating`) and published with
    `os.link`, which fails when the name exists: the first creator wins and the others open the published, complete
    store. An existing store is opened up to `attempts` times, `retry_s` apart, in case a process outside this
    package (`mlflow ui` on a new file) is migrating it at that moment.

    Args:
        tracking_uri: the run's tracking URI (`sqlite:////abs/path.db`, `sqlite:///rel/path.db`, http(s), file).
        attempts: tries for an existing sqlite store (>= 1); any other store is tried once (preflight checked it).
        retry_s: seconds between tries.

    Raises:
        the store's error (mlflow.exceptions.MlflowException, sqlalchemy or alembic errors) from the last try.
    """
    path = sqlite_path(tracking_uri)
    if path is None:
        mlflow.MlflowClient(tracking_uri).search_experiments(max_results=1)
        return
    if not path.exists():
        private = path.with_name(f"{path.name}.{os.getpid()}.creating")
        try:
            mlflow.MlflowClient(f"sqlite:///{private}").search_experiments(max_results=1)  # create and migrate
            os.link(private, path)  # publish; FileExistsError: another process published first
        except FileExistsError:
            pass
        finally:
            private.unlink(missing_ok=True)
    for attempt in range(1, attempts + 1):
        try:
            mlflow.MlflowClient(tracking_uri).search_experiments(max_results=1)
            return
        except Exception as err:
            if attempt == attempts:
                raise
            logger.warning(
                "MLflow store %s: opening it failed (%s), as when another process migrates it at the same time; "
                "trying again in %.0f s (try %d of %d)",
                tracking_uri,
                str(err).splitlines()[0] if str(err) else type(err).__name__,
                retry_s,
                attempt + 1,
                attempts,
            )
            time.sleep(retry_s)


def experiment_name(config: GRPOConfig) -> str:
    """`mlflow_experiment_name`, unless it is at its default and `MLFLOW_EXPERIMENT_NAME` is set."""
    name = config.tracking.mlflow_experiment_name
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or name if name == _DEFAULT_EXPERIMENT else name


class Tracker:
    """One MLflow run for one training job.

    Args:
        config: the resolved config (logged as params and as `config.yaml`).
        run_id: log into this existing run; None: `MLFLOW_RUN_ID` when set, else a new run.

    Raises:
        mlflow.exceptions.MlflowException: the tracking server is unreachable or refuses the run at start (a run
            that cannot even start fails early; later outages are not fatal).
    """

    def __init__(self, config: GRPOConfig, run_id: str | None = None):
        self.enabled = config.tracking.report_to == "mlflow"
        self.run_id = ""
        self.tracking_uri = ""
        self.failed = 0  # records the server refused or that raised
        self.dropped = 0  # records dropped because the queue was full, or still pending at `end`
        self._failed_writes = 0  # writes (of one or more records) that failed for good: their warnings are sparse
        self.retries = 0  # tries again of writes that failed for want of the server (`is_transient`)
        self.traces_written = 0  # episode traces MLflow kept (`log_episode_traces`)
        self.traces_dropped = 0  # episode traces skipped while the writer was behind (TRACE_BACKLOG_LIMIT)
        self._abandon = threading.Event()  # set by `end` once its flush timeout passed: stop retrying
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        # metric records queued or being written, by the id of their list of `Metric`s (`unlogged_metrics`)
        self._unlogged: dict[int, list] = {}
        self._unlogged_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self.enabled:
            logger.info("report_to=none: nothing is tracked")
            return
        self.tracking_uri = config.tracking_uri
        # `mlflow.set_tracking_uri` also exports MLFLOW_TRACKING_URI to os.environ (for subprocesses); note what the
        # user had so that the check below sees their environment, and `end` gives it back unchanged.
        self._env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.tracking_uri)
        open_store(self.tracking_uri)
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        if run_id is None:
            name = experiment_name(config)
            artifacts = artifact_location(self.tracking_uri)
            if artifacts is not None and mlflow.get_experiment_by_name(name) is None:
                # a sqlite store: artifacts beside it, not in ./mlruns of the working directory
                try:
                    mlflow.create_experiment(name, artifact_location=artifacts)
                except mlflow.exceptions.MlflowException as err:  # another process created it meanwhile
                    if err.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
            mlflow.set_experiment(name)
        else:  # the run's own experiment: start_run refuses a run outside the process's active experiment
            mlflow.set_experiment(
                experiment_id=mlflow.MlflowClient(self.tracking_uri).get_run(run_id).info.experiment_id
            )
        system = True if config.tracking.log_system_metrics else None  # None: MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING
        self.run = mlflow.start_run(
            run_id=run_id, run_name=None if run_id else config.tracking.run_name, log_system_metrics=system
        )
        self.run_id = self.run.info.run_id
        self._client = mlflow.MlflowClient(self.tracking_uri)
        params = {k: v[:MAX_PARAM_CHARS] for k, v in flat_params(config).items()}  # flat TRL names
        try:
            mlflow.log_params(params)
        except mlflow.exceptions.MlflowException as err:  # resuming a run that logged other values
            logger.warning("MLflow run %s keeps its earlier params (%s)", self.run_id, str(err).splitlines()[0])
        self._thread = threading.Thread(target=self._write_loop, name="mlflow-writer", daemon=True)
        self._thread.start()
        self._submit(self._client.log_text, self.run_id, dump_config(config), "config.yaml")

    # ------------------------------------------------------------------ the background writer
    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue one write; never blocks (a full queue drops the record, counted and warned about)."""
        if not self.enabled:
            return
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            self._settled(fn, [args])
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning(
                    "MLflow is not keeping up (%d records pending): %d record(s) dropped so far",
                    MAX_PENDING,
                    self.dropped,
                )

    def _write_loop(self) -> None:
        """Write queued records in order until `end` sets the stop event and the queue is empty, or gives up on them
        (`_abandon`: `end` counts what is left as dropped); failures are counted. Consecutive metric records are
        written as one `log_batch` (`_take_metrics`), so a backlog (after an outage, or a slow store) drains faster
        than steps add to it."""
        while not self._abandon.is_set() and not (self._stop.is_set() and self._queue.empty()):
            try:
                fn, args = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            records, held = [args], None
            if fn == self._client.log_batch:
                args, records, held = self._take_metrics(args)
            try:
                self._write(fn, args, len(records))
                self._settled(fn, records)
                if held is not None:
                    self._write(*held, 1)
                    self._settled(held[0], [held[1]])
            finally:
                for _ in range(len(records) + (held is not None)):
                    self._queue.task_done()

    def _settled(self, fn: Callable[..., Any], records: list[tuple]) -> None:
        """Records of `fn` (each its args) written, or failed / dropped for good (counted): the metric ones
        (`log_batch`: (run_id, metrics)) are no longer `unlogged_metrics`; other records are not tracked."""
        if fn != self._client.log_batch:
            return
        with self._unlogged_lock:
            for args in records:
                self._unlogged.pop(id(args[1]), None)

    def _take_metrics(self, args: tuple) -> tuple[tuple, list, tuple | None]:
        """The metric record `args` = (run_id, metrics) merged with the metric records queued right after it, up to
        MLflow's MAX_METRICS_PER_BATCH metrics per `log_batch`; returns (merged args, the records taken, the first
        other record taken from the queue or None: it is written next, so the order holds)."""
        run_id, metrics = args[0], list(args[1])
        records: list = [args]
        while True:
            try:
                fn, nxt = self._queue.get_nowait()
            except queue.Empty:
                return (run_id, metrics), records, None
            if fn != self._client.log_batch or nxt[0] != run_id or len(metrics) + len(nxt[1]) > MAX_METRICS_PER_BATCH:
                return (run_id, metrics), records, (fn, nxt)
            metrics.extend(nxt[1])
            records.append(nxt)

    def _write(self, fn: Callable[..., Any], args: tuple, records: int) -> None:
        """One write of `records` queued records: tried again after a transient failure (WRITE_RETRY_MIN_S doubling
        up to WRITE_RETRY_MAX_S) until it succeeds or `end` abandons it; any other failure counts its records in
        `failed`."""
        delay = WRITE_RETRY_MIN_S
        while True:
            try:
                fn(*args)
                return
            except Exception as err:
                if not is_transient(err) or self._abandon.is_set():
                    self.failed += records
                    self._failed_writes += 1
                    if self._failed_writes == 1 or self._failed_writes % 100 == 0:
                        logger.warning(
                            "MLflow write failed (%d record(s) so far; training goes on): %r", self.failed, err
                        )
                    return
                self.retries += 1
                if self.retries == 1 or self.retries % 100 == 0:
                    logger.warning(
                        "MLflow is unreachable (%s); its records wait (%d pending) and are written once it is back; "
                        "training goes on",
                        str(err).splitlines()[0][:200],
                        self._queue.qsize(),
                    )
                if self._abandon.wait(delay):
                    continue  # `end` gave up: one last try, then counted
                delay = min(2 * delay, WRITE_RETRY_MAX_S)

    # ------------------------------------------------------------------ what the run logs
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log numeric metrics at `step` (None and non-finite values are skipped); returns at once."""
        from mlflow.entities import Metric

        if not self.enabled:
            return
        now = int(time.time() * 1000)
        clean = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if v is not None and v == v and abs(float(v)) != float("inf")
        ]
        if clean:
            with self._unlogged_lock:
                self._unlogged[id(clean)] = clean
            self._submit(self._client.log_batch, self.run_id, clean)

    def unlogged_metrics(self) -> list[dict[str, Any]]:
        """The metrics logged but not yet taken by MLflow (queued, or being written or retried), oldest first, as
        plain values: {"key", "value", "timestamp" (ms), "step"}. A checkpoint keeps them (`TrainState`)."""
        with self._unlogged_lock:
            pending = list(self._unlogged.values())
        return [
            {"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for ms in pending for m in ms
        ]

    def resubmit_metrics(self, records: list[dict[str, Any]]) -> None:
        """Queue again metrics a checkpoint kept (`unlogged_metrics`), with their steps and timestamps; returns at
        once. Those MLflow took already are stored once (MLflow keeps one copy of an identical metric)."""
        from mlflow.entities import Metric

        if not self.enabled or not records:
            return
        metrics = [Metric(str(r["key"]), float(r["value"]), int(r["timestamp"]), int(r["step"])) for r in records]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            batch = metrics[start : start + MAX_METRICS_PER_BATCH]
            with self._unlogged_lock:
                self._unlogged[id(batch)] = batch
            self._submit(self._client.log_batch, self.run_id, batch)

    def log_completions(self, rows: list[dict], step: int, folder: str = "completions") -> None:
        """A table of sample completions (prompt, completion, reward, advantage...) at `step`, as
        `<folder>/step_<step>.json`; returns at once."""
        if rows and self.enabled:
            columns = list(dict.fromkeys(k for r in rows for k in r))
            table = {k: [r.get(k) for r in rows] for k in columns}
            self._submit(self._client.log_table, self.run_id, table, f"{folder}/step_{step:06d}.json")

    def log_figure(self, render: Callable[[], Figure], artifact_file: str) -> None:
        """A figure as the artifact `artifact_file` (e.g. `plots/staleness/step_000050.png`): `render()` draws it on
        the writer thread, off the training loop, and it is logged there; returns at once. A render that raises
        counts as a failed record."""
        if self.enabled:
            self._submit(self._log_figure_now, render, artifact_file)

    def _log_figure_now(self, render: Callable[[], Figure], artifact_file: str) -> None:
        self._client.log_figure(self.run_id, render(), artifact_file)

    def log_artifact(self, path: Path, folder: str) -> None:
        """The local file `path` as an artifact under `folder`; returns at once."""
        if self.enabled:
            self._submit(self._client.log_artifact, self.run_id, str(path), folder)

    def log_episode_traces(self, traces: list[EpisodeTrace]) -> None:
        """The episodes of one step (their `async_grpo.step` tag) as MLflow traces linked to this run (the run's
        Traces tab); returns at once. Written as one record on the writer thread (`_write_episode_traces`): each
        trace counts in `traces_written` once MLflow shows it, a batch written while the server is unreachable is
        tried again (only the traces MLflow does not have), and a trace MLflow refused counts in `failed`. While
        `TRACE_BACKLOG_LIMIT` records wait for the writer, the traces are skipped and counted in `traces_dropped`."""
        if not (self.enabled and traces):
            return
        if self._queue.qsize() >= TRACE_BACKLOG_LIMIT:  # the writer is behind: the metrics come first
            self.traces_dropped += len(traces)
            if self.traces_dropped == len(traces) or self.traces_dropped % 1000 < len(traces):
                logger.warning("MLflow writer behind (%d records pending): %d episode trace(s) skipped so far",
                               self._queue.qsize(), self.traces_dropped)  # fmt: skip
            return
        self._submit(self._write_episode_traces, _TraceBatch(traces))

    def _write_episode_traces(self, batch: _TraceBatch) -> None:
        """Write the batch's traces MLflow does not have yet through its client (its exporter sends them from its
        own queue, spans batched), wait for that queue (`flush_trace_async_logging`), then read back which ones
        the run holds: one search by the step's tag. Raises what the search raised (the server is down: the writer
        tries the record again later, `is_transient`)."""
        step = batch.traces[0].tags[TRACE_STEP_TAG]
        if batch.tried:  # a retry: what MLflow took since is not written twice
            batch.kept |= self._kept_episodes(step)
        batch.tried = True
        for trace in batch.traces:
            if trace.tags[TRACE_EPISODE_TAG] not in batch.kept:
                self._start_episode_trace(trace)
        mlflow.flush_trace_async_logging()
        batch.kept |= self._kept_episodes(step)
        wanted = {trace.tags[TRACE_EPISODE_TAG] for trace in batch.traces}
        self.traces_written += len(wanted & batch.kept)
        lost = len(wanted - batch.kept)
        if lost:
            self.failed += lost
            logger.warning("MLflow did not keep %d episode trace(s) of step %s (its log says why)", lost, step)

    def _kept_episodes(self, step: str) -> set[str]:
        """The `async_grpo.episode` tags of this run's traces of `step` that MLflow holds."""
        found = self._client.search_traces(
            locations=[self.run.info.experiment_id], run_id=self.run_id, include_spans=False, max_results=1000,
            filter_string=f"tag.{TRACE_STEP_TAG} = '{step}'",
        )  # fmt: skip
        return {t.info.tags.get(TRACE_EPISODE_TAG, "") for t in found}

    def _start_episode_trace(self, trace: EpisodeTrace) -> None:
        """Hand one trace to MLflow's client: the root span "episode" (type AGENT) and, under it, each span under the
        latest span that contains it in time (a tool call under its environment step), else under the root."""
        client = self._client
        root = client.start_trace(
            "episode", span_type="AGENT", inputs=trace.inputs, attributes=trace.attributes, tags=trace.tags,
            experiment_id=self.run.info.experiment_id, start_time_ns=trace.start_ns, run_id=self.run_id,
        )  # fmt: skip
        open_spans: list[tuple[str, int]] = []  # (span id, end ns) of the spans that may still contain the next
        for span in sorted(trace.spans, key=lambda x: (x.start_ns, -x.end_ns)):
            while open_spans and open_spans[-1][1] < span.end_ns:  # a span nests in the one that contains it in time
                open_spans.pop()
            parent = open_spans[-1][0] if open_spans else root.span_id
            child = client.start_span(
                span.name, trace_id=root.trace_id, parent_id=parent, span_type=span.kind, inputs=span.inputs,
                attributes=span.attributes, start_time_ns=span.start_ns,
            )  # fmt: skip
            client.end_span(root.trace_id, child.span_id, outputs=span.outputs, end_time_ns=span.end_ns)
            open_spans.append((child.span_id, span.end_ns))
        client.end_trace(root.trace_id, outputs=trace.outputs, end_time_ns=trace.end_ns)

    def log_text(self, text: str, name: str) -> None:
        """A text artifact; returns at once."""
        if self.enabled:
            self._submit(self._client.log_text, self.run_id, text, name)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags (empty values are left out); returns at once."""
        if self.enabled:
            for key, value in tags.items():
                if value:
                    self._submit(self._client.set_tag, self.run_id, key, value)

    def log_dataset(
        self,
        spec: str,
        prompts: list,
        context: str = "training",
        *,
        digest: str | None = None,
        source: str | None = None,
    ) -> None:
        """Record the dataset `spec` (its prompts, as text) as a run input (`mlflow.log_input`); returns at once.

        Args:
            digest: the data's content digest (`dataset_source.rows_digest`): the MLflow dataset's digest (its first
                MAX_DIGEST_CHARS characters) and, whole, the input tag DIGEST_TAG; None: MLflow's own digest.
            source: the data actually read (a `{date}` or newest-file spec resolved): the dataset's name and source;
                None: `spec`.
        """
        if self.enabled:
            prompts = [str(p) for p in prompts]
            self._submit(_log_input, self._client, self.run_id, source or spec, prompts, context, digest)

    def log_model(self, path: Path) -> str | None:
        """Log the saved HF checkpoint at `path` with the transformers flavour (task llm/v1/completions), tag the
        run with its URI (`MODEL_URI_TAG`) and return the URI; None (reported) when tracking is off or the
        upload failed: the checkpoint stays on disk.

        `path` may lie on the shared, tenant-writable volume, and MLflow's own copy follows links (a planted
        `final-model/x -> /proc/self/environ` would upload this process's MLflow password). So the folder is first
        copied into a folder of this process's own (`shared_volume.copy_tree`, its parent folder as the root, into
        `shared_volume.private_dir` under TMPDIR) and uploaded from there: a link, special file or hard link in it
        is refused (reported here, None returned) and nothing is read through it. TMPDIR holds two copies of the
        model while it uploads (this one and MLflow's)."""
        if not self.enabled:
            return None
        private = None
        try:
            private = shared_volume.private_dir("model-upload")
            copy = shared_volume.copy_tree(path, private / Path(path).name, root=Path(path).absolute().parent)
            info = log_transformers_model(copy)
            self._client.set_tag(self.run_id, MODEL_URI_TAG, info.model_uri)
            return info.model_uri
        except Exception as err:
            self.failed += 1
            logger.error("logging the final model to MLflow failed (the checkpoint stays at %s): %r", path, err)
            return None
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)

    @property
    def stats(self) -> dict[str, int]:
        """Records that failed (`failed`) or were dropped (`dropped`) so far, still pending (`pending`), the tries
        again of writes that failed for want of the server (`retries`), and the episode traces written
        (`traces_written`) and skipped while the writer was behind (`traces_dropped`)."""
        return {"failed": self.failed, "dropped": self.dropped, "pending": self._queue.qsize(), "retries": self.retries,
                "traces_written": self.traces_written, "traces_dropped": self.traces_dropped}  # fmt: skip

    def end(self, status: str = "FINISHED", timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Write what is pending (up to `timeout_s` seconds; the rest is counted as dropped), then close the run
        with `status` (FINISHED, FAILED or KILLED)."""
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._abandon.set()  # a write still retrying fails now (counted); the writer takes no more
                self._thread.join(ABANDON_JOIN_S)
                self.dropped += self._queue.qsize()
                logger.warning(
                    "MLflow did not take the last %d record(s) within %.0f s; they are dropped",
                    self._queue.qsize(),
                    timeout_s,
                )
        if self.failed or self.dropped:
            logger.warning(
                "MLflow tracking: %d record(s) failed and %d were dropped during this run", self.failed, self.dropped
            )
        mlflow.end_run(status=status)
        if self._env_uri is None:  # give the process environment back as the user had it
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = self._env_uri


def _log_input(
    client: mlflow.MlflowClient, run_id: str, spec: str, prompts: list[str], context: str, digest: str | None = None
) -> None:
    """`log_inputs` of a pandas dataset of the prompts, its source the spec (a code source when MLflow cannot
    resolve it, e.g. `builtin:reverse`), its digest `digest` cut to MLflow's limit (whole in the tag DIGEST_TAG)."""
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    frame = pd.DataFrame({"prompt": prompts})
    short = digest[:MAX_DIGEST_CHARS] if digest else None
    try:
        dataset = mlflow.data.from_pandas(frame, source=spec, name=spec, digest=short)
    except mlflow.exceptions.MlflowException:
        dataset = mlflow.data.from_pandas(frame, name=spec, digest=short)
    tags = [InputTag("mlflow.data.context", context)] + ([InputTag(DIGEST_TAG, digest)] if digest else [])
    client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=tags)])


def log_transformers_model(path: Path) -> Any:
    """`mlflow.transformers.log_model` of a local checkpoint into the active run: task llm/v1/completions
    (pipeline text-generation, MLflow's completions signature), the tokenizer saved beside the weights, pinned
    transformers and torch requirements, and a model card written here (MLflow would otherwise ask the hub)."""
    import torch
    import transformers
    from huggingface_hub import ModelCard

    card = ModelCard(
        f"---\nlibrary_name: transformers\ntags: [grpo, async-grpo]\n---\n# {Path(path).name}\n\n"
        "A policy trained with asynchronous GRPO (async-grpo).\n"
    )
    return mlflow.transformers.log_model(
        str(path),
        name="model",
        task="llm/v1/completions",
        model_card=card,
        pip_requirements=[f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"],
    )
