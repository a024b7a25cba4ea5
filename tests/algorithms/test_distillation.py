"""On-policy distillation's per-token advantage: against a hand computation, through the objective's gradient, and in
expectation against TRL's own reverse KL (GKD's `generalized_jsd_loss` with beta=1); the dense top-k forward KL
against a hand computation and, over a whole vocabulary, against TRL's forward KL (beta=0)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from async_grpo.algorithms import GRPOObjective, LossSettings, MicroBatchInputs, distillation_advantages
from async_grpo.algorithms.distillation import group_baselines, topk_forward_kl
from async_grpo.algorithms.logprobs import selective_log_softmax

NAN = float("nan")


def test_advantage_matches_a_hand_computation():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]])
    teacher = torch.tensor([[-0.4, -2.6, NAN], [-0.2, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1's last token: tool output / padding
    term = distillation_advantages(student, teacher, mask, weight=0.5)
    # A_t = 0.5 * (teacher - student) where trained and scored, else 0
    # row 0: 0.5 * 0.6 = 0.3, 0.5 * -0.6 = -0.3, unscored -> 0;  row 1: 0, 0.5 * 2.0 = 1.0, masked -> 0
    expected = torch.tensor([[0.3, -0.3, 0.0], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(term.advantages, expected)
    # reverse KL per scored trained token: (-0.6 + 0.6 + 0.0 - 2.0) / 4 = -0.5; 4 of 5 trained tokens scored
    assert term.metrics["distill/reverse_kl"] == pytest.approx(-0.5)
    assert term.metrics["distill/scored_fraction"] == pytest.approx(0.8)


def test_group_baselines_are_the_other_completions_mean_gap():
    teacher = [[-1.0, -2.0], [-0.5, NAN, -3.0], [NAN], [-1.0]]
    sampler = [[-2.0, -1.0], [-1.5, -1.0, -1.0], [-1.0], [-1.0]]
    mask = [[1, 1], [1, 1, 0], [1], [1]]
    # per completion mean of teacher - sampler over trained, finite tokens: 0.0, 1.0, none, 0.0
    # leave-one-out: (1 + 0) / 2, (0 + 0) / 2, (0 + 1 + 0) / 3, (0 + 1) / 2
    assert group_baselines(teacher, sampler, mask) == pytest.approx([0.5, 0.0, 1 / 3, 0.5])
    assert group_baselines([[-1.0]], [[-2.0]], [[1]]) == [0.0]  # nobody else: no baseline


def test_advantage_subtracts_the_rows_baseline_on_scored_tokens_only():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.4, -2.6, NAN]])
    term = distillation_advantages(student, teacher, torch.ones(1, 3), weight=2.0, baselines=torch.tensor([0.5]))
    torch.testing.assert_close(term.advantages, torch.tensor([[2.0 * (0.6 - 0.5), 2.0 * (-0.6 - 0.5), 0.0]]))
    assert term.metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)  # the raw KL estimate, baseline aside


def test_advantage_refuses_bad_shapes_and_weights():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        distillation_advantages(x, torch.zeros(2, 4), x, 1.0)
    with pytest.raises(ValueError, match="distillation_weight=0"):
        distillation_advantages(x, x, x, 0.0)


def _inputs(logps, teacher, mask, advantages):
    return MicroBatchInputs(
        logps=logps, entropies=torch.zeros_like(logps), mask=mask, advantages=advantages,
        sampling_logps=logps.detach().clone(), teacher_logps=teacher,
    )  # fmt: skip


@pytest.mark.parametrize("only", [False, True])
def test_objective_gradient_is_the_per_token_advantage(only):
    """On-policy (ratio 1), dapo over N trained tokens: d loss / d logp_t = -(A_grpo + w (teacher_t - logp_t)) / N,
    with the GRPO advantage left out under distillation_only."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]], requires_grad=True)
    teacher = torch.tensor([[-0.4, -2.6, NAN], [-0.2, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    grpo = torch.tensor([0.7, -0.3])
    settings = LossSettings(
        loss_type="dapo", vllm_importance_sampling_correction=False, distillation_weight=2.0, distillation_only=only
    )
    out = GRPOObjective(settings).micro_batch_loss(_inputs(logps, teacher, mask, grpo), num_items_in_batch=5)
    out.output.loss.backward()
    seq = torch.zeros(2, 1) if only else grpo.reshape(2, 1)
    hand = seq + 2.0 * torch.tensor([[0.6, -0.6, 0.0], [0.0, 2.0, 0.0]])
    torch.testing.assert_close(logps.grad, -(hand * mask) / 5)
    assert out.metrics["distill/reverse_kl"] == pytest.approx((-0.6 + 0.6 + 0.0 - 2.0) / 4)


def test_objective_ignores_the_teacher_without_a_weight():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    with_teacher = _inputs(logps, torch.tensor([[-0.1, -0.1]]), mask, torch.tensor([0.5]))
    out = GRPOObjective(LossSettings(loss_type="dapo")).micro_batch_loss(with_teacher, num_items_in_batch=2)
    out.output.loss.backward()
    torch.testing.assert_close(logps.grad, torch.full((1, 2), -0.5 / 2))
    assert not any(k.startswith("distill/") for k in out.metrics)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(distillation_weight=-1.0), "distillation_weight"),
        (dict(distillation_only=True), "distillation_only"),
        (dict(distillation_weight=1.0, use_liger_kernel=True), "distillation_weight"),
    ],
)
def test_settings_refuse_bad_distillation_values(change, field):
    with pytest.raises(ValueError, match=rf"^{field}=.*Fix: "):
        LossSettings(**change)


def _trl_reverse_kl():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl.experimental.gkd.gkd_trainer import GKDTrainer
    except ImportError:
        pytest.skip("trl (dev dependency) with its experimental GKD trainer is not installed")
    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("baseline", [None, 0.7])
def test_expected_gradient_equals_trls_reverse_kl_gradient(baseline):
    """The sampled-token estimator is unbiased, with or without a baseline that does not depend on the sampled token:
    averaged over every token the student can sample (weighted by its probability), the objective's gradient with
    distillation alone equals the gradient of KL(student || teacher), computed by TRL GKD's generalized_jsd_loss with
    beta=1 over the whole vocabulary."""
    jsd = _trl_reverse_kl()
    torch.manual_seed(0)
    vocab = 7
    student_logits = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(vocab, dtype=torch.float64)
    reference = jsd(student_logits.view(1, 1, -1), teacher_logits.view(1, 1, -1), beta=1.0, reduction="sum")
    (trl_grad,) = torch.autograd.grad(reference, student_logits)

    settings = LossSettings(loss_type="dapo", vllm_importance_sampling_correction=False, distillation_only=True,
                            distillation_weight=1.0)  # fmt: skip
    objective = GRPOObjective(settings)
    student_lp = torch.log_softmax(student_logits, -1)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    expected = torch.zeros(vocab, dtype=torch.float64)
    for token in range(vocab):  # E_{x ~ student}[grad of the loss on the sampled token x]
        logp = torch.log_softmax(student_logits, -1)[token].view(1, 1)
        inputs = _inputs(logp, teacher_lp[token].detach().view(1, 1), torch.ones(1, 1, dtype=torch.float64),
                         torch.zeros(1, dtype=torch.float64))  # fmt: skip
        if baseline is not None:
            inputs.teacher_baselines = torch.tensor([baseline], dtype=torch.float64)
        loss = objective.micro_batch_loss(inputs, num_items_in_batch=1).output.loss
        (g,) = torch.autograd.grad(loss, student_logits)
        expected += student_lp[token].exp().detach() * g
    torch.testing.assert_close(expected, trl_grad)
    assert reference.item() == pytest.approx(
        sum(math.exp(s) * (s - t) for s, t in zip(student_lp.tolist(), teacher_lp.tolist(), strict=True))
    )


# ---------------------------------------------------------------- distillation_loss: forward_kl (the teacher's top-k)
def test_topk_forward_kl_matches_a_hand_computation():
    ln = math.log
    # position 0: the teacher's top-2 hold 0.6 and 0.2 (mass 0.8) -> renormalized q = (0.75, 0.25)
    # position 1: one entry only (0.5) -> q = (1.0);  position 2: nothing scored;  position 3: masked (tool output)
    teacher = torch.tensor([[[ln(0.6), ln(0.2)], [ln(0.5), NAN], [NAN, NAN], [ln(0.9), ln(0.1)]]])
    student = torch.log(torch.tensor([[[0.5, 0.1], [0.25, 0.3], [0.2, 0.2], [0.1, 0.1]]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    term = topk_forward_kl(student, teacher, mask, weight=2.0)
    kl0 = 0.75 * (ln(0.75) - ln(0.5)) + 0.25 * (ln(0.25) - ln(0.1))
    kl1 = 1.0 * (0.0 - ln(0.25))
    torch.testing.assert_close(term.per_token, torch.tensor([[2 * kl0, 2 * kl1, 0.0, 0.0]]))
    assert term.metrics["distill/forward_kl"] == pytest.approx((kl0 + kl1) / 2)
    assert term.metrics["distill/topk_mass"] == pytest.approx((0.8 + 0.5) / 2)
    assert term.metrics["distill/topk_scored_fraction"] == pytest.approx(2 / 3)


def test_topk_forward_kl_refuses_bad_shapes_and_weights():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="one \\(B, T, K\\) shape"):
        topk_forward_kl(x, torch.zeros(1, 2, 4), torch.ones(1, 2), 1.0)
    with pytest.raises(ValueError, match="K >= 1"):
        topk_forward_kl(torch.zeros(1, 2, 0), torch.zeros(1, 2, 0), torch.ones(1, 2), 1.0)
    with pytest.raises(ValueError, match="distillation_weight=0"):
        topk_forward_kl(x, x, torch.ones(1, 2), 0.0)


def test_topk_forward_kl_over_the_whole_vocabulary_is_trls_forward_kl():
    """With K = V the renormalization is the identity and the term is KL(teacher || student): its value and its
    gradient equal TRL GKD's generalized_jsd_loss with beta=0 (the forward KL), over two positions."""
    jsd = _trl_reverse_kl()
    torch.manual_seed(1)
    vocab = 6
    student_logits = torch.randn(1, 2, vocab, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(1, 2, vocab, dtype=torch.float64)
    reference = jsd(student_logits, teacher_logits, beta=0.0, reduction="sum")
    (trl_grad,) = torch.autograd.grad(reference, student_logits)
    ids = torch.argsort(teacher_logits, dim=-1, descending=True)  # the teacher's "top-k", by rank, K = V
    student = torch.log_softmax(student_logits, -1).gather(-1, ids)
    teacher = torch.log_softmax(teacher_logits, -1).gather(-1, ids)
    term = topk_forward_kl(student, teacher, torch.ones(1, 2, dtype=torch.float64), weight=1.0)
    (ours,) = torch.autograd.grad(term.per_token.sum(), student_logits)
    assert term.per_token.sum().item() == pytest.approx(reference.item())
    torch.testing.assert_close(ours, trl_grad)
    assert term.metrics["distill/topk_mass"] == pytest.approx(1.0)


@pytest.mark.parametrize("only", [False, True])
def test_objective_adds_the_forward_kl_to_the_per_token_loss(only):
    """dapo over N trained tokens, on-policy: loss = -(sum_t A_grpo) / N + w * sum_t KL_t / N, and the sampled-token
    advantage is not added (the dense term replaces it); the GRPO part is left out under distillation_only."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    full = torch.log_softmax(logits, -1)  # (B, T, V)
    completion = torch.tensor([[0, 1, 2], [3, 4, 0]])
    topk_ids = torch.tensor([[[1, 2]] * 3, [[0, 4]] * 3])  # (B, T, K=2)
    teacher_topk = torch.log(torch.tensor([[[0.7, 0.2]] * 3, [[0.5, 0.4]] * 3]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    grpo = torch.tensor([0.7, -0.3])
    logps = full.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    inputs = _inputs(logps, torch.full((2, 3), -1.0), mask, grpo)
    inputs.topk_logps, inputs.teacher_topk_logps = full.gather(-1, topk_ids), teacher_topk
    settings = LossSettings(
        loss_type="dapo", vllm_importance_sampling_correction=False, distillation_weight=0.5,
        distillation_only=only, distillation_loss="forward_kl",
    )  # fmt: skip
    out = GRPOObjective(settings).micro_batch_loss(inputs, num_items_in_batch=5)
    dense = topk_forward_kl(full.gather(-1, topk_ids), teacher_topk, mask, 0.5).per_token
    policy = 0.0 if only else -(grpo.reshape(2, 1) * mask).sum()  # ratio 1: -A per trained token
    assert out.output.loss.item() == pytest.approx(((policy + dense.sum()) / 5).item(), rel=1e-6)
    (grad,) = torch.autograd.grad(out.output.loss, logits)
    assert grad.abs().sum() > 0
    assert out.metrics["distill/forward_kl"] > 0 and "distill/reverse_kl" in out.metrics


def test_objective_refuses_forward_kl_without_a_topk():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    settings = LossSettings(loss_type="dapo", distillation_weight=1.0, distillation_loss="forward_kl")
    inputs = _inputs(logps, torch.tensor([[-0.1, -0.1]]), torch.ones(1, 2), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="distillation_topk"):
        GRPOObjective(settings).micro_batch_loss(inputs, num_items_in_batch=2)
    with pytest.raises(ValueError, match="^distillation_loss='bogus'.*Fix: "):
        LossSettings(distillation_loss="bogus")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_scores_k_ids_per_position(dtype):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11).to(dtype)
    index = torch.randint(0, 11, (2, 3, 4))
    want = torch.log_softmax(logits.float(), -1).gather(-1, index)
    got = selective_log_softmax(logits, index)
    assert got.shape == (2, 3, 4)
    torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    torch.testing.assert_close(selective_log_softmax(logits, index[..., 0]).float(), want[..., 0], atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="trailing K"):
        selective_log_softmax(logits, index[:, :2])
