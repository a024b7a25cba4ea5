"""Every field of the run config and the cluster settings declares who may set it on a cluster (`config.trust`), and
the platform policy's gate is derived from those declarations (`k8s_policy.trust_problems`). A field added without
a class, or a policy key without a checker, fails here before it can reach a cluster."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from async_grpo.config import GRPOConfig
from async_grpo.config.sections import SECTIONS, RunFields
from async_grpo.config.trust import Trust, declared_trust, tenant, trust_table
from async_grpo.launch import k8s_policy
from async_grpo.launch.k8s_policy import POLICY_CHECKS, declared_fields, trust_markdown_table
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import PlatformPolicy

MODELS: list[type[BaseModel]] = [RunFields, *SECTIONS.values(), ClusterSettings]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "security.md"
# A field whose name says it names a program, interpreter, sandbox, image, host, runtime, queue, priority class,
# secret, account, identity or placement is never `tenant`.
NOT_FREE = re.compile(
    r"image|_url$|_uri$|bwrap|interpreter|sandbox|runtime|priority|queue|secret|account|namespace|"
    r"selector|toleration|run_as|resource$|mount|pvc|_env$|extra_args|remote_code|init_kwargs|producer|environment$"
)


def all_fields() -> list[tuple[type[BaseModel], str]]:
    return [(model, name) for model in MODELS for name in model.model_fields]


def test_every_field_of_the_run_config_and_the_cluster_settings_declares_a_trust_class():
    missing = [f"{model.__name__}.{name}" for model, name in all_fields() if declared_trust(model, name) is None]
    assert not missing, f"fields without a trust class (async_grpo.config.trust): {missing}"
    # the walk covers every field GRPOConfig accepts: its top-level fields and every field of every section
    flat = {name for model in MODELS[:-1] for name in model.model_fields}
    assert set(GRPOConfig.model_fields) - set(SECTIONS) <= flat
    assert len(declared_fields(GRPOConfig(), ClusterSettings())) == sum(len(m.model_fields) for m in MODELS)


def test_a_field_added_without_a_class_makes_the_gate_refuse_every_run(monkeypatch):
    class Grown(ClusterSettings):
        new_feature_binary: str = Field("/usr/bin/x", description="a field a feature adds, unclassified")

    monkeypatch.setattr(k8s_policy, "ClusterSettings", Grown)
    with pytest.raises(ValueError, match=r"new_feature_binary declares no trust class"):
        declared_fields(GRPOConfig(), Grown())


def test_each_policy_key_names_a_policy_field_and_has_a_checker():
    keys = {t.policy_key for model in MODELS for _, t in trust_table(model) if t and t.trust is Trust.POLICY}
    assert keys <= set(POLICY_CHECKS), sorted(keys - set(POLICY_CHECKS))
    assert keys - {"own_namespace"} <= set(PlatformPolicy.model_fields)
    assert set(POLICY_CHECKS) - {"own_namespace"} <= set(PlatformPolicy.model_fields)


def test_nothing_that_names_a_program_host_image_or_identity_is_free():
    free = [
        f"{model.__name__}.{name}"
        for model, name in all_fields()
        if NOT_FREE.search(name) and declared_trust(model, name).trust is Trust.TENANT
    ]
    assert not free
    strict = {
        "python_tool_bwrap": Trust.PLATFORM,
        "python_tool_interpreter": Trust.PLATFORM,
        "python_tool_sandbox": Trust.PLATFORM,
        "vllm_url": Trust.PLATFORM,
        "run_as_user": Trust.PLATFORM,
        "gpu_resource": Trust.PLATFORM,
        "trainer_runtime": Trust.POLICY,
        "priority_class_name": Trust.POLICY,
        "kueue_queue_name": Trust.POLICY,
        "tools": Trust.CODE,
        "reward_funcs": Trust.CODE,
        "environment": Trust.CODE,
        "data_producer": Trust.CODE,
    }
    declared = {name: declared_trust(model, name).trust for model, name in all_fields()}
    assert {name: declared[name] for name in strict} == strict


def test_a_tenant_field_stays_free_and_an_unknown_class_is_named():
    class Odd(BaseModel):
        ok: int = Field(1, json_schema_extra=tenant())
        bad: int = Field(1, json_schema_extra={"trust": "whoever"})

    assert declared_trust(Odd, "ok").trust is Trust.TENANT
    with pytest.raises(ValueError, match=r"Odd.bad declares trust='whoever'"):
        declared_trust(Odd, "bad")


def test_platform_settings_name_only_platform_only_cluster_fields():
    PlatformPolicy(platform_settings={"run_as_user": 2000, "gpu_resource": "amd.com/gpu"})
    with pytest.raises(ValueError, match=r"platform_settings names \['trainer_cpu'\]"):
        PlatformPolicy(platform_settings={"trainer_cpu": 4})
    with pytest.raises(ValueError):
        PlatformPolicy(platform_settings={"run_as_user": 0})  # validated as the field is (never root)


def test_docs_security_holds_the_table_generated_from_the_code():
    text = DOCS.read_text()
    table = text.split("<!-- trust-table -->\n", 1)[1].split("\n<!-- /trust-table -->", 1)[0]
    assert table == trust_markdown_table(), (
        "docs/security.md's trust table is stale. Fix: paste the output of "
        '`python -c "from async_grpo.launch.k8s_policy import trust_markdown_table as t; print(t())"` between its '
        "trust-table markers."
    )
