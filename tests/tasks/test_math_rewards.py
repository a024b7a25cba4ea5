"""Builtin rewards for real tasks, on hand-computed cases: math-verify accuracy (boxed, plain, <answer> tags,
conversational), the think/answer format, DAPO's soft overlong penalty; GSM8K and MATH rows as prompt + answer."""

from __future__ import annotations

import datasets
import pytest

from async_grpo.data import load_prompt_dataset, with_system_prompt
from async_grpo.tasks.math_reasoning import (
    gsm8k_final_answer,
    last_boxed,
    math_accuracy,
    soft_overlong_penalty,
    think_answer_format,
    to_prompt_rows,
)

pytest.importorskip("math_verify")


def test_math_accuracy_on_boxed_plain_tagged_and_conversational_answers():
    completions = [
        "So she has 72 apples.",
        r"Therefore \boxed{72}.",
        "<think>48+24</think><answer>72</answer>",
        "<answer>71</answer> though 72 is close",
        [{"role": "assistant", "content": r"$\frac{144}{2}$"}],
        r"\boxed{73}",
        "",
    ]
    assert math_accuracy([None] * 7, completions, answer=["72"] * 7) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # MATH: the gold is a worked solution whose last \boxed{} is the answer; equivalent forms count
    got = math_accuracy(
        [None] * 3,
        [r"\boxed{\frac{2}{4}}", r"\boxed{0.5}", r"\boxed{\frac13}"],
        solution=[r"Halve it: \boxed{\frac{1}{2}}"] * 3,
    )
    assert got == [1.0, 1.0, 0.0]


def test_math_accuracy_abstains_when_the_gold_does_not_parse_and_needs_a_gold_column():
    assert math_accuracy([None], ["72"], answer=[""]) == [None]
    with pytest.raises(ValueError, match="needs an `answer`"):
        math_accuracy([None], ["72"])


def test_think_answer_format():
    completions = [
        "<think>a</think><answer>b</answer>",
        "  <think>a\nb</think>\n<answer>c</answer>\n",
        "<think>a<think>b</think><answer>c</answer>",
        "<answer>c</answer>",
        "<think>a</think> c",
        [{"role": "assistant", "content": "<think>x</think><answer>y</answer>"}],
    ]
    assert think_answer_format([None] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_soft_overlong_penalty_is_dapo_eq_13_times_the_factor():
    ids = [[0] * n for n in (10, 12, 13, 16, 17)]  # L = 16, buffer 4: free up to 12 tokens
    got = soft_overlong_penalty(
        [None] * 5, [""] * 5, ids, max_completion_length=16, overlong_buffer_len=4, overlong_penalty_factor=2.0
    )
    assert got == [0.0, 0.0, -0.5, -2.0, -2.0]  # 13: -(1/4) x 2; 16: -(4/4) x 2; beyond L: -2


def test_gsm8k_and_math_rows_become_prompt_answer_and_solution():
    gsm = datasets.Dataset.from_list(
        [{"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}, {"question": "Big?", "answer": "so #### 1,234"}]
    )
    rows = to_prompt_rows(gsm)
    assert rows["prompt"] == ["2+2?", "Big?"] and rows["answer"] == ["4", "1234"] and rows["solution"] == ["4", "1234"]
    math_ds = datasets.Dataset.from_list([{"problem": "Half?", "solution": r"It is \boxed{\frac{1}{2}}."}])
    rows = to_prompt_rows(math_ds)
    assert rows[0]["answer"] == r"\frac{1}{2}" and rows[0]["solution"] == r"It is \boxed{\frac{1}{2}}."
    assert last_boxed(r"\boxed{a} then \boxed{\frac{x^{2}}{3}}") == r"\frac{x^{2}}{3}" and last_boxed("none") is None
    assert gsm8k_final_answer("x #### -3") == "-3"
    with pytest.raises(ValueError, match="neither question/answer"):
        to_prompt_rows(datasets.Dataset.from_list([{"text": "t"}]))


def test_a_gsm8k_file_loads_as_conversational_prompts_with_the_system_prompt(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    datasets.Dataset.from_list([{"question": "2+2?", "answer": "#### 4"}]).to_json(path)
    ds = load_prompt_dataset(str(path), split="train", system_prompt="Be brief.")
    assert ds[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert ds[0]["answer"] == "4"
    assert with_system_prompt([{"role": "system", "content": "own"}], "x") == [{"role": "system", "content": "own"}]
