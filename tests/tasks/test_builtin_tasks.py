"""Builtin tasks: deterministic, disjoint splits; reward functions graded by hand; registry errors."""

import pickle

import pytest

from async_grpo.tasks import TASKS, builtin_reward_funcs, get_reward_func, get_task
from async_grpo.tasks.add import add_exact_match, add_format
from async_grpo.tasks.calc import calc_call_match, calc_exact_match, calc_format
from async_grpo.tasks.reverse import reverse_exact_match, reverse_format


def call(fn, completions, answers):
    return fn(
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=[[0]] * len(completions),
        answer=answers,
    )


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_deterministic_disjoint_and_well_formed(name):
    task = get_task(name)
    train, ev = task.train_dataset(0), task.eval_dataset()
    assert train.column_names == ["prompt", "answer"] == ev.column_names
    assert len(train) == task.train_size and len(ev) == task.eval_size
    text = (lambda p: p[0]["content"]) if task.chat else (lambda p: p)
    train_prompts, eval_prompts = [text(p) for p in train["prompt"]], {text(p) for p in ev["prompt"]}
    if task.environment is not None:  # one prompt, the secret in the environment: rows differ by answer only
        assert train["prompt"][:20] == ev["prompt"][:20] and len(set(train["answer"])) > 1
        assert train["answer"][:20] != task.train_dataset(1)["answer"][:20]
        return
    assert len(set(train_prompts)) == len(train)  # no duplicate items
    assert not set(train_prompts) & eval_prompts
    assert train[:5] == task.train_dataset(0)[:5] and ev[:] == task.eval_dataset()[:]
    assert train["prompt"][:20] != task.train_dataset(1)["prompt"][:20]
    sft = task.sft_examples(seed=0, n=50)
    assert len(sft) == 50 and not {p for p, _ in sft} & eval_prompts
    if task.chat:  # one user message; the reference conversation (tool calls included) scores full marks
        assert all(p == [{"role": "user", "content": text(p)}] for p in train["prompt"][:50])
        for conv, (_, answer) in zip(task.sft_transcripts(0, 20), task.sft_examples(0, 20), strict=True):
            for fn in task.reward_funcs.values():
                assert fn(prompts=[conv[:1]], completions=[conv[1:]], completion_ids=[[0]], answer=[answer]) == [1.0]
    else:
        for _prompt, completion in sft:  # the reference answer scores full marks on every reward
            for fn in task.reward_funcs.values():
                assert call(fn, [completion], [completion]) == [1.0]
        assert all(isinstance(p, str) and p.endswith("\n") for p in train["prompt"][:50])


def test_reverse_items():
    for row in get_task("reverse").train_dataset(3).select(range(200)):
        word = row["prompt"].removeprefix("reverse: ").removesuffix("\n")
        assert row["prompt"] == f"reverse: {word}\n"
        assert 3 <= len(word) <= 6 and word.isalpha() and word.islower()
        assert row["answer"] == word[::-1] != word


def test_add_items():
    for row in get_task("add").eval_dataset():
        a, b = row["prompt"].removeprefix("add: ").removesuffix("\n").split("+")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and row["answer"] == str(int(a) + int(b))


def test_exact_match():
    assert call(reverse_exact_match, ["dcba", " dcba\n", "dcb", "DCBA", ""], ["dcba"] * 5) == [1, 1, 0, 0, 0]
    assert call(add_exact_match, ["46", "46 ", "47"], ["46"] * 3) == [1, 1, 0]
    conversational = [[{"role": "assistant", "content": "dcba"}]]
    assert call(reverse_exact_match, conversational, ["dcba"]) == [1.0]


def test_reverse_format_partial_credit():
    scores = call(reverse_format, ["dcba", "dcbx", "zzzz", "dc", "dcba!!!!", "1234", ""], ["dcba"] * 7)
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(0.2 + 0.3 + 0.5 * 3 / 4)  # right length and letters, 3 positions
    assert scores[2] == pytest.approx(0.2 + 0.3)  # letters of the right length, no position right
    assert scores[3] == pytest.approx(0.2 + 0.3 * 0.5 + 0.5 * 2 / 4)
    assert scores[4] == pytest.approx(0.2 * 0.5 + 0.3 * 0.5 + 0.5)
    assert scores[5] == pytest.approx(0.3)  # digits: only the length term
    assert scores[6] == 0.0
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores[0] > scores[1] > scores[2] > scores[5] > scores[6]


def test_add_format_partial_credit():
    assert call(add_format, ["46", "45", "abc"], ["46"] * 3) == pytest.approx([1.0, 0.2 + 0.3 + 0.25, 0.3 * 2 / 3])


def test_rewards_need_the_answer_column():
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        reverse_exact_match(prompts=["p"], completions=["x"], completion_ids=[[1]])
    with pytest.raises(ValueError, match="2 answers"):
        reverse_format(prompts=["p"], completions=["x"], completion_ids=[[1]], answer=["a", "b"])


def test_registry():
    assert set(builtin_reward_funcs()) == {
        "reverse_exact_match",
        "reverse_format",
        "add_exact_match",
        "add_format",
        "calc_exact_match",
        "calc_format",
        "calc_call_match",
        "env_reward",
        "math_accuracy",
        "think_answer_format",
        "soft_overlong_penalty",
    }
    assert get_reward_func("reverse_format") is reverse_format
    assert pickle.loads(pickle.dumps(reverse_format)) is reverse_format  # module-level, importable by name
    with pytest.raises(KeyError, match="unknown builtin task 'nope'.*reverse"):
        get_task("nope")
    with pytest.raises(KeyError, match="unknown builtin reward function"):
        get_reward_func("nope")


def test_calc_items_need_the_calculator():
    task = get_task("calc")
    assert task.tools == ("builtin:calculator",)
    for row in task.eval_dataset():
        a, b = row["prompt"][0]["content"].split("*")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and row["answer"] == str(int(a) * int(b))
    conv = task.sft_transcripts(0, 1)[0]
    assert conv[1]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": conv[0]["content"]},
    }
    assert conv[2] == {"role": "tool", "name": "calculator", "content": conv[3]["content"]}
    with pytest.raises(ValueError, match="no multi-turn transcripts"):
        get_task("add").sft_transcripts(0, 1)


def test_calc_rewards_read_the_final_message():
    conv = [
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": " 408"},
    ]
    assert call(calc_exact_match, [conv, conv[:2], "408", "409"], ["408"] * 4) == [1.0, 1.0, 1.0, 0.0]
    assert call(calc_exact_match, [conv[:1]], ["408"]) == [0.0]  # stopped at the call: no answer
    assert call(calc_format, ["400"], ["408"]) == pytest.approx([0.2 + 0.3 + 0.5 * 2 / 3])

    def call_of(expr):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]

    prompt = [{"role": "user", "content": "123*456"}]
    scores = calc_call_match([prompt] * 4, [call_of("123*456"), call_of("923*456"), conv[2:], call_of(7)], None)
    assert scores == pytest.approx([1.0, 0.5 * (0.2 + 0.3 + 0.5 * 6 / 7), 0.0, 0.0])


def test_sft_examples_rejects_negative_n():
    with pytest.raises(ValueError, match="n=-1"):
        get_task("reverse").sft_examples(0, -1)
