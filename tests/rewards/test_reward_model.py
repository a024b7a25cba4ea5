"""Reward models as reward functions (TRL semantics): the reward is logits[:, 0] of the rendered text, the chat
template renders conversational groups, batching changes nothing, the reward workers score them beside functions,
preflight refuses broken folders, and Bradley-Terry pair training teaches a tiny model a preference."""

import math
import random
import shutil
import string
from pathlib import Path

import pytest
import torch

from async_grpo.config import GRPOConfig
from async_grpo.preflight.reward_models import check_reward_models
from async_grpo.rewards.contract import bound_kwargs
from async_grpo.rewards.loading import RewardSpecError, absolute_reward_spec, resolve_reward_func, reward_func_name
from async_grpo.rewards.pairwise import train_reward_model_on_pairs
from async_grpo.rewards.pool import RewardPool, _score_group
from async_grpo.rewards.reward_model import RewardModelScorer, is_reward_model_spec, load_reward_model
from async_grpo.tiny_model import build_tiny_reward_model
from async_grpo.transports.scorer import RewardError

BAD = Path(__file__).resolve().parents[1] / "bad_inputs" / "data"
PROMPTS = ["Reverse: abc\n", "Reverse: hello world\n", "x"]
COMPLETIONS = ["cba", "dlrow olleh and some more text", ""]
CHAT_PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Reverse: abc"}]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; on a loaded shared machine extra threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny_rm", seed=1)


def hand_score(folder: Path, text: str) -> float:
    """The first logit of one unpadded text, straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


def test_specs_name_models_and_keep_functions_apart(rm_dir, monkeypatch):
    monkeypatch.chdir(rm_dir.parent)
    for spec in (f"model:{rm_dir}", str(rm_dir), "tiny_rm", "model:org/some-rm"):
        assert is_reward_model_spec(spec), spec
    assert not is_reward_model_spec("builtin:reverse_format") and not is_reward_model_spec("nofolder")
    assert reward_func_name("tiny_rm") == reward_func_name(f"model:{rm_dir}/") == "reward_model/tiny_rm"
    assert reward_func_name("model:org/some-rm") == "reward_model/some-rm"
    assert absolute_reward_spec("tiny_rm") == f"model:{rm_dir}"
    assert isinstance(resolve_reward_func("tiny_rm"), RewardModelScorer)  # nothing loaded yet
    with pytest.raises(RewardSpecError, match="no folder with a config.json"):
        resolve_reward_func("model:/nonexistent/rm")
    with pytest.raises(RewardSpecError, match="is not one of"):
        resolve_reward_func("nofolder")


def test_the_reward_is_the_first_logit_of_prompt_plus_completion(rm_dir):
    scores = RewardModelScorer(str(rm_dir))(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=None, answer=[1] * 3
    )
    expected = [hand_score(rm_dir, p + c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_conversational_groups_go_through_the_chat_template(rm_dir):
    from transformers import AutoTokenizer

    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS[:2]]
    scores = RewardModelScorer(str(rm_dir))(prompts=[CHAT_PROMPT] * 2, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    texts = [tokenizer.apply_chat_template(CHAT_PROMPT + c, tokenize=False) for c in completions]
    assert texts[0].startswith("<|im_start|>system\nbe brief<|im_end|>\n") and texts[0].endswith("cba<|im_end|>\n")
    assert scores == pytest.approx([hand_score(rm_dir, t) for t in texts], abs=1e-5)


def test_batching_gives_the_same_numbers_as_one_by_one(rm_dir):
    scorer = RewardModelScorer(str(rm_dir))
    prompts, completions = PROMPTS * 3, [c * (i + 1) for i, c in enumerate(COMPLETIONS * 3)]
    batched = scorer(prompts=prompts, completions=completions, reward_model_batch_size=4)
    single = scorer(prompts=prompts, completions=completions, reward_model_batch_size=1)
    assert batched == pytest.approx(single, abs=1e-5)


def test_inputs_are_truncated_to_the_model_length(rm_dir):
    score = RewardModelScorer(str(rm_dir))(prompts=["p"], completions=["z" * 2000])[0]  # 512 positions
    assert math.isfinite(score)


def test_the_config_binds_batch_size_device_and_chat_kwargs(rm_dir):
    config = GRPOConfig(
        reward_funcs=["builtin:reverse_format", f"model:{rm_dir}"],
        reward_model_batch_size=4,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert bound_kwargs(config) == {
        f"model:{rm_dir}": {
            "reward_model_batch_size": 4,
            "reward_model_device": "cpu",
            "chat_template_kwargs": {"enable_thinking": False},
        }
    }


def test_the_reward_workers_score_the_model_beside_a_function(rm_dir):
    specs = ["builtin:reverse_format", f"model:{rm_dir}"]
    with RewardPool(specs, weights=[1.0, 0.5], num_workers=1, timeout_s=60) as pool:
        assert pool.names == ["reverse_format", "reward_model/tiny_rm"] and pool.weights == [1.0, 0.5]
        rows = pool.submit(PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["cba"] * 3}).result(timeout=90).rows
    expected = RewardModelScorer(str(rm_dir))(prompts=PROMPTS, completions=COMPLETIONS)
    assert [r[1] for r in rows] == pytest.approx(expected, abs=1e-5)
    assert all(len(r) == 2 and math.isfinite(r[0]) for r in rows)


def test_a_model_whose_forward_fails_fails_the_group_as_a_reward_error(rm_dir, tmp_path):
    broken = Path(shutil.copytree(rm_dir, tmp_path / "broken_rm"))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RewardError, match="reward_model/broken_rm") as err:
        _score_group((f"model:{broken}",), ["p"], ["c"], [[1]], {})
    assert err.value.reason == "reward_error" and err.value.function == "reward_model/broken_rm"


def test_preflight_refuses_broken_reward_models_naming_the_entry_and_the_fix(rm_dir, tmp_path):
    no_template = Path(shutil.copytree(rm_dir, tmp_path / "no_template"))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    config_file = no_template / "tokenizer_config.json"
    config_file.write_text(config_file.read_text().replace('"chat_template"', '"unused_template"'))
    specs = {
        "model:/nonexistent/rm": "does not exist",
        f"model:{BAD / 'reward_model_two_labels'}": "train/save it with num_labels=1, as TRL's RewardTrainer does",
        f"model:{BAD / 'reward_model_causal_lm'}": "no *ForSequenceClassification head",
        f"model:{BAD / 'reward_model_no_pad'}": "neither a pad token nor an eos token",
        f"model:{no_template}": "has no chat template",
    }
    problems, _ = check_reward_models(GRPOConfig(reward_funcs=list(specs)), local=True, conversational=True)
    assert [p.field for p in problems] == ["rewards.reward_funcs"] * len(specs)
    for problem, (spec, text) in zip(problems, specs.items(), strict=True):
        assert spec in str(problem) and text in str(problem) and "Fix:" in str(problem)
    good, _ = check_reward_models(GRPOConfig(reward_funcs=[str(rm_dir)]), local=True, conversational=True)
    assert good == []
    _, notes = check_reward_models(GRPOConfig(reward_funcs=["model:/not/here"]), local=False, conversational=None)
    assert notes and "checked where it runs" in notes[0]


def test_a_reward_model_neither_here_nor_cached_is_refused_when_the_hub_is_offline(monkeypatch, tmp_path):
    """examples/reward_model_cpu.yaml before its reward model is built: `model:runs/reverse-reward-model` reads as a
    hub id; offline and uncached, its load at launch can only fail, so preflight refuses it (it failed 55 s into a
    run, at the first held-out evaluation); with the hub reachable it is left for launch."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    config = GRPOConfig(reward_funcs=["model:runs/reverse-reward-model", "builtin:reverse_exact_match"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (problem,), _ = check_reward_models(config, local=True, conversational=False)
    assert problem.field == "rewards.reward_funcs" and "no folder 'runs/reverse-reward-model' here" in str(problem)
    assert "HF_HUB_OFFLINE" in str(problem) and "Fix: build or download the reward model first" in str(problem)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    problems, notes = check_reward_models(config, local=True, conversational=False)
    assert problems == [] and "read at launch" in notes[0]


def pairs(n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """Prompts asking for an exclamation: the chosen completion ends with '!', the rejected one with '.'."""
    out = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        out.append((f"Shout {word}\n", word + "!", word + "."))
    return out


def test_pairwise_training_teaches_the_preference_on_held_out_pairs(tmp_path):
    folder = build_tiny_reward_model(tmp_path / "rm", seed=0)
    rng = random.Random(0)
    train, held_out = pairs(64, rng), pairs(32, rng)
    losses = train_reward_model_on_pairs(folder, train, steps=12, lr=5e-3, batch_size=16)
    assert losses[-1] < 0.05 < 0.5 < losses[0]
    load_reward_model.cache_clear()
    scorer = RewardModelScorer(str(folder))
    prompts = [p for p, _, _ in held_out]
    chosen = scorer(prompts=prompts, completions=[c for _, c, _ in held_out])
    rejected = scorer(prompts=prompts, completions=[r for _, _, r in held_out])
    assert sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(held_out) >= 0.95
