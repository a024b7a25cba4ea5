"""A Kubernetes API double: one in-memory namespace behind CoreV1Api, AppsV1Api, NetworkingV1Api and
CustomObjectsApi look-alikes that record every call.

Each call is checked against the real `kubernetes.client` method (it must exist, its positional
arguments must bind, its keyword arguments must be ones the real method accepts), so the backend
cannot drift from the real client while the tests stay offline.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client import ApiException

REAL_APIS = {
    "core": client.CoreV1Api,
    "apps": client.AppsV1Api,
    "networking": client.NetworkingV1Api,
    "custom": client.CustomObjectsApi,
}
API_GROUPS = {"core": "", "apps": "apps", "networking": "networking.k8s.io"}
RESOURCES = {
    "config_map": "configmaps",
    "service": "services",
    "deployment": "deployments",
    "network_policy": "networkpolicies",
    "pod": "pods",
    "pod_log": "pods/log",
    "secret": "secrets",
}
VERBS = {"create": "create", "delete": "delete", "patch": "patch", "list": "list", "get": "get", "read": "get"}


@functools.cache
def _accepted_kwargs(cls: type, method: str) -> frozenset[str]:
    src = inspect.getsource(getattr(cls, f"{method}_with_http_info"))
    block = re.search(r"all_params = \[(.*?)\]", src, re.S).group(1)
    return frozenset(re.findall(r"'(\w+)'", block)) | {"async_req", "_request_timeout"}


@dataclass
class Call:
    """One recorded API call."""

    api: str
    method: str
    args: tuple
    kwargs: dict

    @property
    def rbac(self) -> tuple[str, str, str]:
        """(apiGroup, resource, verb) this call needs."""
        verb, _, rest = self.method.partition("_namespaced_")
        if self.api == "custom":
            return self.args[0], self.args[3], VERBS[verb]
        return API_GROUPS[self.api], RESOURCES[rest], VERBS[verb]


class _Api:
    def __init__(self, cluster: FakeCluster, name: str):
        self._cluster, self._name = cluster, name

    def __getattr__(self, method: str) -> Callable[..., Any]:
        real = getattr(REAL_APIS[self._name], method)  # AttributeError: no such method on the real client

        def call(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(real).bind(None, *args, **kwargs)
            unknown = set(kwargs) - _accepted_kwargs(REAL_APIS[self._name], method)
            assert not unknown, f"{method} does not accept {unknown}"
            self._cluster.calls.append(Call(self._name, method, args, copy.deepcopy(kwargs)))
            return self._cluster.handle(self._name, method, args, kwargs)

        return call


CUSTOM_PLURALS = {"pytorchjobs": "PyTorchJob", "trainjobs": "TrainJob"}  # the custom kinds the backend uses


class FakeCluster:
    """The namespace's objects, keyed by (kind, name), and the calls that made them.

    Args:
        job_statuses: the job's (PyTorchJob or TrainJob) `.status` returned by successive reads; the last one repeats.
        fail_on_create: kind whose creation raises ApiException(403).
        fail_on_delete: kind whose deletion raises ApiException(500).
        logs: pod name -> log text.
    """

    def __init__(
        self,
        job_statuses: Iterable[dict] = ({},),
        *,
        fail_on_create: str | None = None,
        fail_on_delete: str | None = None,
        logs: dict[str, str] | None = None,
    ):
        self.calls: list[Call] = []
        self.objects: dict[tuple[str, str], dict] = {}
        self.statuses = list(job_statuses)
        self.reads = 0
        self.fail_on_create = fail_on_create
        self.fail_on_delete = fail_on_delete
        self.logs = logs or {}
        self.pods: list[client.V1Pod] = []
        self._uids = (f"uid-{i}" for i in itertools.count())
        self.apis = {name: _Api(self, name) for name in REAL_APIS}

    def add_pod(self, name: str, labels: dict[str, str]) -> None:
        """A pod the fake operator/Deployment would have made."""
        self.pods.append(client.V1Pod(metadata=client.V1ObjectMeta(name=name, labels=labels)))

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of KubernetesBackend."""
        return {
            "core_api": self.apis["core"],
            "apps_api": self.apis["apps"],
            "networking_api": self.apis["networking"],
            "custom_api": self.apis["custom"],
        }

    def methods(self) -> list[str]:
        """Method names called, in order."""
        return [c.method for c in self.calls]

    def rbac_used(self) -> set[tuple[str, str, str]]:
        """Every (apiGroup, resource, verb) the recorded calls needed."""
        return {c.rbac for c in self.calls}

    def handle(self, api: str, method: str, args: tuple, kwargs: dict) -> Any:
        verb, _, what = method.partition("_namespaced_")
        if what == "custom_object":  # args: group, version, namespace, plural, ...
            kind, rest = CUSTOM_PLURALS[args[3]], args[4:]
        elif what in ("pod", "pod_log"):
            return self._pods(verb, args, kwargs)
        else:
            kind, rest = "".join(w.capitalize() for w in what.split("_")), args
        if verb == "list":
            return self._list(kind, kwargs.get("label_selector", ""))
        return getattr(self, f"_{verb}")(kind, *rest, **kwargs) if verb != "create" else self._create(kind, rest[-1])

    def _list(self, kind: str, label_selector: str) -> dict:
        wanted = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        found = [
            copy.deepcopy(o)
            for (k, _), o in self.objects.items()
            if k == kind and wanted.items() <= o["metadata"].get("labels", {}).items()
        ]
        return {"items": found}

    def _create(self, kind: str, body: dict) -> dict:
        if kind == self.fail_on_create:
            raise ApiException(status=403, reason=f"Forbidden: cannot create {kind}")
        key = (body["kind"], body["metadata"]["name"])
        assert key[0] == kind, f"{kind} API used for a {key[0]}"
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"]["uid"] = next(self._uids)
        if kind == "Service" and "clusterIP" not in stored["spec"]:  # the API server allocates one
            stored["spec"]["clusterIP"] = f"10.96.0.{len(self.objects) + 10}"
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def _get(self, kind: str, name: str, **_: Any) -> dict:
        if (kind, name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        status = self.statuses[min(self.reads, len(self.statuses) - 1)]
        self.reads += 1
        return {**copy.deepcopy(self.objects[(kind, name)]), "status": copy.deepcopy(status)}

    def _patch(self, kind: str, name: str, namespace: str, body: dict, **_: Any) -> dict:
        obj = self.objects[(kind, name)]
        obj["metadata"].update(copy.deepcopy(body["metadata"]))
        return copy.deepcopy(obj)

    def _delete(self, kind: str, name: str, *_: Any, body: dict | None = None, **__: Any) -> dict:
        if kind == self.fail_on_delete:
            raise ApiException(status=500, reason="InternalError")
        if (kind, name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        uid = ((body or {}).get("preconditions") or {}).get("uid")
        if uid is not None and self.objects[(kind, name)]["metadata"]["uid"] != uid:
            raise ApiException(status=409, reason="Conflict: the UID in the precondition does not match")
        self.objects.pop((kind, name))
        self.collect_garbage()
        return {"status": "Success"}

    def collect_garbage(self) -> None:
        """What the API server's garbage collector does after a delete: remove every object one of whose owners is
        gone, until none is left (owners of owners included)."""
        while True:
            uids = {o["metadata"]["uid"] for o in self.objects.values()}
            orphans = [
                key
                for key, o in self.objects.items()
                if any(ref["uid"] not in uids for ref in o["metadata"].get("ownerReferences", []))
            ]
            if not orphans:
                return
            for key in orphans:
                self.objects.pop(key)

    def _pods(self, verb: str, args: tuple, kwargs: dict) -> Any:
        if verb == "list":
            wanted = dict(kv.split("=", 1) for kv in kwargs.get("label_selector", "").split(",") if kv)
            return client.V1PodList(items=[p for p in self.pods if wanted.items() <= (p.metadata.labels or {}).items()])
        return self.logs.get(args[0], "")


def condition(kind: str, reason: str = "", message: str = "") -> dict:
    """A PyTorchJob condition that is True."""
    return {"type": kind, "status": "True", "reason": reason or f"PyTorchJob{kind}", "message": message}


def status(*conditions: dict) -> dict:
    """A PyTorchJob status holding `conditions` (earlier ones flipped to False as the operator does)."""
    conds = [dict(c, status="False") for c in conditions[:-1]] + list(conditions[-1:])
    return {"conditions": conds, "replicaStatuses": {"Master": {"active": 1}}}


class FakeClock:
    """Monotonic seconds that advance only when the backend sleeps."""

    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        """Advance time by `seconds` (no real waiting)."""
        self.sleeps.append(seconds)
        self.now += seconds


class FakeTracking:
    """`RunTracking` double: hands out run ids and records terminations."""

    def __init__(self):
        self.created: list[tuple[str, str, str]] = []
        self.ended: list[tuple[str, str]] = []

    def create_run(self, tracking_uri: str, experiment_name: str, run_name: str) -> str:
        """Record and return a fixed id."""
        self.created.append((tracking_uri, experiment_name, run_name))
        return "mlflow-run-1"

    def end_run(self, tracking_uri: str, run_id: str, status: str) -> None:
        """Record the termination."""
        self.ended.append((run_id, status))
