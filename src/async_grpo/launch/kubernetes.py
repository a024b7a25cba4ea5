"""The `kubernetes` launch backend: create a run's objects, wait on the PyTorchJob, always clean up.

The objects come from `k8s_objects.build_run_objects`; this module only talks to the API server, so
the API clients are constructor arguments and tests drive every path (success, Failed, timeout, an
error halfway through creation) with a recording double instead of a cluster.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from async_grpo.config import GRPOConfig
from async_grpo.launch.base import LaunchResult
from async_grpo.launch.k8s_objects import (
    DNS_LABEL,
    PYTORCH_CONTAINER,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    RUN_LABEL,
    Manifest,
    build_run_objects,
    owner_reference,
    selector,
    trainer_config,
)
from async_grpo.launch.k8s_settings import ClusterSettings

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 10.0
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOG_TAIL_LINES = 80
TERMINAL_CONDITIONS = ("Succeeded", "Failed")
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # set by the Training Operator on its pods
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"

# What the backend calls, as RBAC rules (apiGroup, resource) -> verbs. manifests/base/rbac.yaml grants
# exactly this; tests check both that the Role matches and that the calls the backend makes match.
LAUNCHER_RBAC_RULES: dict[tuple[str, str], frozenset[str]] = {
    (PYTORCHJOB_GROUP, PYTORCHJOB_PLURAL): frozenset({"create", "get", "delete"}),
    ("apps", "deployments"): frozenset({"create", "delete"}),
    ("", "services"): frozenset({"create", "delete"}),
    ("", "configmaps"): frozenset({"create", "patch", "delete"}),
    ("networking.k8s.io", "networkpolicies"): frozenset({"create", "delete"}),
    ("", "pods"): frozenset({"list"}),
    ("", "pods/log"): frozenset({"get"}),
}

# kind -> (API attribute of the backend, method suffix) for the built-in kinds.
_KIND_API = {
    "ConfigMap": ("core", "config_map"), "Service": ("core", "service"),
    "Deployment": ("apps", "deployment"), "NetworkPolicy": ("networking", "network_policy"),
}


class RunTracking(Protocol):
    """Creates the MLflow run before the trainer starts (so its id is known) and closes it on failure."""

    def create_run(self, tracking_uri: str, experiment_name: str, run_name: str) -> str:
        """Create a run; return its id."""
        ...

    def end_run(self, tracking_uri: str, run_id: str, status: str) -> None:
        """Mark the run terminated with `status` (FAILED, KILLED)."""
        ...


class MlflowRunTracking:
    """`RunTracking` against a real MLflow tracking server (an `MlflowClient` per call)."""

    def create_run(self, tracking_uri: str, experiment_name: str, run_name: str) -> str:
        """Create `run_name` in `experiment_name` (created if missing). Raises MlflowException if unreachable."""
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(experiment_name)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment_name)
        return client.create_run(exp_id, run_name=run_name, tags={"async_grpo.backend": "kubernetes"}).info.run_id

    def end_run(self, tracking_uri: str, run_id: str, status: str) -> None:
        """Set the run's terminal status."""
        from mlflow import MlflowClient

        MlflowClient(tracking_uri).set_terminated(run_id, status)


def _slug(text: str) -> str:
    """Lower-case ASCII letters, digits and single dashes."""
    chars = "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in chars.split("-") if part)


def make_run_name(config: GRPOConfig, unique: bool = True) -> str:
    """A DNS-1123 run name, `agrpo-<slug of run_name or experiment>[-<6 random hex>]`, at most 40 characters.

    Args:
        unique: append a random suffix (launches); False gives a stable name (rendered manifests).
    """
    slug = _slug(config.run_name or config.mlflow_experiment_name)[:26].strip("-") or "run"
    return f"agrpo-{slug}-{secrets.token_hex(3)}" if unique else f"agrpo-{slug}"


def k8s_run_name(run_name: str) -> str:
    """The object-name prefix of a named run: the name itself when it is already a DNS-1123 label of at
    most 40 characters starting with a letter, else a slug plus 8 hex of its hash. Deterministic, so
    `cleanup(run_name)` finds what `launch` created for a config with that `run_name`."""
    slug = _slug(run_name)
    if re.match(DNS_LABEL, slug) and slug == run_name:
        return slug
    prefix = slug if slug[:1].isalpha() else f"r-{slug}"
    return f"{prefix[:31].rstrip('-')}-{hashlib.sha256(run_name.encode()).hexdigest()[:8]}"


def resolve_run_name(config: GRPOConfig, unique: bool = True) -> str:
    """The object-name prefix of a launch of `config`: `k8s_run_name(config.run_name)` for a named run,
    else `make_run_name(config, unique)`."""
    return k8s_run_name(config.run_name) if config.run_name else make_run_name(config, unique=unique)


def _api_error_status(err: BaseException) -> int | None:
    return getattr(err, "status", None)


class KubernetesBackend:
    """`LaunchBackend` that runs the trainer as a PyTorchJob beside a vLLM Deployment and reward workers.

    Args:
        settings: a `ClusterSettings`, or a mapping of its fields (None: defaults; in a pod, the
            namespace defaults to the pod's own, read from SA_NAMESPACE_FILE).
        core_api, apps_api, networking_api, custom_api: `kubernetes.client` CoreV1Api, AppsV1Api,
            NetworkingV1Api and CustomObjectsApi (or doubles); those left None are made on first use from
            the in-cluster config, else ~/.kube/config.
        tracking: creates/ends the MLflow run (default: `MlflowRunTracking`).
        run_name: object-name prefix; default `resolve_run_name(config)`.
        poll_interval_s: seconds between PyTorchJob status reads.
        clock, sleep: time sources (monotonic seconds), injectable for tests.
        **setting_fields: `ClusterSettings` fields, overriding `settings` (so the pipeline's
            `kubernetes_options` dict can be passed as keyword arguments).

    Raises:
        ConfigError: unknown or invalid settings (the message names the field).
    """

    name = "kubernetes"

    def __init__(self, settings: ClusterSettings | Mapping[str, Any] | None = None, *, core_api: Any = None,
                 apps_api: Any = None, networking_api: Any = None, custom_api: Any = None,
                 tracking: RunTracking | None = None, run_name: str | None = None,
                 poll_interval_s: float = POLL_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, **setting_fields: Any):
        base = settings.model_dump() if isinstance(settings, ClusterSettings) else dict(settings or {})
        fields = {**base, **setting_fields}
        if "namespace" not in fields and SA_NAMESPACE_FILE.is_file():  # in a pod: launch where we run
            fields["namespace"] = SA_NAMESPACE_FILE.read_text().strip()
        self.settings = ClusterSettings.from_mapping(fields)
        self.apis = {"core": core_api, "apps": apps_api, "networking": networking_api, "custom": custom_api}
        self.tracking = tracking if tracking is not None else MlflowRunTracking()
        self.run_name = run_name
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.sleep = sleep

    # ------------------------------------------------------------------------------------------ launch
    def launch(self, config: GRPOConfig, *, timeout_s: float) -> LaunchResult:
        """Create the run's objects, wait for the PyTorchJob to finish, and clean up.

        The vLLM and reward Deployments, Services and NetworkPolicies are deleted in every case; the
        PyTorchJob (and its ConfigMap) is kept after success (for its logs; `ttlSecondsAfterFinished`
        or `cleanup` removes it) and deleted otherwise.

        Raises:
            ValueError: the config cannot run on the cluster (e.g. a model path outside the PVC).
            TimeoutError: the PyTorchJob did not finish within `timeout_s` seconds.
            RuntimeError: the PyTorchJob Failed or vanished, or a run of that name exists; the message
                has the reason (and log tails).
            kubernetes.client.ApiException: the API server refused to create an object.
        """
        s = self.settings
        run_name = self.run_name or resolve_run_name(config)
        trainer_cfg = trainer_config(config, s, run_name)  # fails on a bad config before anything exists
        build_run_objects(config, s, run_name)
        uri = trainer_cfg.mlflow_tracking_uri
        mlflow_run_id = self.tracking.create_run(uri, config.mlflow_experiment_name, trainer_cfg.run_name)
        objects = build_run_objects(config, s, run_name, mlflow_run_id=mlflow_run_id)
        created: list[Manifest] = []
        succeeded = False
        status = "FAILED"
        deadline = self.clock() + timeout_s
        logger.info("launching run %s in namespace %s (MLflow run %s)", run_name, s.namespace, mlflow_run_id)
        try:
            config_map, job, rest = objects[0], objects[1], objects[2:]
            self._create(config_map)
            created.append(config_map)
            job_live = self._create(job)
            created.append(job)
            owner = owner_reference(job_live)
            self._call("core", "patch_namespaced_config_map", config_map["metadata"]["name"], s.namespace,
                       {"metadata": {"ownerReferences": [owner]}})
            for obj in rest:
                obj["metadata"]["ownerReferences"] = [owner]
                self._create(obj)
                created.append(obj)
            self._wait(run_name, deadline, timeout_s)
            succeeded = True
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self._cleanup(created, keep_job=succeeded)
            if not succeeded:
                try:
                    self.tracking.end_run(uri, mlflow_run_id, status)
                except Exception as err:  # noqa: BLE001 - best effort; the original error matters more
                    logger.warning("could not mark MLflow run %s %s: %s", mlflow_run_id, status, err)
        model_dir = f"{trainer_cfg.output_dir}/final-model" if config.save_model else None
        return LaunchResult(mlflow_run_id, uri, model_dir, {})

    def cleanup(self, run_name: str) -> list[str]:
        """Delete every object a launch of `run_name` may have left (the pipeline's exit handler calls this
        when the launching pod was killed before its own cleanup ran). Objects already gone are skipped.

        Args:
            run_name: the config's run_name (mapped through `k8s_run_name`) or the object-name prefix.

        Returns:
            "Kind/name" of each object deleted.

        Raises:
            kubernetes.client.ApiException: a deletion failed for another reason than 404.
        """
        name = self.run_name or k8s_run_name(run_name)
        probes = [("Deployment", f"{name}-vllm"), ("Service", f"{name}-vllm"), ("Deployment", f"{name}-reward"),
                  ("Service", f"{name}-reward")]
        probes += [("NetworkPolicy", f"{name}-{c}") for c in ("vllm", "reward", "trainer")]
        probes += [("PyTorchJob", name), ("ConfigMap", f"{name}-config")]
        removed = []
        for kind, obj_name in probes:
            try:
                self._delete({"kind": kind, "metadata": {"name": obj_name}})
            except Exception as err:
                if _api_error_status(err) != 404:
                    raise
                continue
            logger.info("deleted %s %s", kind, obj_name)
            removed.append(f"{kind}/{obj_name}")
        return removed

    # ------------------------------------------------------------------------------------------ API calls
    def _call(self, api: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.apis[api] is None:
            self.apis.update(_default_apis(**self.apis))
        return getattr(self.apis[api], method)(*args, **kwargs)

    def _create_raw(self, obj: Manifest) -> Manifest:
        kind, ns = obj["kind"], self.settings.namespace
        logger.info("creating %s %s", kind, obj["metadata"]["name"])
        if kind == "PyTorchJob":
            return self._call("custom", "create_namespaced_custom_object", PYTORCHJOB_GROUP, PYTORCHJOB_VERSION,
                              ns, PYTORCHJOB_PLURAL, obj)
        api, suffix = _KIND_API[kind]
        return self._call(api, f"create_namespaced_{suffix}", ns, obj)

    def _create(self, obj: Manifest) -> Manifest:
        try:
            return self._create_raw(obj)
        except Exception as err:
            if _api_error_status(err) != 409:
                raise
            run = obj["metadata"]["labels"][RUN_LABEL]
            raise RuntimeError(
                f"{obj['kind']} {obj['metadata']['name']} already exists in namespace {self.settings.namespace}: "
                f"a run named {run!r} is there. Fix: choose another run_name, or remove the old run with "
                f"`kubectl -n {self.settings.namespace} delete pytorchjob {run}`.") from err

    def _delete(self, obj: Manifest) -> None:
        kind, name, ns = obj["kind"], obj["metadata"]["name"], self.settings.namespace
        if kind == "PyTorchJob":
            self._call("custom", "delete_namespaced_custom_object", PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, ns,
                       PYTORCHJOB_PLURAL, name, propagation_policy="Background")
            return
        api, suffix = _KIND_API[kind]
        self._call(api, f"delete_namespaced_{suffix}", name, ns, propagation_policy="Background")

    def _cleanup(self, created: list[Manifest], keep_job: bool) -> None:
        """Delete what was created, newest first (vLLM goes first). Errors are logged, never raised, so
        they cannot hide the run's own error; an object already gone (404) is fine."""
        for obj in reversed(created):
            if keep_job and obj["kind"] in ("PyTorchJob", "ConfigMap"):
                continue
            try:
                self._delete(obj)
                logger.info("deleted %s %s", obj["kind"], obj["metadata"]["name"])
            except Exception as err:  # noqa: BLE001 - keep deleting the rest
                if _api_error_status(err) != 404:
                    logger.warning("could not delete %s %s: %s (delete it with `kubectl delete -n %s -l "
                                   "async-grpo/run=%s`)", obj["kind"], obj["metadata"]["name"], err,
                                   self.settings.namespace, obj["metadata"]["labels"].get("async-grpo/run"))

    # ------------------------------------------------------------------------------------------ waiting
    def _wait(self, run_name: str, deadline: float, timeout_s: float) -> None:
        """Poll the PyTorchJob until Succeeded (return), Failed (RuntimeError) or the deadline (TimeoutError),
        logging each condition and replica-count change."""
        ns, last_seen = self.settings.namespace, None
        while True:
            try:
                job = self._call("custom", "get_namespaced_custom_object", PYTORCHJOB_GROUP, PYTORCHJOB_VERSION,
                                 ns, PYTORCHJOB_PLURAL, run_name)
            except Exception as err:
                if _api_error_status(err) == 404:
                    raise RuntimeError(f"PyTorchJob {run_name} was deleted while the run was in progress") from err
                raise
            status = job.get("status") or {}
            current = latest_condition(status)
            replicas = {k: {c: v for c, v in sorted(r.items()) if isinstance(v, int)}
                        for k, r in sorted((status.get("replicaStatuses") or {}).items())}
            seen = (current.get("type"), current.get("reason"), repr(replicas))
            if seen != last_seen:
                logger.info("PyTorchJob %s: %s (%s) %s replicas=%s", run_name, current.get("type", "Pending"),
                            current.get("reason", "-"), current.get("message", ""), replicas)
                last_seen = seen
            if current.get("type") == "Succeeded":
                return
            if current.get("type") == "Failed":
                raise RuntimeError(f"PyTorchJob {run_name} failed: {current.get('reason', 'unknown reason')}: "
                                   f"{current.get('message', '')}\n{self._log_tails(run_name)}")
            if self.clock() >= deadline:
                raise TimeoutError(f"PyTorchJob {run_name} did not finish within {timeout_s:.0f} s (last "
                                   f"condition: {current.get('type', 'none')}). Raise the timeout, or look at "
                                   f"`kubectl -n {ns} describe pytorchjob {run_name}`.\n{self._log_tails(run_name)}")
            self.sleep(min(self.poll_interval_s, max(deadline - self.clock(), 0.0)))

    def _log_tails(self, run_name: str) -> str:
        """The last LOG_TAIL_LINES lines of the trainer master pod and of the vLLM pod (best effort)."""
        parts = []
        for what, sel, container in (
            ("trainer master", f"{JOB_NAME_LABEL}={run_name},{REPLICA_TYPE_LABEL}=master", PYTORCH_CONTAINER),
            ("vLLM", ",".join(f"{k}={v}" for k, v in selector(run_name, "vllm").items()), "vllm"),
        ):
            try:
                pods = self._call("core", "list_namespaced_pod", self.settings.namespace, label_selector=sel)
                items = _items(pods)
                if not items:
                    parts.append(f"--- {what}: no pod found")
                    continue
                pod_name = _pod_name(items[0])
                log = self._call("core", "read_namespaced_pod_log", pod_name, self.settings.namespace,
                                 container=container, tail_lines=LOG_TAIL_LINES)
                parts.append(f"--- {what} pod {pod_name}, last {LOG_TAIL_LINES} lines:\n{log}")
            except Exception as err:  # noqa: BLE001 - logs are a courtesy; the failure itself is reported
                parts.append(f"--- {what}: could not read logs: {err}")
        return "\n".join(parts)


def latest_condition(status: dict[str, Any]) -> dict[str, Any]:
    """The PyTorchJob's current state: a terminal condition that is True, else the last True one ({} if none).

    Args:
        status: the job's `.status` (conditions as the Training Operator writes them).
    """
    true = [c for c in status.get("conditions") or [] if str(c.get("status")) == "True"]
    for c in true:
        if c.get("type") in TERMINAL_CONDITIONS:
            return c
    return true[-1] if true else {}


def _items(pod_list: Any) -> list[Any]:
    return pod_list.get("items", []) if isinstance(pod_list, dict) else list(pod_list.items or [])


def _pod_name(pod: Any) -> str:
    return pod["metadata"]["name"] if isinstance(pod, dict) else pod.metadata.name


def _default_apis(core: Any, apps: Any, networking: Any, custom: Any) -> dict[str, Any]:
    """The given API clients, the missing ones made from the in-cluster config, else ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return {"core": core or client.CoreV1Api(), "apps": apps or client.AppsV1Api(),
            "networking": networking or client.NetworkingV1Api(), "custom": custom or client.CustomObjectsApi()}

