"""The `environments` section: a multi-turn environment the model acts in (issue 25; docs/environments.md), its
turn limit (verifiers' `max_turns`) and how its calls are run, and the cross-field checks that involve it.

Only the spec syntax is checked here (this package imports no user code); whether the spec resolves to an
environment, implements the protocol and opens an episode on the dataset's first row is checked by preflight
(`preflight.inputs.check_environment`), before vLLM starts.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from async_grpo.config.sections.base import Section
from async_grpo.config.trust import code, tenant
from async_grpo.user_code import check_adapter_spec, parse_spec, split_adapter


class EnvironmentsConfig(Section):
    """A multi-turn environment: which one, how many turns, and each call's limits."""

    environment: str | None = Field(
        None,
        description="The environment the model acts in over several turns (docs/environments.md): "
        "`builtin:<name>` (builtin:guess), `pkg.module:factory` or `path/to/file.py:factory`, a factory called "
        "with no arguments returning an object with `async def reset(row, state)` and `async def step(action, "
        "state)`, each returning an `environments.Observation` (verifiers' MultiTurnEnv / OpenEnv's reset and "
        "step); or an adapter: `openenv:pkg.module:factory` / `openenv:file.py:factory` (an OpenEnv environment with "
        "a text action and text observations), `verifiers:pkg.module:make_env` / `verifiers:file.py:make_env` / "
        "`verifiers:<taskset-id>` / `verifiers:<env-id>+<taskset-id>` (a verifiers 0.4 Env; its harness's model "
        "calls are answered by the rollout's turns). "
        "Needs conversational prompts. With `tools` too, the environment gets tools: "
        "a turn that calls tools is answered by them, any other turn is the environment's action. None: "
        "single-turn rollouts (or tool calling alone with `tools`).",
        json_schema_extra=code(),
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Most model turns per episode (verifiers' name): after this many the episode ends (the last "
        "turn is still answered by the environment, so its reward counts). max_completion_length bounds the "
        "generated plus observation tokens of the whole episode. With an agent (`agent` or `agent_command`) it "
        "bounds the agent's model calls per episode: a call beyond it is refused with an API error the agent sees, "
        "counted as agent/faults/max_turns.",
        json_schema_extra=tenant(),
    )
    env_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Wall-clock limit of one environment call, reset or step (seconds): past it the sample ends, "
        "counted as env/failures/reset_timeout or step_timeout (a synchronous environment's thread is abandoned).",
        json_schema_extra=tenant(),
    )
    env_num_threads: int = Field(
        4,
        ge=1,
        description="Worker threads that run a synchronous environment's calls (an async one runs on the "
        "rollout's event loop).",
        json_schema_extra=tenant(),
    )

    @field_validator("environment")
    @classmethod
    def _spec_syntax(cls, spec: str | None) -> str | None:
        """The spec looks like `builtin:<name>`, `pkg.module:factory` or `path/file.py:factory`."""
        if spec is not None and split_adapter(spec)[0] is not None:
            check_adapter_spec(spec, error=ValueError)
        elif spec is not None:
            parse_spec(spec, what="environment spec", error=ValueError)
        return spec
