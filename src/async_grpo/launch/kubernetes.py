"""The `kubernetes` launch backend: create a run's objects, wait on the PyTorchJob, always clean up.

The objects come from `k8s_objects.build_run_objects`; this module only talks to the API server, so
the API clients are constructor arguments and tests drive every path (success, Failed, timeout, an
error halfway through creation) with a recording double instead of a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from async_grpo.config import GRPOConfig
from async_grpo.launch.base import LaunchResult
from async_grpo.launch.k8s_api import (  # noqa: F401 - LAUNCHER_RBAC_RULES, latest_condition re-exported
    KIND_API,
    LAUNCHER_RBAC_RULES,
    api_error_status,
    as_dict,
    cluster_ip,
    default_apis,
    items,
    latest_condition,
    pod_name,
)
from async_grpo.launch.k8s_judge import add_judge_host_alias, is_judge_service
from async_grpo.launch.k8s_objects import (
    COMPONENT_LABEL,
    PYTORCH_CONTAINER,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    RUN_LABEL,
    Manifest,
    RunTokens,
    build_eval_reward_objects,
    build_run_objects,  # noqa: F401 - re-exported
    owner_reference,
    reward_url,
    run_selector,
    selector,
    trainer_config,
)
from async_grpo.launch.k8s_policy import check_namespace, prepare_run
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.k8s_trainjob import (
    JOBSET_NAME_LABEL,
    NODE,
    REPLICATED_JOB_LABEL,
    TRAINER_GROUP,
    TRAINER_VERSION,
    TRAINJOB_PLURAL,
    build_objects_for_api,
)
from async_grpo.launch.naming import k8s_run_name, make_run_name, resolve_run_name  # noqa: F401 - re-exported
from async_grpo.launch.platform_policy import PlatformPolicy, load_policy

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 10.0
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOG_TAIL_LINES = 80
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # set by the Training Operator on its pods
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"

# What `cleanup` deletes, in this order (vLLM's dev-mode endpoints first). Every other object of a run is owned by
# one of these and goes with it (the launcher's Role cannot delete ConfigMaps, Secrets, Services or NetworkPolicies).
_CLEANUP_KINDS = ("Deployment", "PyTorchJob", "TrainJob")
# The custom kinds the backend creates: kind -> (group, version, plural).
CUSTOM_KINDS = {
    "PyTorchJob": (PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL),
    "TrainJob": (TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL),
}
JOB_KINDS = frozenset(CUSTOM_KINDS)
SUCCEEDED_CONDITIONS = ("Succeeded", "Complete")  # PyTorchJob's, TrainJob's
_DELETED_KINDS = frozenset(_CLEANUP_KINDS)
EVAL_SERVICE_TIMEOUT_S = 600.0  # the evaluate step's reward service must be ready within this


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
        """Create `run_name` in `experiment_name` (created if missing, also when another run creates it at
        the same moment). Raises MlflowException if unreachable."""
        from mlflow import MlflowClient

        from async_grpo.lifecycle.pipeline_tracking import ensure_experiment

        client = MlflowClient(tracking_uri)
        exp_id = ensure_experiment(client, experiment_name)
        return client.create_run(exp_id, run_name=run_name, tags={"async_grpo.backend": "kubernetes"}).info.run_id

    def end_run(self, tracking_uri: str, run_id: str, status: str) -> None:
        """Set the run's terminal status."""
        from mlflow import MlflowClient

        MlflowClient(tracking_uri).set_terminated(run_id, status)


class KubernetesBackend:
    """`LaunchBackend` that runs the trainer as a PyTorchJob beside a vLLM Deployment and reward workers.

    Args:
        settings: a `ClusterSettings`, or a mapping of its fields (None: defaults; in a pod, the
            namespace defaults to the pod's own, read from SA_NAMESPACE_FILE). The pipeline passes its
            `kubernetes_options` here, so a submitter reaches nothing but ClusterSettings fields.
        policy: the platform's allow-list; None loads it (`platform_policy.load_policy`: $ASYNC_GRPO_POLICY_FILE,
            the mounted ConfigMap, else the built-in defaults).
        core_api, apps_api, networking_api, custom_api: `kubernetes.client` CoreV1Api, AppsV1Api,
            NetworkingV1Api and CustomObjectsApi (or doubles); those left None are made on first use from
            the in-cluster config, else ~/.kube/config.
        tracking: creates/ends the MLflow run (default: `MlflowRunTracking`).
        run_name: object-name prefix; default `resolve_run_name(config)`.
        poll_interval_s: seconds between PyTorchJob status reads.
        clock, sleep: time sources (monotonic seconds), injectable for tests.
        **setting_fields: `ClusterSettings` fields, overriding `settings`.

    Raises:
        ConfigError: unknown or invalid settings (the message names the field), or an invalid policy file.
        PolicyViolation: in a pod, `namespace` names another namespace than the pod's own.
    """

    name = "kubernetes"

    def __init__(
        self,
        settings: ClusterSettings | Mapping[str, Any] | None = None,
        *,
        policy: PlatformPolicy | None = None,
        core_api: Any = None,
        apps_api: Any = None,
        networking_api: Any = None,
        custom_api: Any = None,
        tracking: RunTracking | None = None,
        run_name: str | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        **setting_fields: Any,
    ):
        base = settings.model_dump() if isinstance(settings, ClusterSettings) else dict(settings or {})
        fields = {**base, **setting_fields}
        own_namespace = SA_NAMESPACE_FILE.read_text().strip() if SA_NAMESPACE_FILE.is_file() else None
        if "namespace" not in fields and own_namespace:  # in a pod: launch where we run
            fields["namespace"] = own_namespace
        self.settings = ClusterSettings.from_mapping(fields)
        check_namespace(self.settings, own_namespace)  # never another namespace than the pod's own
        if policy is None:
            policy, source = load_policy()
            logger.info("platform policy from %s", source)
        self.policy = policy
        self.apis = {"core": core_api, "apps": apps_api, "networking": networking_api, "custom": custom_api}
        self.tracking = tracking if tracking is not None else MlflowRunTracking()
        self.run_name = run_name
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.sleep = sleep

    # ------------------------------------------------------------------------------------------ launch
    def check(self, config: GRPOConfig) -> ClusterSettings:
        """The platform policy's verdict on `config` with these settings (`k8s_policy.prepare_run`), without any API
        call: the train step calls it before preflight reads any of the submitter's files, and `launch` again.

        Returns:
            The settings the run's objects are built with (the policy's default images filled in).

        Raises:
            PolicyViolation: one line per problem, each naming the field and the fix.
        """
        return prepare_run(config, self.settings, self.policy)

    def launch(self, config: GRPOConfig, *, timeout_s: float) -> LaunchResult:
        """Check the run against the platform policy, create its objects, wait for the PyTorchJob, clean up.

        With `trainer_api: trainjob` the job is a TrainJob (`k8s_trainjob`; no Deployments, so nothing but the job
        is ever deleted), waited on until Complete or Failed, kept and deleted exactly as the PyTorchJob.

        The PyTorchJob is created first; every other object is created with an ownerReference to it (its pods wait
        for their ConfigMap and Secret, and the base default-deny isolates them until their NetworkPolicies exist).
        When the run serves an LLM judge (`k8s_judge`), its Service's cluster IP, known once it is created, goes
        into the reward pods' hostAliases (they resolve no DNS). A distillation teacher the run serves (`k8s_teacher`) is
        reached by the trainer through DNS. The vLLM, judge, teacher and reward Deployments are deleted
        in every case; the PyTorchJob is kept after success (for its
        logs; `ttlSecondsAfterFinished` or `cleanup` removes it, and the garbage collector everything it owns) and
        deleted otherwise.

        Raises:
            PolicyViolation: the run asks for an image, account, secret, volume, MLflow server or vLLM flag
                the platform does not allow (before any API call).
            ValueError: the config cannot run on the cluster (e.g. a model path outside the PVC).
            TimeoutError: the PyTorchJob did not finish within `timeout_s` seconds.
            RuntimeError: the PyTorchJob Failed or vanished, or a run of that name exists; the message
                has the reason (and log tails).
            kubernetes.client.ApiException: the API server refused to create an object.
        """
        s = self.check(config)  # refuses before anything exists
        run_name = self.run_name or resolve_run_name(config.tracking)
        trainer_cfg = trainer_config(config, s, run_name)
        build_objects_for_api(config, s, run_name, policy=self.policy)
        uri = trainer_cfg.tracking.mlflow_tracking_uri
        mlflow_run_id = self.tracking.create_run(
            uri, config.tracking.mlflow_experiment_name, trainer_cfg.tracking.run_name
        )
        objects = build_objects_for_api(
            config, s, run_name, mlflow_run_id=mlflow_run_id, policy=self.policy, tokens=RunTokens.generate()
        )
        created: list[Manifest] = []
        succeeded = False
        status = "FAILED"
        deadline = self.clock() + timeout_s
        logger.info("launching run %s in namespace %s (MLflow run %s)", run_name, s.namespace, mlflow_run_id)
        try:
            job = next(o for o in objects if o["kind"] in JOB_KINDS)
            rest = [o for o in objects if o is not job]
            job_live = self._create(job)
            created.append(job)
            owner = owner_reference(job_live)
            for obj in rest:
                obj["metadata"]["ownerReferences"] = [owner]
                live = self._create(obj)
                created.append(obj)
                if is_judge_service(obj, run_name):  # reward pods resolve no DNS: pin the judge's address
                    for dep in rest:
                        if dep["kind"] == "Deployment" and dep["metadata"]["labels"].get(COMPONENT_LABEL) == "reward":
                            add_judge_host_alias(dep, run_name, s, cluster_ip(live) or "")
            self._wait(run_name, deadline, timeout_s, job["kind"])
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
                except Exception as err:
                    logger.warning("could not mark MLflow run %s %s: %s", mlflow_run_id, status, err)
        model_dir = f"{trainer_cfg.output_dir}/final-model" if config.checkpoint.save_model else None
        return LaunchResult(mlflow_run_id, uri, model_dir, {})

    @contextlib.contextmanager
    def reward_service(self, config: GRPOConfig, run_name: str) -> Iterator[tuple[str, str]]:
        """Serve `config`'s reward functions in a pod without credentials for as long as the block runs (the
        evaluate step scores there): objects `<run>-eval-*`, deleted on exit.

        Yields:
            (base URL, bearer token) of the service; reachable only from pods labelled EVALUATOR_LABELS.

        Raises:
            PolicyViolation: the run's images or settings are not allowed.
            kubernetes.client.ApiException: the API server refused an object.
        """
        s = prepare_run(config, self.settings, self.policy)
        name = self.run_name or k8s_run_name(run_name)
        tokens = RunTokens.generate()
        objects = build_eval_reward_objects(config, s, name, tokens, self.policy)
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        created: list[Manifest] = []
        try:
            owner = owner_reference(self._create(deployment))  # everything else goes with it
            created.append(deployment)
            for obj in objects:
                if obj is not deployment:
                    obj["metadata"]["ownerReferences"] = [owner]
                    self._create(obj)
                    created.append(obj)
            yield reward_url(name, s, "eval-reward"), tokens.reward_token
        finally:
            self._cleanup(created, keep_job=False)

    def cleanup(self, run_name: str) -> list[str]:
        """Delete every object a launch of `run_name` left (Deployments and the PyTorchJob, or with trainer_api
        trainjob the TrainJob), selected by the run's label (`async-grpo/run`),
        each by its uid, so nothing of another run is touched (the pipeline's exit handler calls this when
        the launching pod was killed before its own cleanup ran). Objects already gone are skipped.

        Args:
            run_name: the config's run_name (mapped through `k8s_run_name`) or the object-name prefix.

        Returns:
            "Kind/name" of each object deleted.

        Raises:
            kubernetes.client.ApiException: a listing failed, or a deletion failed for another reason than 404.
        """
        name = self.run_name or k8s_run_name(run_name)
        removed = []
        job_kind = "TrainJob" if self.settings.trainer_api == "trainjob" else "PyTorchJob"
        for kind in [k for k in _CLEANUP_KINDS if k not in JOB_KINDS or k == job_kind]:
            for obj in self._list(kind, run_selector(name)):
                meta = obj["metadata"]
                if (meta.get("labels") or {}).get(RUN_LABEL) != name:
                    continue  # the selector already says so; never delete on a name alone
                try:
                    self._delete({"kind": kind, "metadata": meta}, uid=meta.get("uid"))
                except Exception as err:
                    if api_error_status(err) not in (404, 409):  # gone, or replaced (uid precondition)
                        raise
                    continue
                logger.info("deleted %s %s", kind, meta["name"])
                removed.append(f"{kind}/{meta['name']}")
        return removed

    # ------------------------------------------------------------------------------------------ API calls
    def _call(self, api: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.apis[api] is None:
            self.apis.update(default_apis(**self.apis))
        return getattr(self.apis[api], method)(*args, **kwargs)

    def _create_raw(self, obj: Manifest) -> Manifest:
        kind, ns = obj["kind"], self.settings.namespace
        logger.info("creating %s %s", kind, obj["metadata"]["name"])
        if kind in CUSTOM_KINDS:
            group, version, plural = CUSTOM_KINDS[kind]
            return self._call("custom", "create_namespaced_custom_object", group, version, ns, plural, obj)
        api, suffix = KIND_API[kind]
        return self._call(api, f"create_namespaced_{suffix}", ns, obj)

    def _create(self, obj: Manifest) -> Manifest:
        try:
            return self._create_raw(obj)
        except Exception as err:
            if api_error_status(err) != 409:
                raise
            run = obj["metadata"]["labels"][RUN_LABEL]
            raise RuntimeError(
                f"{obj['kind']} {obj['metadata']['name']} already exists in namespace {self.settings.namespace}: "
                f"a run named {run!r} is there. Fix: choose another run_name, or remove the old run with "
                f"`kubectl -n {self.settings.namespace} delete pytorchjob {run}`."
            ) from err

    def _delete(self, obj: Manifest, uid: str | None = None) -> None:
        kind, name, ns = obj["kind"], obj["metadata"]["name"], self.settings.namespace
        kwargs: dict[str, Any] = {"propagation_policy": "Background"}
        if uid:  # delete exactly the object that was listed, not a namesake created since
            kwargs["body"] = {"preconditions": {"uid": uid}}
        if kind in CUSTOM_KINDS:
            group, version, plural = CUSTOM_KINDS[kind]
            self._call("custom", "delete_namespaced_custom_object", group, version, ns, plural, name, **kwargs)
            return
        api, suffix = KIND_API[kind]
        self._call(api, f"delete_namespaced_{suffix}", name, ns, **kwargs)

    def _list(self, kind: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of `kind` matching `label_selector`, as dicts with `metadata` (name, uid, labels)."""
        ns = self.settings.namespace
        if kind in CUSTOM_KINDS:
            group, version, plural = CUSTOM_KINDS[kind]
            out = self._call(
                "custom", "list_namespaced_custom_object", group, version, ns, plural, label_selector=label_selector
            )
        else:
            api, suffix = KIND_API[kind]
            out = self._call(api, f"list_namespaced_{suffix}", ns, label_selector=label_selector)
        return [as_dict(item) for item in items(out)]

    def _cleanup(self, created: list[Manifest], keep_job: bool) -> None:
        """Delete the Deployments that were created, newest first (vLLM goes first), then the PyTorchJob unless
        `keep_job`. Errors are logged, never raised, so they cannot hide the run's own error; an object already
        gone (404) is fine. Everything else is owned by one of these and left to the garbage collector."""
        for obj in reversed(created):
            if obj["kind"] not in _DELETED_KINDS or (keep_job and obj["kind"] in JOB_KINDS):
                continue
            try:
                self._delete(obj)
                logger.info("deleted %s %s", obj["kind"], obj["metadata"]["name"])
            except Exception as err:
                if api_error_status(err) != 404:
                    logger.warning(
                        "could not delete %s %s: %s (delete it with `kubectl delete -n %s -l async-grpo/run=%s`)",
                        obj["kind"],
                        obj["metadata"]["name"],
                        err,
                        self.settings.namespace,
                        obj["metadata"]["labels"].get("async-grpo/run"),
                    )

    # ------------------------------------------------------------------------------------------ waiting
    def _wait(self, run_name: str, deadline: float, timeout_s: float, kind: str = "PyTorchJob") -> None:
        """Poll the job (PyTorchJob or TrainJob) until Succeeded/Complete (return), Failed (RuntimeError) or the
        deadline (TimeoutError), logging each condition and replica-count change."""
        ns, last_seen = self.settings.namespace, None
        group, version, plural = CUSTOM_KINDS[kind]
        while True:
            try:
                job = self._call("custom", "get_namespaced_custom_object", group, version, ns, plural, run_name)
            except Exception as err:
                if api_error_status(err) == 404:
                    raise RuntimeError(f"{kind} {run_name} was deleted while the run was in progress") from err
                raise
            status = job.get("status") or {}
            current = latest_condition(status)
            replicas = {
                k: {c: v for c, v in sorted(r.items()) if isinstance(v, int)}
                for k, r in sorted((status.get("replicaStatuses") or {}).items())
            }
            seen = (current.get("type"), current.get("reason"), repr(replicas))
            if seen != last_seen:
                logger.info(
                    "%s %s: %s (%s) %s replicas=%s",
                    kind,
                    run_name,
                    current.get("type", "Pending"),
                    current.get("reason", "-"),
                    current.get("message", ""),
                    replicas,
                )
                last_seen = seen
            if current.get("type") in SUCCEEDED_CONDITIONS:
                return
            if current.get("type") == "Failed":
                raise RuntimeError(
                    f"{kind} {run_name} failed: {current.get('reason', 'unknown reason')}: "
                    f"{current.get('message', '')}\n{self._log_tails(run_name, kind)}"
                )
            if self.clock() >= deadline:
                raise TimeoutError(
                    f"{kind} {run_name} did not finish within {timeout_s:.0f} s (last "
                    f"condition: {current.get('type', 'none')}). Raise the timeout, or look at "
                    f"`kubectl -n {ns} describe {kind.lower()} {run_name}`.\n{self._log_tails(run_name, kind)}"
                )
            self.sleep(min(self.poll_interval_s, max(deadline - self.clock(), 0.0)))

    def _log_tails(self, run_name: str, kind: str = "PyTorchJob") -> str:
        """The last LOG_TAIL_LINES lines of the trainer master pod (TrainJob: the first `node` pod) and of the
        vLLM pod (best effort)."""
        parts = []
        if kind == "TrainJob":
            trainer = (f"{JOBSET_NAME_LABEL}={run_name},{REPLICATED_JOB_LABEL}={NODE}", NODE)
        else:
            trainer = (f"{JOB_NAME_LABEL}={run_name},{REPLICA_TYPE_LABEL}=master", PYTORCH_CONTAINER)
        for what, sel, container in (
            ("trainer master", *trainer),
            ("vLLM", ",".join(f"{k}={v}" for k, v in selector(run_name, "vllm").items()), "vllm"),
        ):
            try:
                pods = self._call("core", "list_namespaced_pod", self.settings.namespace, label_selector=sel)
                found = items(pods)
                if not found:
                    parts.append(f"--- {what}: no pod found")
                    continue
                name = pod_name(found[0])
                log = self._call(
                    "core",
                    "read_namespaced_pod_log",
                    name,
                    self.settings.namespace,
                    container=container,
                    tail_lines=LOG_TAIL_LINES,
                )
                parts.append(f"--- {what} pod {name}, last {LOG_TAIL_LINES} lines:\n{log}")
            except Exception as err:
                parts.append(f"--- {what}: could not read logs: {err}")
        return "\n".join(parts)
