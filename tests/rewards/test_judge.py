"""The LLM judge's pure parts (issue 26): the score parser, the guided-answer regex, the rubric, the message
rendering and the config checks that refuse a judge run before anything starts. The judge against a real vLLM
server is tests/integration/test_judge.py."""

from __future__ import annotations

import re

import pytest

from async_grpo.config import ConfigError, load_config
from async_grpo.rewards import judge
from async_grpo.rewards.contract import JUDGE_FIELDS, bound_kwargs


@pytest.mark.parametrize(
    "answer, score",
    [
        ("Score: 7", 0.7),
        ("score=3", 0.3),
        ("The answer is fine.\n**Score:** 9", 0.9),  # a markdown-bold label
        ("Score: **9**", 0.9),
        ("Score: 4\nOn reflection, Score: 6", 0.6),  # the last one counts
        ("Score: 7.5", 0.75),
        ("Score: 10", 1.0),
        ("Score: 0", 0.0),
        ("Score: 11", None),  # outside the scale
        ("Score: -1", None),
        ("I would give it an eight.", None),
        ("", None),
    ],
)
def test_the_last_score_on_the_scale_is_the_reward(answer, score):
    assert judge.parse_score(answer, 10.0) == (pytest.approx(score) if score is not None else None)


def test_the_guided_regex_admits_exactly_the_scale():
    pattern = re.compile(judge.guided_regex(10))
    assert all(pattern.fullmatch(f"Score: {v}") for v in range(11))
    assert not pattern.fullmatch("Score: 11") and not pattern.fullmatch("Score: 7.5") and not pattern.fullmatch("7")
    with pytest.raises(ValueError, match="judge_max_score=7.5"):
        judge.guided_regex(7.5)
    with pytest.raises(ValueError, match="judge_max_score=1000"):
        judge.guided_regex(1000)


def test_the_rubric_takes_the_texts_verbatim_and_conversations_render_as_text():
    rubric = 'Q: {prompt}\nA: {completion}\nJSON like {"score": 1} is left alone.'
    out = judge.render_rubric(rubric, "what is {x}?", "{completion} literally")
    assert out == 'Q: what is {x}?\nA: {completion} literally\nJSON like {"score": 1} is left alone.'
    # a prompt that holds a placeholder keeps it: the texts are inserted in one pass, never searched again
    assert judge.render_rubric(rubric, "say {completion}", "hi").startswith("Q: say {completion}\nA: hi\n")
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert judge.text_of(conversation) == "system: be brief\nuser: 2+2?"
    assert judge.text_of([{"role": "assistant", "content": "4"}]) == "4"
    with pytest.raises(ValueError, match="judge_rubric has no {completion}"):
        judge.check_rubric("Rate {prompt}")


def test_a_judge_run_is_refused_before_anything_starts_without_a_url_or_with_a_broken_rubric():
    judged = "reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]"
    with pytest.raises(ConfigError, match="builtin:llm_judge but judge_url is not set"):
        load_config("examples/tiny_cpu.yaml", [judged])
    with pytest.raises(ConfigError, match="judge_rubric has no {prompt}"):
        load_config("examples/tiny_cpu.yaml", [judged, "judge_url=http://j:8000/v1", "judge_rubric=Rate {completion}"])
    with pytest.raises(ConfigError, match="judge_max_score=7.5 with judge_guided_score"):
        load_config(
            "examples/tiny_cpu.yaml",
            [judged, "judge_url=http://j:8000/v1", "judge_guided_score=true", "judge_max_score=7.5"],
        )
    with pytest.raises(ConfigError, match="judge_url"):
        load_config("examples/tiny_cpu.yaml", [judged, "judge_url=ftp://j/v1"])
    config = load_config("examples/tiny_cpu.yaml", [judged, "judge_url=http://j:8000/v1"])
    bound = bound_kwargs(config)["builtin:llm_judge"]
    assert set(bound) == set(JUDGE_FIELDS) and bound["judge_url"] == "http://j:8000/v1"


def test_eval_strategy_no_reads_as_trl_writes_it():
    assert load_config("examples/tiny_cpu.yaml", ["eval_strategy=no"]).data.eval_strategy == "no"


def test_preflight_asks_a_served_judge_once_and_leaves_a_judge_model_to_the_launcher(tmp_path):
    from async_grpo.inference.server import free_port
    from async_grpo.preflight import preflight

    judged = ["reward_funcs=[builtin:reverse_exact_match, builtin:llm_judge]", f"output_dir={tmp_path / 'run'}"]
    gone = load_config(
        "examples/tiny_cpu.yaml", [*judged, f"judge_url=http://127.0.0.1:{free_port()}/v1", "judge_max_retries=0"]
    )
    problems = preflight(gone, target="local").problems
    assert any(p.field == "rewards.reward_funcs" and "JudgeUnavailable" in p.message for p in problems), problems
    served = load_config("examples/tiny_cpu.yaml", [*judged, "judge_model_name_or_path=/models/judge"])
    report = preflight(served, target="local")
    assert not [p for p in report.problems if "judge" in p.field or "judge" in p.message]  # served at run time
    assert any("builtin:llm_judge is asked where the run scores" in note for note in report.skipped)
    cluster = preflight(served, target="cluster")  # the kubernetes launcher serves it too (launch/k8s_judge.py)
    assert not [p for p in cluster.problems if "judge" in p.field or "judge" in p.message]
    assert any("builtin:llm_judge is asked where the run scores" in note for note in cluster.skipped)
