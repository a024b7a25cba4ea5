"""The verifiers adapter (`environment: verifiers:<env-id or module:Name>`): a verifiers 0.4 environment, defined
here, is resolved and then refused with the reason (it samples the model itself, so token in / token out cannot be
kept) and the fix; an unknown id, a missing attribute and a missing package are named as such; config accepts the
spec forms and preflight refuses them off the local target without importing verifiers."""

from __future__ import annotations

import sys

import pytest

from async_grpo.environments import EnvironmentSpecError, load_environment
from async_grpo.environments.verifiers_adapter import REFUSAL

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed")

M = "verifiers:tests.environments.test_verifiers_adapter"


class CountingEnv(vf.Env):
    """A counting game in verifiers 0.4's shape: the env drives the agent, which samples the model itself."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn("Count to three.")
            while not reply.terminated and "3" not in reply.last_reply:
                reply = await chat.turn("Go on.")


NOT_AN_ENV = object()


def test_a_verifiers_env_is_resolved_then_refused_with_the_reason_and_the_fix():
    with pytest.raises(EnvironmentSpecError) as err:
        load_environment(f"{M}:CountingEnv")
    message = str(err.value)
    assert "the verifiers Env CountingEnv" in message and "token in / token out" in message
    assert "Fix: port the environment" in message and "openenv:" in message


def test_a_builtin_verifiers_env_id_is_refused_too_and_an_unknown_id_is_named():
    with pytest.raises(EnvironmentSpecError, match="the verifiers Env UserSimEnv"):
        load_environment("verifiers:user-sim")
    with pytest.raises(EnvironmentSpecError, match="cannot load environment 'no-such-env'.*Fix: install"):
        load_environment("verifiers:no-such-env")


def test_other_objects_and_missing_attributes_are_named():
    with pytest.raises(EnvironmentSpecError, match="not a verifiers.v1.Env"):
        load_environment(f"{M}:NOT_AN_ENV")
    with pytest.raises(EnvironmentSpecError, match="no attribute 'Nope'"):
        load_environment(f"{M}:Nope")


def test_spec_forms_in_config():
    from async_grpo.config.sections.environments import EnvironmentsConfig

    for good in ("verifiers:user-sim", f"{M}:CountingEnv", "verifiers:envs/count.py:CountingEnv"):
        assert EnvironmentsConfig(environment=good).environment == good
    for bad in ("verifiers:", "verifiers:builtin:guess"):
        with pytest.raises(ValueError, match="environment spec"):
            EnvironmentsConfig(environment=bad)


def test_preflight_refuses_it_off_the_local_target_without_importing(monkeypatch):
    from async_grpo.config import GRPOConfig
    from async_grpo.preflight.inputs import check_environment

    monkeypatch.setitem(sys.modules, "verifiers", None)
    config = GRPOConfig(model_name_or_path="m", dataset="builtin:guess", environment="verifiers:user-sim")
    problems, _ = check_environment(config, local=False, row=None)
    assert len(problems) == 1 and REFUSAL in str(problems[0])


def test_a_missing_verifiers_package_is_named_with_the_fix(monkeypatch):
    for name in list(sys.modules):
        if name == "verifiers" or name.startswith("verifiers."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(EnvironmentSpecError, match="needs the verifiers package.*Fix: install"):
        load_environment("verifiers:user-sim")
