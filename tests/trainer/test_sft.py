"""The supervised warm start and its held-out check (`trainer.sft`): the report tells a converged warm start from
one that did not learn, on pairs it never trained on, with hand-computed accuracies."""

from __future__ import annotations

import pytest
import torch

from async_grpo.trainer.sft import CONVERGED_SEQUENCE_ACCURACY, supervised_warm_start, warm_start_report

EOS = 1


def copy_pairs(lo: int, hi: int, first: int = 7) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) pairs whose completion repeats the prompt's last token: a copy the model must learn."""
    return [([first, 8, t], [t, EOS]) for t in range(lo, hi)]


def test_an_untrained_model_is_reported_unconverged(tiny_model):
    report = warm_start_report(tiny_model, copy_pairs(40, 60))
    assert not report.converged and report.sequence_accuracy < CONVERGED_SEQUENCE_ACCURACY
    assert report.loss > 1.0  # about ln(vocab) for a random model


def test_the_report_tells_learning_from_memorizing(tiny_model):
    """Trained on every copy behind two prefixes, the model memorizes (prefix, token) pairs: held-out pairs behind a
    third prefix show it (half the tokens, EOS, right); trained on a random 80% of the pairs behind ten prefixes, it
    learns the copy, and the held-out 20% show that too."""
    torch.manual_seed(0)
    supervised_warm_start(tiny_model, copy_pairs(20, 120, 7) + copy_pairs(20, 120, 5), steps=200, learning_rate=3e-3)
    assert warm_start_report(tiny_model, copy_pairs(20, 120, 7)).converged  # the pairs it trained on
    memorized = warm_start_report(tiny_model, copy_pairs(20, 120, 9))
    assert not memorized.converged and memorized.token_accuracy < 0.6


def test_a_warm_start_that_learned_the_copy_is_reported_converged_on_held_out_pairs(tiny_model):
    pairs = [pair for first in range(3, 13) for pair in copy_pairs(20, 120, first)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    cut = len(pairs) * 4 // 5
    torch.manual_seed(0)
    supervised_warm_start(tiny_model, [pairs[i] for i in order[:cut]], steps=300, learning_rate=3e-3, seed=0)
    report = warm_start_report(tiny_model, [pairs[i] for i in order[cut:]])
    assert report.converged and report.token_accuracy > 0.95


def test_accuracies_are_counted_per_completion_token(tiny_model):
    """Two completion tokens per pair: the copy and EOS. A model that always predicts EOS gets exactly half."""

    class AlwaysEos(torch.nn.Module):
        training = False

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            logits = torch.zeros(*input_ids.shape, 16)
            logits[..., EOS] = 10.0
            return type("Out", (), {"logits": logits})()

    report = warm_start_report(AlwaysEos(), copy_pairs(2, 12))
    assert report.token_accuracy == pytest.approx(0.5) and report.sequence_accuracy == 0.0
    with pytest.raises(ValueError, match="no held-out pairs"):
        warm_start_report(AlwaysEos(), [])
