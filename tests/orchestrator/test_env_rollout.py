"""The environment rollout against a scripted generation client (no vLLM here; tests/integration/
test_environments.py runs it on a real server): token in, token out across turns (the held ids are exactly the
sampled ones plus the observations' template tokens, also with a tokenizer that would re-tokenize the conversation
differently), the stop rules, failures that end a sample and are counted, the env/* metrics and env_reward."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from async_grpo import tiny_model
from async_grpo.data import PromptItem, encode_prompt
from async_grpo.environments import EnvironmentCaller
from async_grpo.environments.builtin import GuessEnvironment
from async_grpo.inference.client import Completion
from async_grpo.orchestrator.batching import env_metrics
from async_grpo.orchestrator.env_rollout import EnvironmentRollout
from async_grpo.orchestrator.rollout import RolloutDropped, SamplingSettings
from async_grpo.tasks import get_reward_func
from async_grpo.tasks.guess import guess_prompt
from async_grpo.tiny_model import build_tiny_tokenizer
from async_grpo.tools.render import render_ids
from async_grpo.transports.scorer import ScoredGroup
from tests.environments import envs

IM_END = 258
HI = 259  # the merging tokenizer's one token for "hi"


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def merging_tok():
    """The tiny byte-level tokenizer plus one merge, h + i -> "hi" (id 259): a model that samples "h", "i" as two
    tokens wrote ids the tokenizer would never produce from the text, the case re-tokenizing gets wrong."""
    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    vocab.update({t: 256 + i for i, t in enumerate(tiny_model.SPECIAL_TOKENS)})
    vocab["hi"] = HI
    return Qwen2Tokenizer(
        vocab=vocab, merges=[("h", "i")], eos_token=tiny_model.EOS_TOKEN, pad_token=tiny_model.EOS_TOKEN,
        unk_token=None, additional_special_tokens=[tiny_model.IM_START_TOKEN, tiny_model.IM_END_TOKEN],
        clean_up_tokenization_spaces=False, chat_template=tiny_model.CHAT_TEMPLATE,
    )  # fmt: skip


class EnvRewardScorer:
    """Scores with builtin:env_reward in-process (a `Scorer`); keeps the columns it was given."""

    names, weights = ["env_reward"], [1.0]

    def __init__(self):
        self.columns = None

    def submit(self, prompts, completions, completion_ids, columns=None) -> Future:
        self.columns = columns
        out: Future = Future()
        out.set_result(
            ScoredGroup([[r] for r in get_reward_func("env_reward")(prompts, completions, completion_ids, **columns)])
        )
        return out

    def close(self) -> None:
        pass


class IdsClient:
    """A `GenerationClient` whose replies are token ids from `reply(prompt_ids, call_index, sample_index)`; each
    gets <|im_end|> appended, is cut at max_tokens ("length"), and carries logprob -(k+1)/100 at its k-th token."""

    def __init__(self, reply):
        self.reply, self.requests = reply, []

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, top_k=-1, seed=None):
        self.requests.append((list(prompt_ids), n, max_tokens))
        out = []
        for i in range(n):
            ids, finish = list(self.reply(list(prompt_ids), len(self.requests) - 1, i)) + [IM_END], "stop"
            if len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "length"
            out.append(Completion(ids, [-(k + 1) / 100 for k in range(len(ids))], "", finish))
        return out


def binary_search(tok):
    """An agent that plays the guessing game by binary search, reading the environment's last reply."""

    def reply(prompt_ids, call, sample):
        text = tok.decode(prompt_ids)
        low, high = 1, 16
        turns = text.split("<|im_start|>assistant\n")[1:]
        for turn in turns[:-1]:
            guess = int(turn.split("<|im_end|>")[0])
            answer = turn.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            low, high = (guess + 1, high) if answer == "higher" else (low, guess - 1)
        return tok.encode(str((low + high) // 2))

    return reply


def guess_item(tok, secret: int) -> PromptItem:
    prompt = [{"role": "user", "content": guess_prompt()}]
    return PromptItem(prompt, encode_prompt(tok, prompt), {"answer": str(secret)})


def rollout(tok, env, max_turns=5, timeout_s=5.0, scorer=None):
    return EnvironmentRollout(scorer or EnvRewardScorer(), tok, EnvironmentCaller(env, timeout_s=timeout_s),
                              max_turns=max_turns)  # fmt: skip


def run(ro, client, item, g=2, max_len=200, versions=None, seed=None):
    counter = iter(versions or range(100))
    return asyncio.run(ro(client, item, SamplingSettings(g, max_len, 1.0), version=lambda: next(counter), seed=seed))


def test_a_guessing_episode_token_in_token_out(tok):
    scorer = EnvRewardScorer()
    ro = rollout(tok, GuessEnvironment(), scorer=scorer)
    client = IdsClient(binary_search(tok))
    group = run(ro, client, guess_item(tok, 11), versions=[5, 6, 7, 8, 9, 10, 11, 12])
    # 8 (higher), 12 (lower), 10 (higher), 11: four turns
    conv = group.prompt + group.completions[0]
    assert [m["content"] for m in group.completions[0]] == ["8", "higher", "12", "lower", "10", "higher", "11"]
    assert [m["role"] for m in group.completions[0]] == ["assistant", "user"] * 3 + ["assistant"]
    turn = lambda s: tok.encode(s) + [IM_END]  # noqa: E731
    obs = lambda s: tok.encode(f"\n<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n")  # noqa: E731
    expected = turn("8") + obs("higher") + turn("12") + obs("lower") + turn("10") + obs("higher") + turn("11")
    assert group.completion_ids[0] == expected
    rendered = render_ids(tok, conv, None, add_generation_prompt=False)
    assert group.prompt_ids + group.completion_ids[0] == rendered[:-1]  # the template's trailing "\n" not sampled
    mask = group.loss_mask[0]
    assert [i for i, m in zip(expected, mask, strict=True) if m] == turn("8") + turn("12") + turn("10") + turn("11")
    assert sum(1 for m in mask if m == 0) == len(obs("higher")) * 2 + len(obs("lower"))
    lps = [lp for lp, m in zip(group.sampling_logprobs[0], mask, strict=True) if not m]
    assert lps == [0.0] * len(lps)
    # versions: sample 0's turns were sent at 5 (the group's request), then read at each later request
    assert group.policy_version == 5 and group.token_versions[0][0] == 5 and group.token_versions[0][-1] > 5
    assert client.requests[1][0] == group.prompt_ids + turn("8") + obs("higher")  # generated from the held ids
    assert group.rollout_stats["env/turns"] == [4.0, 4.0]
    assert group.rollout_stats["env/template_drift"] == [0.0, 0.0] and group.rollout_stats["env/done"] == [1.0, 1.0]
    assert group.rewards_per_func == [[pytest.approx(0.9**3)]] * 2
    assert scorer.columns["env_reward"] == [pytest.approx(0.729)] * 2
    assert scorer.columns["env_state"][0]["secret"] == 11 and "messages" not in scorer.columns["env_state"][0]
    assert scorer.columns["answer"] == ["11", "11"]
    metrics = env_metrics([group])
    assert metrics["env/turns"] == 4.0 and metrics["env/done_frac"] == 1.0 and metrics["env/template_drift"] == 0.0
    assert metrics["env/failures/step_exception"] == 0.0


def test_the_held_ids_are_the_sampled_ones_when_the_tokenizer_would_merge_them(merging_tok):
    tok = merging_tok
    ro = rollout(tok, envs.EchoEnv())
    client = IdsClient(lambda prompt_ids, call, sample: [104, 105])  # "h", "i": never what encode("hi") gives
    prompt = [{"role": "user", "content": "say hi"}]
    group = run(ro, client, PromptItem(prompt, encode_prompt(tok, prompt), {}), g=1)
    ids = group.completion_ids[0]
    obs = tok.apply_chat_template(
        [*prompt, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "echo: hi"}],
        tokenize=True, add_generation_prompt=True, return_dict=False,
    )  # fmt: skip
    obs_ids = obs[len(render_ids(tok, [*prompt, {"role": "assistant", "content": "hi"}], None,
                                 add_generation_prompt=False)) - 1:]  # fmt: skip
    sampled = [104, 105, IM_END]
    assert ids == sampled + obs_ids + sampled + obs_ids + sampled  # three turns, exactly as sampled
    assert HI in obs_ids and HI not in [i for i, m in zip(ids, group.loss_mask[0], strict=True) if m]
    # a re-tokenization of the same conversation differs: that is the mismatch counted, and not trained on
    rendered = render_ids(tok, group.prompt + group.completions[0], None, add_generation_prompt=False)[:-1]
    assert rendered != group.prompt_ids + ids
    assert group.rollout_stats["env/template_drift"] == [2.0]  # counted before each of the two observations
    assert group.rollout_stats["env/turns"] == [3.0] and group.rewards_per_func == [[1.5]]  # 0.25 + 0.25 + 1.0


@pytest.mark.parametrize(
    "env, kind, turns",
    [
        (envs.RaisingStepEnv(), "step_exception", 1),
        (envs.HangingStepEnv(), "step_timeout", 1),
        (envs.HangingSyncEnv(), "step_timeout", 1),
        (envs.BadObservationEnv(), "bad_observation", 1),
        (envs.RaisingResetEnv(), "reset_exception", 1),
    ],
)
def test_a_failing_environment_ends_the_sample_counted_and_the_group_is_still_scored(tok, env, kind, turns):
    ro = rollout(tok, env, timeout_s=0.3)
    group = run(ro, IdsClient(lambda p, c, s: tok.encode("5")), guess_item(tok, 3), g=2)
    assert group.rollout_stats[f"env/failures/{kind}"] == [1.0, 1.0]
    assert group.rollout_stats["env/turns"] == [float(turns)] * 2 and group.rewards_per_func == [[0.0], [0.0]]
    assert env_metrics([group])["env/failures"] == 1.0
    ro.close()


def test_stops_at_max_turns_and_at_the_length_budget(tok):
    reply = lambda p, c, s: tok.encode("1")  # noqa: E731
    group = run(rollout(tok, envs.SyncEnv(), max_turns=2), IdsClient(reply), guess_item(tok, 3), g=1)
    assert group.rollout_stats["env/turns"] == [2.0] and group.rollout_stats["env/max_turns_reached"] == [1.0]
    assert group.truncated == [False]
    group = run(rollout(tok, envs.SyncEnv(), max_turns=50), IdsClient(reply), guess_item(tok, 3), g=1, max_len=40)
    assert group.truncated == [True] and len(group.completion_ids[0]) <= 40
    assert group.rollout_stats["env/max_turns_reached"] == [0.0]


def test_an_aborted_turn_drops_the_group_and_string_prompts_are_refused(tok):
    class Aborting(IdsClient):
        async def generate(self, prompt_ids, **kw):
            out = await super().generate(prompt_ids, **kw)
            return [Completion(c.token_ids, c.logprobs, "", "abort") for c in out]

    with pytest.raises(RolloutDropped) as err:
        run(rollout(tok, GuessEnvironment()), Aborting(lambda p, c, s: [49]), guess_item(tok, 3))
    assert err.value.reason == "aborted"
    with pytest.raises(ValueError, match="conversational"):
        run(rollout(tok, GuessEnvironment()), IdsClient(lambda p, c, s: [49]), PromptItem("x", [1], {}))


def test_spans_record_each_turn_and_step_in_order_and_a_failed_step_carries_its_kind(tok):
    def traced(env) -> EnvironmentRollout:
        caller = EnvironmentCaller(env, timeout_s=5.0)
        return EnvironmentRollout(EnvRewardScorer(), tok, caller, max_turns=5, record_spans=True)

    five = lambda p, c, s: tok.encode("5")  # noqa: E731
    group = run(traced(envs.EchoEnv()), IdsClient(five), guess_item(tok, 3), g=1, versions=[4, 5, 6])
    (spans,) = group.spans
    assert [(s.name, s.kind) for s in spans] == [
        ("turn 1", "LLM"), ("env step 1", "TASK"), ("turn 2", "LLM"), ("env step 2", "TASK"),
        ("turn 3", "LLM"), ("env step 3", "TASK"), ("reward env_reward", "EVALUATOR"),
    ]  # fmt: skip
    turn_len = len(tok.encode("5")) + 1
    obs_len = len(tok.encode("\n<|im_start|>user\necho: 5<|im_end|>\n<|im_start|>assistant\n"))
    assert [s.attributes for s in spans[0:6:2]] == [
        {"prompt_tokens": len(group.prompt_ids) + k * (turn_len + obs_len), "completion_tokens": turn_len,
         "policy_version": v, "finish_reason": "stop"}
        for k, v in enumerate([4, 5, 6])
    ]  # fmt: skip
    assert all(s.outputs == {"text": "5"} for s in spans[0:6:2])
    assert [s.inputs for s in spans[1:6:2]] == [{"action": "5"}] * 3
    assert [s.outputs for s in spans[1:6:2]] == [
        {"observation": "echo: 5", "reward": 0.25, "done": False},
        {"observation": "echo: 5", "reward": 0.25, "done": False},
        {"observation": "", "reward": 1.0, "done": True},
    ]
    assert all(s.attributes == {} for s in spans[1:6:2])
    assert spans[6].outputs == {"value": 1.5}
    assert all(0 < a.start_ns <= a.end_ns <= b.start_ns for a, b in zip(spans, spans[1:]))  # one after another
    # a failed step ends the episode: its span carries the failure kind; a failed reset leaves an unstepped turn
    group = run(traced(envs.RaisingStepEnv()), IdsClient(five), guess_item(tok, 3), g=2)
    for spans in group.spans:
        assert [s.name for s in spans] == ["turn 1", "env step 1", "reward env_reward"]
        assert spans[1].attributes == {"error": "step_exception"}
        assert spans[1].outputs["observation"] is None and "boom" in spans[1].outputs["error"]
    group = run(traced(envs.RaisingResetEnv()), IdsClient(five), guess_item(tok, 3), g=2)
    assert [[s.name for s in spans] for spans in group.spans] == [["turn 1", "reward env_reward"]] * 2
    # off (the default): nothing recorded
    assert run(rollout(tok, envs.EchoEnv()), IdsClient(five), guess_item(tok, 3), g=2).spans == []


def test_the_seconds_an_episode_spends_in_the_environment_are_counted(tok):
    """`env/seconds` (issue 53's generation-side split): the time in `step` calls, per completion."""
    import time

    class SlowGuess(GuessEnvironment):
        def step(self, action, state):
            time.sleep(0.05)
            return super().step(action, state)

    group = run(rollout(tok, SlowGuess()), IdsClient(binary_search(tok)), guess_item(tok, 11))
    steps = group.rollout_stats["env/turns"][0]  # four turns, each stepped: the last one gives the reward
    assert all(seconds >= 0.05 * steps for seconds in group.rollout_stats["env/seconds"])
    assert env_metrics([group])["env/seconds"] >= 0.05 * steps
