"""The producer's progress: the prompt ledger saves the position of the prompts trained, not drawn, and the
orchestrator owns it (every draw goes through it; `mark_trained` reaches it and the schedule)."""

from __future__ import annotations

from types import SimpleNamespace

from async_grpo.data import PromptItem, PromptSampler
from async_grpo.orchestrator.progress import PromptLedger, draw_window


def trained_group(prompt_ids: list[int], replayed: bool = False, rerolled: bool = False) -> SimpleNamespace:
    """What `mark_trained` reads of a trained `RolloutGroup`."""
    return SimpleNamespace(prompt_ids=prompt_ids, replayed=replayed, rerolled=rerolled)


def items(n: int) -> list[PromptItem]:
    return [PromptItem(prompt=f"p{i}", prompt_ids=[i], columns={}) for i in range(n)]


def test_prompt_ledger_saves_the_position_of_the_prompts_trained_not_drawn():
    data = items(5)
    uninterrupted = PromptSampler(data, seed=3)
    order = [next(uninterrupted).prompt for _ in range(12)]
    wrapped = PromptLedger(PromptSampler(data, seed=3), window=100)
    drawn = [next(wrapped) for _ in range(9)]  # the orchestrator ran ahead (crosses an epoch)
    trained = drawn[:6]
    wrapped.mark_trained([trained_group(i.prompt_ids) for i in trained[3:]])
    wrapped.mark_trained([trained_group(i.prompt_ids) for i in trained[:3]])
    wrapped.mark_trained([trained_group([99], replayed=True)])  # replayed: not a draw
    resumed = PromptLedger(PromptSampler(data, seed=99), window=100)
    resumed.load_state_dict(wrapped.state_dict())
    assert [next(resumed).prompt for _ in range(6)] == order[6:12]


def test_prompt_ledger_forgets_draws_beyond_its_window():
    wrapped = PromptLedger(PromptSampler(items(4), seed=0), window=2)
    first = [next(wrapped) for _ in range(3)]  # the first draw's group was dropped; only 2 are remembered
    wrapped.mark_trained([trained_group(first[1].prompt_ids)])
    fresh = PromptSampler(items(4), seed=0)
    fresh.load_state_dict(wrapped.state_dict())
    assert next(fresh).prompt == first[2].prompt


def test_prompt_ledger_skips_re_rolled_groups_and_its_window_covers_the_queue():
    ledger = PromptLedger(PromptSampler(items(3), seed=0), window=10)
    drawn = next(ledger)
    ledger.mark_trained([trained_group(drawn.prompt_ids, rerolled=True)])  # a re-roll was not drawn here
    assert ledger.state_dict() != ledger.live_state_dict()  # the draw is still outstanding
    ledger.mark_trained([trained_group(drawn.prompt_ids)])
    assert ledger.state_dict() == ledger.live_state_dict()
    assert draw_window(max_inflight_groups=8, queued_groups=4, groups_per_step=2) == 2 * (8 + 4 + 2) + 16
