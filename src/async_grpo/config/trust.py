"""Who may set a field on a cluster: the trust class every run-config and cluster-settings field declares.

On a shared cluster the submitter of a run is a tenant, and the run config (`GRPOConfig`) and the cluster settings
(`launch.k8s_settings.ClusterSettings`, the pipeline's `kubernetes_options`) are theirs to write. Each field says,
where it is defined (`Field(..., json_schema_extra=<one of the functions below>)`), which of five classes it is in:

    tenant        free: any valid value (learning rates, batch sizes, timeouts, resource sizes under the quota)
    volume_path   a path on the shared workspace volume (one checker: `k8s_policy.on_volume`), or a safe default
                  or builtin; the run pods reach no hub and nothing else
    code          names code that will run (a reward function, tool, producer, environment, remote model code):
                  a builtin, a file on the volume, or a module the policy lists, run only where no credential is
    policy        a value from an allow-list in the platform policy (`PlatformPolicy.<policy_key>`): images,
                  servers, secrets, volumes, vLLM flags, GPUs per pod, queues, priority classes, runtimes
    platform      platform-only: a tenant may leave it out or repeat the platform's value
                  (`PlatformPolicy.platform_settings`, else the default); any other value is refused

`launch.k8s_policy.check_run` is derived from these declarations: it walks every field of both models and applies
its class's checker, so a field added without a class fails `tests/test_trust.py` before it can reach a cluster,
and a field classed `policy` whose key has no checker fails it too. Whatever names a program, interpreter,
sandbox mode, runtime, priority class, queue, image or host is never `tenant`.

This module imports only pydantic: the config sections and the cluster settings both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

__all__ = [
    "Trust",
    "TrustClass",
    "code",
    "declared_trust",
    "platform_only",
    "policy_list",
    "tenant",
    "trust_table",
    "volume_path",
]

TRUST_KEY = "trust"  # the key of a field's json_schema_extra that holds its class
POLICY_KEY = "policy_key"  # ... and, for `policy` and `code`, the PlatformPolicy field that decides


class Trust(StrEnum):
    """The five trust classes (module docstring)."""

    TENANT = "tenant"
    VOLUME_PATH = "volume_path"
    CODE = "code"
    POLICY = "policy"
    PLATFORM = "platform"


@dataclass(frozen=True)
class TrustClass:
    """A field's declared class.

    Attributes:
        trust: the class.
        policy_key: for `policy`, the `PlatformPolicy` field that lists the allowed values (e.g. "images",
            "mlflow_tracking_uris"); for `code`, "user_code_with_credentials"; None otherwise.
    """

    trust: Trust
    policy_key: str | None = None


def tenant() -> dict[str, Any]:
    """`json_schema_extra` of a field a tenant may set freely."""
    return {TRUST_KEY: Trust.TENANT.value}


def volume_path() -> dict[str, Any]:
    """`json_schema_extra` of a path that must lie on the shared workspace volume on a cluster (its default, a builtin
    or, for the model, a `models:/` registry URI excepted; see `k8s_policy.volume_path_problems`)."""
    return {TRUST_KEY: Trust.VOLUME_PATH.value}


def code() -> dict[str, Any]:
    """`json_schema_extra` of a field naming code that will run (`k8s_policy.code_problems`): refused where it would
    run beside credentials unless the policy's `user_code_with_credentials` allows it."""
    return {TRUST_KEY: Trust.CODE.value, POLICY_KEY: "user_code_with_credentials"}


def policy_list(key: str) -> dict[str, Any]:
    """`json_schema_extra` of a field whose value must be allowed by `PlatformPolicy.<key>`."""
    return {TRUST_KEY: Trust.POLICY.value, POLICY_KEY: key}


def platform_only() -> dict[str, Any]:
    """`json_schema_extra` of a field only the platform sets (`PlatformPolicy.platform_settings`)."""
    return {TRUST_KEY: Trust.PLATFORM.value}


def declared_trust(model: type[BaseModel], name: str) -> TrustClass | None:
    """The class field `name` of `model` declares, or None when it declares none.

    Raises:
        KeyError: `model` has no field `name`.
        ValueError: the declaration names an unknown class (the message names the field).
    """
    extra = model.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or TRUST_KEY not in extra:
        return None
    try:
        trust = Trust(extra[TRUST_KEY])
    except ValueError:
        raise ValueError(
            f"{model.__name__}.{name} declares trust={extra[TRUST_KEY]!r}. Fix: use one of "
            f"{[t.value for t in Trust]} (async_grpo.config.trust)."
        ) from None
    key = extra.get(POLICY_KEY)
    return TrustClass(trust, key if isinstance(key, str) else None)


def trust_table(model: type[BaseModel]) -> list[tuple[str, TrustClass | None]]:
    """(field name, declared class or None) for every field of `model`, in definition order."""
    return [(name, declared_trust(model, name)) for name in model.model_fields]


def trust_markdown(models: list[tuple[str, type[BaseModel]]]) -> str:
    """A markdown table of every field of `models` ((label, model) pairs) with its trust class and, for `policy`
    fields, the PlatformPolicy key that decides: the table docs/security.md shows (`launch.k8s_policy.trust_markdown_table`).

    Raises:
        ValueError: a field declares no class (the message names it).
    """
    rows = ["| where | field | who may set it on a cluster | decided by |", "| --- | --- | --- | --- |"]
    for label, model in models:
        for name, trust in trust_table(model):
            if trust is None:
                raise ValueError(f"{model.__name__}.{name} declares no trust class. Fix: see async_grpo.config.trust.")
            decided = f"`PlatformPolicy.{trust.policy_key}`" if trust.policy_key else ""
            if trust.trust is Trust.PLATFORM:
                decided = "`PlatformPolicy.platform_settings`"
            elif trust.trust is Trust.VOLUME_PATH:
                decided = "the workspace volume"
            rows.append(f"| {label} | `{name}` | {trust.trust.value} | {decided} |")
    return "\n".join(rows)
