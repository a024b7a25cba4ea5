"""Choosing the rollout: tools make the run multi-turn, and bad tools, string prompts or a chat template that cannot
carry tool calls are refused during setup, before vLLM (or anything else expensive) starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_grpo.config import GRPOConfig
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import SingleTurnRollout
from async_grpo.runner.recipe import GRPORecipe
from async_grpo.runner.tool_setup import build_rollout, warm_start_pairs
from async_grpo.tasks import get_task
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.trainer.distributed import DistInfo

FNS = Path(__file__).parents[1] / "tools" / "tool_fns.py"


def setup_until_inference(config: GRPOConfig) -> GRPORecipe:
    """Run `setup` until it would start vLLM (stopped there), so only the cheap checks and builders run."""
    recipe = GRPORecipe(config, DistInfo(), progress=False)

    def start_inference(path):
        raise RuntimeError("inference would start here")

    with pytest.raises(RuntimeError, match="inference would start here"):
        recipe.setup(start_inference)
    return recipe


def base(tmp_path, **kw) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(tmp_path / "run"),
        dataset="builtin:calc",
        reward_funcs=["builtin:calc_exact_match"],
        reward_num_workers=1,
        **kw,
    )


def test_tools_make_the_rollout_multi_turn_and_cleanup_stops_the_tool_workers(tmp_path):
    recipe = setup_until_inference(base(tmp_path, tools=["builtin:calculator"]))
    rollout = recipe.rollout
    assert isinstance(rollout, EnvironmentRollout) and rollout.tools is not None
    assert rollout.tools.offered(recipe.train_items[0].columns) == ["calculator"] and rollout.max_turns is None
    recipe.scorer.close()
    rollout.close()
    assert rollout.tools.backend.closed
    plain = setup_until_inference(base(tmp_path))
    assert isinstance(plain.rollout, SingleTurnRollout)
    plain.scorer.close()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"tools": [f"{FNS}:untyped"]}, "missing a type hint"),
        ({"tools": [f"{FNS}:add", "tests/tools/tool_fns.py:add"]}, "several tools are named"),
        ({"tools": ["builtin:abacus"]}, "no builtin tool"),
    ],
)
def test_bad_tools_are_refused_before_inference_starts(tmp_path, overrides, says):
    recipe = GRPORecipe(base(tmp_path, **overrides), DistInfo(), progress=False)
    started = []
    with pytest.raises(ValueError, match=says):
        recipe.setup(lambda path: started.append(path))
    assert not started
    recipe.cleanup("FAILED")


def test_string_prompts_are_refused_with_tools(tmp_path):
    data = tmp_path / "plain.jsonl"
    data.write_text(json.dumps({"prompt": "12*34", "answer": "408"}) + "\n")
    config = base(tmp_path, tools=["builtin:calculator"]).model_copy(update={"dataset": str(data)})
    recipe = GRPORecipe(config, DistInfo(), progress=False)
    started = []
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        recipe.setup(lambda path: started.append(path))
    assert not started
    recipe.cleanup("FAILED")


def test_warm_start_pairs_are_one_per_assistant_turn_with_tool_results_as_context():
    tok = build_tiny_tokenizer()
    pairs = warm_start_pairs(GRPOConfig(dataset="builtin:calc"), get_task("calc"), tok, 3, [])
    assert len(pairs) == 6
    (ctx1, turn1), (ctx2, turn2) = pairs[:2]
    assert tok.decode(turn1).startswith('<tool_call>{"name": "calculator"') and tok.decode(turn1).endswith("<|im_end|>")
    assert tok.decode(ctx2).endswith("<|im_end|>\n<|im_start|>assistant\n") and "<|im_start|>tool\n" in tok.decode(ctx2)
    assert tok.decode(turn2)[: -len("<|im_end|>")].isdigit()


def test_an_environment_makes_the_rollout_an_environment_rollout_and_a_bad_one_is_refused_first(tmp_path):
    from async_grpo.environments import EnvironmentSpecError
    from async_grpo.orchestrator.env_rollout import EnvironmentRollout

    def env_config(**kw) -> GRPOConfig:
        return GRPOConfig(
            output_dir=str(tmp_path / "run"), dataset="builtin:guess", reward_funcs=["builtin:env_reward"],
            reward_num_workers=1, max_turns=3, **kw,
        )  # fmt: skip

    recipe = setup_until_inference(env_config(environment="builtin:guess"))
    assert isinstance(recipe.rollout, EnvironmentRollout) and recipe.rollout.max_turns == 3
    assert recipe.rollout.tools is None
    recipe.scorer.close()
    recipe.rollout.close()
    recipe = setup_until_inference(env_config(environment="builtin:guess", tools=["builtin:calculator"]))
    tools = recipe.rollout.tools  # the environment with tools: one rollout, the game inside the tool environment
    assert tools is not None and tools.inner is not None and recipe.rollout.max_turns == 3
    assert recipe.rollout.tool_schemas == [tools.schemas["calculator"]]
    recipe.scorer.close()
    recipe.rollout.close()
    assert tools.backend.closed
    for spec, says in (
        ("tests.environments.envs:WrongSignatureEnv", r"reset\(row, state\)"),
        ("no_such_module_q7:make", "cannot import"),
    ):
        recipe = GRPORecipe(env_config(environment=spec), DistInfo(), progress=False)
        started: list = []
        with pytest.raises(EnvironmentSpecError, match=says):
            recipe.setup(started.append)
        assert not started
        recipe.cleanup("FAILED")


def test_the_rollouts_record_spans_only_when_the_run_traces_episodes(tmp_path):
    tok = build_tiny_tokenizer()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for steps in (0, 5):
        single = build_rollout(base(tmp_path, log_traces_steps=steps), object(), tok, decode, [])
        assert isinstance(single, SingleTurnRollout) and single.record_spans == (steps > 0)
        env = build_rollout(
            base(tmp_path, log_traces_steps=steps, environment="builtin:guess"), object(), tok, decode, []
        )
        assert isinstance(env, EnvironmentRollout) and env.record_spans == (steps > 0)
        env.close()
        tools = build_rollout(
            base(tmp_path, log_traces_steps=steps, tools=["builtin:calculator"]), object(), tok, decode, []
        )
        assert isinstance(tools, EnvironmentRollout) and tools.record_spans == (steps > 0)
        assert tools.without_tools().record_spans == (steps > 0)
        tools.close()
