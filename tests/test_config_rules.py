"""The cross-field rules are one table (`config.rules.RULES`): each names real fields, says what it checks, and
every problem it raises names the fix."""

from __future__ import annotations

import pytest

from async_grpo.config import ConfigError, lookup_field
from async_grpo.config.io import config_from_mapping
from async_grpo.config.rules import RULES

# one config per rule that breaks it (flat names), so every rule's message is seen at least once
BROKEN = {
    "whole_groups_per_step": {"per_device_train_batch_size": 6, "num_generations": 4},
    "one_weight_per_reward": {"reward_funcs": ["builtin:reverse_exact_match"], "reward_weights": [1.0, 2.0]},
    "judge_is_reachable": {"reward_funcs": ["builtin:llm_judge"]},
    "judge_rubric_and_scale": {"reward_funcs": ["builtin:llm_judge"], "judge_url": "http://j:1/v1", "judge_rubric": "x"},
    "is_clip_below_cap": {"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_cap": 2.0},
    "liger_supports_the_loss": {"use_liger_kernel": True, "importance_sampling_level": "sequence", "loss_type": "cispo",
                                "epsilon_high": 5.0},
    "fsdp_runs_the_same_passes": {"fsdp": True, "logprob_chunk_size": 64},
    "prompt_sharing_layout": {"share_prompt_prefix": True, "batch_flattening": True},
    "cispo_caps_above_one": {"loss_type": "cispo"},
    "skipping_keeps_the_kl": {"skip_zero_advantage_batches": True, "beta": 0.1},
    "replay_has_work": {"replay_buffer_size": 4, "dynamic_sampling": True},
    "streaming_chunks_fit": {"streaming_min_groups": 3, "per_device_train_batch_size": 16, "num_generations": 4},
    "streaming_overlaps_generation": {"streaming_min_groups": 1, "resource_sharing": "time_slice"},
    "user_producer_replaces_the_orchestrator": {"data_producer": "x.py:f", "dynamic_sampling": True},
    "one_agent_drives_the_episodes": {"agent": "a.py:run", "environment": "builtin:guess"},
    "determinism_launches_by_schedule": {"full_determinism": True, "dynamic_sampling": True},
    "one_warmup_knob": {"warmup_ratio": 0.1, "warmup_steps": 5},
    "overlong_penalty_has_its_buffer": {"reward_funcs": ["builtin:soft_overlong_penalty"]},
    "room_for_a_prompt": {"max_completion_length": 4096, "vllm_max_model_len": 2048},
    "rollback_has_a_checkpoint": {"on_collapse": "rollback"},
    "python_tool_reports_its_timeout": {"tools": ["builtin:python"], "python_tool_timeout_s": 30.0,
                                        "tool_timeout_s": 10.0},
    "lora_sync_has_an_adapter": {"vllm_lora_sync": True},
    "distillation_has_one_teacher": {"teacher_url": "http://t:1/v1", "teacher_model_name_or_path": "/models/t"},
}  # fmt: skip


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_names_real_fields_and_says_what_it_checks(rule):
    assert all(lookup_field(name) is not None for name in rule.fields), rule.fields
    assert (rule.check.__doc__ or "").strip(), f"{rule.name} has no docstring"
    assert rule.name in BROKEN, f"add a config that breaks {rule.name} to BROKEN"


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_rule_is_refused_naming_the_fix(name):
    with pytest.raises(ConfigError, match="Fix:") as err:
        config_from_mapping(BROKEN[name])
    rule = next(r for r in RULES if r.name == name)
    assert any(field in str(err.value) for field in rule.fields), str(err.value)
