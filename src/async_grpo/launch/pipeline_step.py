"""What the KFP steps share: the run config a step resolves from its parameters, and the launch backend it drives.

The train step and `async-grpo pipeline submit` (which checks a run before it is submitted) merge the same
parameters the same way, through `resolve_run_config`; the train, evaluate and cleanup steps choose their backend
through `backend_for`. A component body is then its parameters and one call into the package: `train_step`,
`evaluate_step`, `register_step` and `cleanup_step` hold each step's whole order (`prepare_dataset` still holds
its own body, calls into `dataset_source` and `hub`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from async_grpo.config import ConfigError, GRPOConfig, config_from_mapping, flat_dump, flatten_mapping
from async_grpo.launch.base import LaunchBackend

logger = logging.getLogger(__name__)

LAUNCH_BACKENDS = ("local", "kubernetes")


def resolve_run_config(
    config_yaml: str,
    knobs: Mapping[str, Any],
    extra_overrides: Sequence[str] = (),
    *,
    tracking_uri: str = "",
    default_tracking_uri: str = "",
    pinned: Mapping[str, Any] | None = None,
) -> GRPOConfig:
    """The run's GRPOConfig from a pipeline's parameters. Precedence (later wins): `config_yaml`; each knob that is
    neither None nor ""; the step's MLflow URI; `pinned` (what the step owns: the run's name, its folder, the staged
    datasets); then `extra_overrides` (`key=value`, values parsed as YAML), which may not change a pinned field.

    Args:
        config_yaml: a GRPOConfig YAML document, flat TRL names or nested sections (may be empty).
        knobs: typed pipeline parameters that are GRPOConfig fields (flat names).
        extra_overrides: `key=value` items, as on the command line.
        tracking_uri: the step's `mlflow_tracking_uri` parameter: it wins when given.
        default_tracking_uri: used when neither `tracking_uri`, the YAML nor a knob names one (a cluster step passes
            its mounted MLFLOW_TRACKING_URI); else the config's default (sqlite under output_dir).
        pinned: flat GRPOConfig field names -> the values the step sets.

    Raises:
        ConfigError: `config_yaml` is not a YAML mapping, the merged config is invalid (naming the field), or an
            override changes a pinned field (naming it and the pipeline parameter to use instead).
    """
    base = yaml.safe_load(config_yaml) if config_yaml.strip() else {}
    if not isinstance(base, dict):
        raise ConfigError("config_yaml must be a YAML mapping of GRPOConfig field: value.")
    base = flatten_mapping(base)  # flat names, so the knobs and settings below replace a nested spelling
    base.update({k: v for k, v in knobs.items() if v is not None and v != ""})
    if tracking_uri:
        base["mlflow_tracking_uri"] = tracking_uri
    elif not base.get("mlflow_tracking_uri") and default_tracking_uri:
        base["mlflow_tracking_uri"] = default_tracking_uri
    base.update(pinned or {})
    config = config_from_mapping(base, list(extra_overrides))
    resolved = flat_dump(config)
    changed = sorted(name for name, value in (pinned or {}).items() if resolved[name] != value)
    if changed:  # a run may not take another run's name or folders: cleanup and MLflow key on them
        raise ConfigError(
            f"extra_overrides may not set {changed}: the pipeline sets them (the run's unique name, its "
            "folder and the staged dataset). Fix: use the pipeline's run_name, work_dir and dataset "
            "parameters instead."
        )
    return config


def check_pipeline_config(config: GRPOConfig) -> None:
    """What the pipeline needs of a run it trains: a saved final model and MLflow tracking (the evaluate and
    register steps read both).

    Raises:
        ConfigError: save_model is false or report_to is not mlflow (the message names the fix).
    """
    if not config.checkpoint.save_model:
        raise ConfigError(
            "save_model is false, but the pipeline evaluates and registers the checkpoint. Fix: drop save_model=false."
        )
    if config.tracking.report_to != "mlflow":
        raise ConfigError(
            "report_to is none, but the pipeline evaluates and registers the model through the "
            "run's MLflow run. Fix: report_to: mlflow."
        )


def check_backend_name(launch_backend: str) -> None:
    """Raises ValueError: `launch_backend` is not one of LAUNCH_BACKENDS."""
    if launch_backend not in LAUNCH_BACKENDS:
        raise ValueError(f"launch_backend={launch_backend!r} is not one of 'local', 'kubernetes'.")


def check_backend(launch_backend: str) -> None:
    """The backend a step may use here: a known name, and not `local` inside a cluster pod whose policy does not
    allow it (`k8s_policy.check_backend_choice`: it would run the submitter's code beside the step's credentials).

    Raises:
        ValueError: an unknown `launch_backend`.
        PolicyViolation: `local` inside a cluster pod.
    """
    from async_grpo.launch.k8s_policy import check_backend_choice

    check_backend_name(launch_backend)
    check_backend_choice(launch_backend)


def backend_for(
    launch_backend: str, backend_options: Mapping[str, Any] | None = None, trainer_api: str = ""
) -> LaunchBackend:
    """The launch backend a step drives: `LocalBackend` (every role a subprocess here) or `KubernetesBackend` over
    `backend_options` (`ClusterSettings` fields) with `trainer_api` merged in; the latter is imported only then. Builds
    nothing remote and loads no credential (the kubernetes backend reads the mounted platform policy).

    Raises:
        ValueError: an unknown `launch_backend`.
        PolicyViolation: `local` inside a cluster pod the policy does not allow it in (`k8s_policy.check_backend_choice`),
            or cluster settings the policy refuses (the namespace).
        ConfigError: `backend_options` are not valid cluster settings.
    """
    check_backend(launch_backend)
    if launch_backend == "local":
        from async_grpo.launch.local import LocalBackend

        if backend_options:
            logger.warning("backend_options %s are ignored by the local backend", sorted(backend_options))
        return LocalBackend()
    from async_grpo.launch.k8s_settings import with_trainer_api
    from async_grpo.launch.kubernetes import KubernetesBackend

    return KubernetesBackend(settings=with_trainer_api(backend_options, trainer_api))
