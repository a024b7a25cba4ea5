"""The `Task` record: a deterministic generator of (prompt, answer) items plus the reward functions that grade them.

A task is data, not a class hierarchy: each builtin task module supplies one `sample` function and its
module-level reward functions, and this module turns that into train/held-out splits and warm-start
examples with the same disjointness and seeding rules for every task.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

# (key, prompt, answer): `key` identifies the underlying item (a word, an operand pair) so that the
# held-out split can be kept disjoint from training data.
Item = tuple[str, str, str]
Sampler = Callable[[random.Random], Item]
RewardFunc = Callable[..., list[float | None]]

EVAL_SEED = 1_000_003  # fixed: the held-out split is the same for every run
_MAX_DRAWS_PER_ITEM = 50  # give up rather than loop forever when the item space is too small


@dataclass(frozen=True)
class Task:
    """A builtin verifiable task.

    Attributes:
        name: registry name, used as `builtin:<name>` in `dataset`.
        description: one line for `--help` and docs.
        sample: draws one (key, prompt, answer) from a `random.Random`; must be deterministic given
            the generator state.
        reward_funcs: reward-function name -> module-level function with TRL's signature
            `f(prompts, completions, completion_ids, *, answer, **kwargs) -> list[float | None]`.
        train_size: rows in `train_dataset`.
        eval_size: rows in `eval_dataset`.
        chat: the dataset's prompts are conversational (one user message holding the sampled prompt text).
        tools: tool specs the task is meant to be solved with (`tools: [...]` in the config), e.g.
            ("builtin:calculator",); empty for tasks without tools.
        environment: the environment spec the task is played in (`environment: ...` in the config), e.g.
            "builtin:guess"; None for tasks without one.
        transcript: (prompt text, answer, rng) -> the reference conversation in TRL's conversational form (tool
            calls and tool results included), for tasks whose warm start is multi-turn; None: the warm start trains
            the bare answer (`sft_examples`). A demonstration that samples its choices (the guess task's noisy
            binary search) draws them from `rng`; with rng None it makes the most likely choice at every turn,
            which is what the warm start's greedy held-out check compares against (`runner.builders.warm_start`).
    """

    name: str
    description: str
    sample: Sampler
    reward_funcs: Mapping[str, RewardFunc] = field(default_factory=dict)
    train_size: int = 4000
    eval_size: int = 200
    chat: bool = False
    tools: tuple[str, ...] = ()
    environment: str | None = None
    transcript: Callable[[str, str, random.Random | None], list[dict]] | None = None

    def _draw(self, rng: random.Random, n: int, exclude: frozenset[str], unique: bool) -> list[Item]:
        items: list[Item] = []
        seen: set[str] = set()
        for _ in range(n * _MAX_DRAWS_PER_ITEM):
            if len(items) == n:
                return items
            key, prompt, answer = self.sample(rng)
            if key in exclude or (unique and key in seen):
                continue
            seen.add(key)
            items.append((key, prompt, answer))
        if len(items) == n:
            return items
        raise ValueError(
            f"task {self.name!r}: could only draw {len(items)} of {n} distinct items. "
            f"Fix: ask for fewer rows (train_size/eval_size) or widen the task's item space."
        )

    def eval_keys(self) -> frozenset[str]:
        """Keys (e.g. words) of the held-out split; training data never contains them."""
        return frozenset(k for k, _, _ in self._draw(random.Random(EVAL_SEED), self.eval_size, frozenset(), True))

    def eval_dataset(self) -> datasets.Dataset:
        """The held-out split: `eval_size` distinct items drawn with a fixed seed.

        Returns:
            datasets.Dataset with columns `prompt` (str, or one user message for a `chat` task) and `answer`
            (str); identical on every call.
        """
        items = self._draw(random.Random(EVAL_SEED), self.eval_size, frozenset(), unique=True)
        return _to_dataset(items, self.chat)

    def train_dataset(self, seed: int) -> datasets.Dataset:
        """`train_size` distinct training items for `seed`, disjoint from the held-out split.

        Returns:
            datasets.Dataset with columns `prompt` (str) and `answer` (str), in a seed-dependent order.
        """
        items = self._draw(random.Random(f"{self.name}/train/{seed}"), self.train_size, self.eval_keys(), True)
        return _to_dataset(items, self.chat)

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        """`n` (prompt, completion) pairs for a supervised warm start, never from the held-out split.

        The completion is the bare reference answer; as TRL's SFT does for prompt-completion data,
        the caller appends the tokenizer's EOS token so the model learns to stop. Items may repeat
        when `n` exceeds the item space.

        Raises:
            ValueError: n < 0.
        """
        if n < 0:
            raise ValueError(f"sft_examples: n={n} must be >= 0. Fix: pass the number of examples wanted.")
        items = self._draw(random.Random(f"{self.name}/sft/{seed}"), n, self.eval_keys(), unique=False)
        return [(prompt, answer) for _, prompt, answer in items]

    def sft_transcripts(self, seed: int, n: int) -> list[list[dict]]:
        """`n` reference conversations (`transcript`) for a multi-turn warm start, never from the held-out split;
        a demonstration's random choices come from one generator seeded with the task's name and `seed`, so the
        same seed gives the same conversations.

        Raises:
            ValueError: the task has no `transcript`, or n < 0.
        """
        if self.transcript is None:
            raise ValueError(f"task {self.name!r} has no multi-turn transcripts. Fix: use sft_examples.")
        rng = random.Random(f"{self.name}/transcript/{seed}")
        return [self.transcript(prompt, answer, rng) for prompt, answer in self.sft_examples(seed, n)]


def _to_dataset(items: list[Item], chat: bool = False) -> Any:
    import datasets

    prompts = [[{"role": "user", "content": p}] if chat else p for _, p, _ in items]
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": [a for _, _, a in items]})


def completion_text(completion: Any) -> str:
    """The text of one completion, standard (str) or conversational (list of messages -> last content).

    Raises:
        TypeError: neither form; the message says what was received.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise TypeError(
        f"completion must be a string or a list of message dicts, got {type(completion).__name__}. "
        "Fix: pass completions as TRL does."
    )


def answers_from_kwargs(func_name: str, kwargs: Mapping[str, Any], n: int) -> list[str]:
    """The `answer` column from a reward call's keyword arguments, checked to hold `n` entries.

    Raises:
        ValueError: `answer` is missing or has the wrong length; names the function and the fix.
    """
    if "answer" not in kwargs:
        raise ValueError(
            f"{func_name}: needs an 'answer' column, got columns {sorted(kwargs)}. "
            "Fix: use a dataset with an 'answer' column (the builtin tasks have one)."
        )
    answers = list(kwargs["answer"])
    if len(answers) != n:
        raise ValueError(
            f"{func_name}: got {n} completions but {len(answers)} answers. Fix: pass one answer per completion."
        )
    return [str(a) for a in answers]


def shaped_match(text: str, answer: str, alphabet: str) -> float:
    """A dense partial-credit score in [0, 1] for `text` against `answer`; 1.0 iff text == answer.

    score = 0.2 * alphabet + 0.3 * length + 0.5 * positions, where
      alphabet  = fraction of characters of `text` that are in `alphabet` (0 for empty text),
      length    = 1 - |len(text) - len(answer)| / max(len(text), len(answer)),
      positions = fraction of the answer's positions i with text[i] == answer[i].
    Each term gives a weak model a gradient: first emit the right kind of characters, then the right
    number of them, then the right ones in the right places.
    """
    if not text:
        return 0.0
    in_alphabet = sum(ch in alphabet for ch in text) / len(text)
    length = 1.0 - abs(len(text) - len(answer)) / max(len(text), len(answer))
    positions = sum(a == b for a, b in zip(text, answer, strict=False)) / len(answer) if answer else 0.0
    return 0.2 * in_alphabet + 0.3 * length + 0.5 * positions
