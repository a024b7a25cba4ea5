"""The credentials of a KFP pipeline step, mounted as Secret files instead of environment variables.

KFP's driver passes each step's inputs, the submitter's `config_yaml` and overrides included, inside the main
container's command (`--executor_input <JSON>`, `backend/src/v2/driver`), and the kubelet expands every `$(NAME)` in
a container's command to the value of the container's variable NAME ("Define Dependent Environment Variables",
Kubernetes docs). A step that held `MLFLOW_TRACKING_PASSWORD` or `HF_TOKEN` as an environment variable would so
hand it to any submitter who writes `run_name: $(MLFLOW_TRACKING_PASSWORD)`: the step receives the password as
the run's name and logs it to MLflow, where every reader of the experiment sees it. The pipeline therefore mounts
its Secrets as files (`kfp.kubernetes.use_secret_as_volume`, `pipelines/grpo_pipeline.py`), no credential is in
any step's container spec, and each step that needs one calls `load_step_secrets`, which puts the files'
contents into its own process environment, where the MLflow client and huggingface_hub read them as before.
Nothing is expanded inside a running process.

A step calls `load_step_secrets` only once it has decided on its run (in a cluster pod: the platform policy,
`k8s_policy.check_step`, and for train and evaluate with the kubernetes backend `check_run`), never before: a
submitter's `mlflow_tracking_uri` must be refused before the credentials are in the process, so that nothing (a
registry read, a warm-start download) can send them to the submitter's server first. The decision needs only the
server's address, which `load_tracking_uri` loads alone.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "HF_SECRET_DIR",
    "HF_SECRET_KEYS",
    "MLFLOW_CREDENTIAL_KEYS",
    "MLFLOW_SECRET_DIR",
    "MLFLOW_SECRET_KEYS",
    "REQUIRED_KEYS",
    "load_step_secrets",
    "load_tracking_uri",
]

MLFLOW_SECRET_DIR = "/etc/async-grpo/secrets/mlflow"  # the pipeline's MLflow Secret (`--mlflow-secret`)
HF_SECRET_DIR = "/etc/async-grpo/secrets/hf"  # the pipeline's hub token Secret (`--hf-token-secret`), dataset step
# The keys read from each Secret; a Secret's other keys stay files nobody reads.
# The credentials of the MLflow Secret (also what the launcher passes to trainer pods, by key: `k8s_pods`)
MLFLOW_CREDENTIAL_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", *MLFLOW_CREDENTIAL_KEYS)
HF_SECRET_KEYS = ("HF_TOKEN",)
# Keys a mounted Secret must hold: as `secretKeyRef` without `optional`, whose absence kept the pod from starting
REQUIRED_KEYS = frozenset({"MLFLOW_TRACKING_URI"})


def load_step_secrets(
    mounts: tuple[tuple[str, tuple[str, ...]], ...] = (
        (MLFLOW_SECRET_DIR, MLFLOW_SECRET_KEYS),
        (HF_SECRET_DIR, HF_SECRET_KEYS),
    ),
) -> list[str]:
    """Put the mounted Secret files of this step into `os.environ`, each under its key's name.

    A directory that does not exist (outside a cluster, in `kfp.local`, an optional Secret that is absent) is
    skipped, and so is an optional key without its file; a variable already set in this process is kept. A file's
    bytes become the value exactly (as `secretKeyRef` would have set them), decoded as UTF-8.

    Args:
        mounts: (directory, keys) pairs: where a Secret is mounted and which of its keys to read.

    Returns:
        The names of the variables set, in order (never their values).

    Raises:
        RuntimeError: a mounted Secret lacks a key of REQUIRED_KEYS (the message names the key and the fix); before
            this module, the kubelet refused to start such a step.
        UnicodeDecodeError: a file is not UTF-8 (an environment variable holds text).
    """
    return _load_files(mounts)


def load_tracking_uri(directory: str = MLFLOW_SECRET_DIR) -> list[str]:
    """Put only MLFLOW_TRACKING_URI of the mounted MLflow Secret into `os.environ`: the platform's server address,
    which is not a credential, and which a step needs to decide on its run (the platform policy's
    `mlflow_tracking_uris`) before it loads any credential with `load_step_secrets`. The same rules as there: a
    missing directory (kfp.local, a laptop) is skipped and a variable already set is kept.

    Args:
        directory: where the MLflow Secret is mounted.

    Returns:
        ["MLFLOW_TRACKING_URI"] when it was set from the file, else [].

    Raises:
        RuntimeError: the mounted Secret has no MLFLOW_TRACKING_URI (the message names the key and the fix).
        UnicodeDecodeError: the file is not UTF-8.
    """
    return _load_files(((directory, ("MLFLOW_TRACKING_URI",)),))


def _load_files(mounts: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """The loop of `load_step_secrets` (its rules and errors), shared with `load_tracking_uri`."""
    loaded = []
    for directory, keys in mounts:
        if not Path(directory).is_dir():
            continue
        for key in keys:
            path = Path(directory) / key
            if key in os.environ:
                continue
            if not path.is_file():
                if key in REQUIRED_KEYS:
                    raise RuntimeError(
                        f"the Secret mounted at {directory} has no key {key}. Fix: add it, e.g. kubectl create "
                        f"secret generic <name> --from-literal={key}=... (docs/deploy.md, the Secrets table)."
                    )
                continue
            os.environ[key] = path.read_bytes().decode("utf-8")
            loaded.append(key)
    return loaded
