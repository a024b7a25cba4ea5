"""The Kubernetes API as the `kubernetes` backend uses it: the RBAC it needs, which client serves each kind,
and small readers of API responses (client models and plain dicts alike, so test doubles can return either).
"""

from __future__ import annotations

from typing import Any

from async_grpo.launch.k8s_pods import PYTORCHJOB_GROUP, PYTORCHJOB_PLURAL

TERMINAL_CONDITIONS = ("Succeeded", "Complete", "Failed")  # PyTorchJob; TrainJob (Trainer v2) says Complete

# What the backend calls, as RBAC rules (apiGroup, resource) -> verbs. manifests/base/rbac.yaml grants
# exactly this; tests check both that the Role matches and that the calls the backend makes match.
# ConfigMaps, Secrets, Services and NetworkPolicies: create only. Every such object of a run is created with an
# ownerReference to its PyTorchJob (or, for the evaluate step's reward service, its Deployment) and goes with it
# through the garbage collector, so the launcher never needs to change or delete one, and cannot touch the
# platform's own (the policy ConfigMap, the default-deny NetworkPolicy, the MLflow Service). Secrets are never
# read or listed (that would read every secret of the namespace).
LAUNCHER_RBAC_RULES: dict[tuple[str, str], frozenset[str]] = {
    (PYTORCHJOB_GROUP, PYTORCHJOB_PLURAL): frozenset({"create", "get", "list", "delete"}),
    ("apps", "deployments"): frozenset({"create", "list", "delete"}),
    ("", "services"): frozenset({"create"}),
    ("", "configmaps"): frozenset({"create"}),
    ("", "secrets"): frozenset({"create"}),
    ("networking.k8s.io", "networkpolicies"): frozenset({"create"}),
    ("", "pods"): frozenset({"list"}),
    ("", "pods/log"): frozenset({"get"}),
}

# What the backend calls in addition with trainer_api trainjob (Kubeflow Trainer v2): granted by the kustomize
# component manifests/components/trainer-v2 only, so namespaces without Trainer v2 do not grant it. No watch: the
# backend polls with get, as for PyTorchJobs.
TRAINJOB_RBAC_RULES: dict[tuple[str, str], frozenset[str]] = {
    ("trainer.kubeflow.org", "trainjobs"): frozenset({"create", "get", "list", "delete"}),
}

# kind -> (API attribute of the backend, method suffix) for the built-in kinds.
KIND_API = {
    "ConfigMap": ("core", "config_map"),
    "Service": ("core", "service"),
    "Secret": ("core", "secret"),
    "Deployment": ("apps", "deployment"),
    "NetworkPolicy": ("networking", "network_policy"),
}


def api_error_status(err: BaseException) -> int | None:
    """The HTTP status of a `kubernetes.client.ApiException` (None for other errors)."""
    return getattr(err, "status", None)


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


def items(listing: Any) -> list[Any]:
    """The `items` of a list response (a client model or a dict)."""
    return listing.get("items", []) if isinstance(listing, dict) else list(listing.items or [])


def as_dict(obj: Any) -> dict[str, Any]:
    """A listed object as a dict with `metadata` {name, uid, labels} (client models or plain dicts)."""
    if isinstance(obj, dict):
        return obj
    meta = obj.metadata
    return {"metadata": {"name": meta.name, "uid": meta.uid, "labels": dict(meta.labels or {})}}


def cluster_ip(service: Any) -> str | None:
    """The `spec.clusterIP` of a created Service (a client model or a dict); None when it has none."""
    if isinstance(service, dict):
        return (service.get("spec") or {}).get("clusterIP")
    return getattr(service.spec, "cluster_ip", None) if service.spec is not None else None


def pod_name(pod: Any) -> str:
    """The name of a listed pod (a client model or a dict)."""
    return pod["metadata"]["name"] if isinstance(pod, dict) else pod.metadata.name


def default_apis(core: Any, apps: Any, networking: Any, custom: Any) -> dict[str, Any]:
    """The given API clients, the missing ones made from the in-cluster config, else ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return {
        "core": core or client.CoreV1Api(),
        "apps": apps or client.AppsV1Api(),
        "networking": networking or client.NetworkingV1Api(),
        "custom": custom or client.CustomObjectsApi(),
    }
