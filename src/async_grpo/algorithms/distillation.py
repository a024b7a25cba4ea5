"""On-policy distillation's per-token advantage: the negative reverse KL between the student and a teacher on the
student's own samples.

Thinking Machines, "On-Policy Distillation" (Lu et al., 2025; Tinker cookbook ``distillation``): the student samples
a completion, the teacher scores each sampled token, and the per-token reverse KL estimate
``log p_student(x_t | x_<t) - log p_teacher(x_t | x_<t)`` becomes a per-token penalty; minimizing
``E_{x ~ student}[sum_t (log p_student - log p_teacher)]``, the reverse KL ``KL(student || teacher)`` of the
sequence distributions, by the policy gradient gives every token the advantage

    A_t = distillation_weight * (log p_teacher(x_t) - log p_student(x_t))

(Tinker's ``advantages -= kl_penalty_coef * reverse_kl``). It is TRL's GKD on the student's own samples
(``lmbda=1``) with the reverse KL (``beta=1``) estimated at the sampled token, rather than summed over the vocabulary.
The GRPO advantage of the completion, when kept, is added to every token (:class:`~.objective.GRPOObjective`), so
distillation and reward learn together; the usual stale-policy IS weights and clipping then apply to A_t as to any
advantage.

A baseline that does not depend on the sampled token leaves this gradient's expectation unchanged
(``E_{x_t}[grad log p(x_t)] = 0`` for each context) and can cut its variance a great deal: a barely trained student
samples many tokens a sharp teacher finds unlikely, so the raw advantages are mostly large and negative (about -5
nats per token at the start of examples/distill_cpu.yaml), their gradient mostly pushes down whatever was sampled,
and its norm (21 there, against GRPO's 2) is clipped to ``max_grad_norm``. :func:`group_baselines` gives each
completion the mean per-token ``log p_teacher - log p_sampler`` of the *other* completions of its group (a
leave-one-out baseline, as RLOO's: independent of the completion's own tokens, so unbiased), and the advantage becomes
``weight * ((log p_teacher - log p_student) - baseline)``.

``log p_student`` is pi_old, the policy the step starts from (the trainer's own logprobs, detached: an advantage is
fixed before the update, as GRPO's is), and ``log p_teacher`` is vLLM's prompt logprob of the token under the teacher
(`distillation.teacher`), both at temperature 1.

The dense alternative, ``distillation_loss: forward_kl`` (:func:`topk_forward_kl`), does not go through the
advantage: at every trained position it adds to the per-token loss the forward KL from the teacher's top-k
distribution to the student's, ``sum_{v in topk} q(v) (log q(v) - log p_student(v))`` with ``q`` the teacher's top-k
probabilities renormalized to sum to 1 (NeMo RL's top-k distillation with ``kl_type: forward``; TRL GKD's
``generalized_jsd_loss(beta=0)`` restricted to the top-k, on the student's own samples as ``lmbda=1``). Its gradient
``-sum_v q(v) grad log p_student(v)`` moves every position toward the teacher's whole top-k, the sampled token or not,
so a weak student whose samples the teacher finds unlikely still learns what the teacher would have said. It is a
supervised term on the sampled prefixes, so no importance weight applies to it (GKD trains on mixed prefixes the
same way); the policy term beside it is corrected as usual.

Shapes: ``B`` completions, ``T`` completion tokens (right padded), ``K`` top-k entries per position. Log-probabilities
in nats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DistillationTerm", "TopKForwardKL", "distillation_advantages", "group_baselines", "topk_forward_kl"]


@dataclass
class DistillationTerm:
    """Result of :func:`distillation_advantages`.

    Attributes:
        advantages: ``(B, T)`` per-token distillation advantage ``weight * (teacher - student - baseline)`` (nats)
            on the trained tokens the teacher scored, 0 elsewhere; no gradient.
        metrics: ``distill/reverse_kl`` (mean over the scored trained tokens of ``student - teacher``, nats per
            token: the sample estimate of KL(student || teacher) per token) and ``distill/scored_fraction`` (the
            share of trained tokens the teacher scored, in [0, 1]).
    """

    advantages: Tensor
    metrics: dict[str, float]


def group_baselines(
    teacher_logprobs: Sequence[Sequence[float]],
    sampling_logprobs: Sequence[Sequence[float]],
    loss_mask: Sequence[Sequence[int]],
) -> list[float]:
    """Each completion's leave-one-out baseline for the distillation advantage (module docstring): the mean, over the
    other completions of its group that have any, of their mean per-token ``log p_teacher - log p_sampler`` (nats)
    over trained tokens with finite values; 0.0 when no other completion has one (a group of one, or nothing scored).

    Args:
        teacher_logprobs: G rows, (T_i,) the teacher's logprobs (NaN where none; `RolloutGroup.teacher_logprobs`).
        sampling_logprobs: G rows, (T_i,) the sampler's (vLLM's) logprobs of the same tokens.
        loss_mask: G rows, (T_i,) 1 on trained tokens.

    Returns:
        (G,) baselines, nats per token.
    """
    means: list[float | None] = []
    for teacher, sampler, mask in zip(teacher_logprobs, sampling_logprobs, loss_mask, strict=True):
        gaps = [q - p for q, p, m in zip(teacher, sampler, mask, strict=True) if m and math.isfinite(q - p)]
        means.append(sum(gaps) / len(gaps) if gaps else None)
    known = [m for m in means if m is not None]
    total = sum(known)
    out = []
    for m in means:
        others = len(known) - (m is not None)
        out.append((total - (m or 0.0)) / others if others else 0.0)
    return out


def distillation_advantages(
    student_logps: Tensor, teacher_logps: Tensor, mask: Tensor, weight: float, baselines: Tensor | None = None
) -> DistillationTerm:
    """The per-token reverse-KL advantage of on-policy distillation (module docstring).

    Args:
        student_logps: ``(B, T)`` the student's logprobs of the sampled tokens (pi_old; detached here).
        teacher_logps: ``(B, T)`` the teacher's logprobs of the same tokens; NaN (or inf) where the teacher gave
            none: those tokens get no distillation advantage.
        mask: ``(B, T)`` loss mask, 1 on trained tokens (tool output and padding 0: no advantage there).
        weight: ``distillation_weight`` (> 0), Tinker's ``kl_penalty_coef``.
        baselines: ``(B,)`` subtracted from every scored token's ``teacher - student`` of its row before the weight
            (:func:`group_baselines`); None: none (Tinker's plain advantage).

    Returns:
        :class:`DistillationTerm`.

    Raises:
        ValueError: shapes differ, or ``weight`` is not > 0.
    """
    if student_logps.shape != teacher_logps.shape or student_logps.shape != mask.shape or student_logps.dim() != 2:
        raise ValueError(
            f"student_logps {tuple(student_logps.shape)}, teacher_logps {tuple(teacher_logps.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape"
        )
    if not weight > 0:
        raise ValueError(f"distillation_weight={weight} must be > 0. Fix: use e.g. 1.0")
    student = student_logps.detach()
    scored = mask.bool() & torch.isfinite(teacher_logps) & torch.isfinite(student)  # (B, T)
    reverse_kl = torch.where(scored, student - teacher_logps, torch.zeros_like(student))  # (B, T) nats
    gap = -reverse_kl  # (B, T) teacher - student on scored tokens
    if baselines is not None:
        gap = torch.where(scored, gap - baselines.to(gap.dtype).reshape(-1, 1), gap)
    advantages = weight * gap  # (B, T)
    trained = mask.bool().sum()
    n_scored = scored.sum()
    metrics = {
        "distill/reverse_kl": float(reverse_kl.sum() / n_scored.clamp(min=1)),
        "distill/scored_fraction": float(n_scored / trained.clamp(min=1)),
    }
    return DistillationTerm(advantages=advantages, metrics=metrics)


@dataclass
class TopKForwardKL:
    """Result of :func:`topk_forward_kl`.

    Attributes:
        per_token: ``(B, T)`` ``weight * KL_t`` (nats) at the scored trained positions, 0 elsewhere; with gradient to
            the student's logprobs. The loss adds it to its per-token loss (:class:`~.inputs.LossInputs`).
        metrics: ``distill/forward_kl`` (mean over the scored trained positions of ``KL_t``, nats per token, before the
            weight), ``distill/topk_mass`` (mean probability mass the teacher's top-k holds before renormalizing, in
            [0, 1]: 1 means the KL is the whole-vocabulary one) and ``distill/topk_scored_fraction`` (the share of
            trained positions with a top-k, in [0, 1]).
    """

    per_token: Tensor
    metrics: dict[str, float]


def topk_forward_kl(
    student_topk_logps: Tensor, teacher_topk_logps: Tensor, mask: Tensor, weight: float
) -> TopKForwardKL:
    """The dense distillation term: at every trained position, the forward KL from the teacher's renormalized top-k
    to the student (module docstring):

        KL_t = sum_{v in topk_t} q_t(v) (log q_t(v) - log p_student(v)),   q_t = softmax over topk_t of log p_teacher

    ``log p_student(v)`` is the student's full-vocabulary log-softmax at ``v`` (not renormalized over the top-k), so
    the gradient also pulls mass away from tokens outside the teacher's top-k.

    Args:
        student_topk_logps: ``(B, T, K)`` the current student's logprobs of the teacher's top-k tokens (with grad).
        teacher_topk_logps: ``(B, T, K)`` the teacher's logprobs of them (nats, temperature 1); NaN (or -inf) for an
            absent entry (a position with fewer than K, or none: no term there).
        mask: ``(B, T)`` loss mask, 1 on trained tokens (tool output and padding 0: no term there).
        weight: ``distillation_weight`` (> 0), multiplying ``KL_t``.

    Returns:
        :class:`TopKForwardKL`.

    Raises:
        ValueError: the shapes differ, ``K`` is 0, or ``weight`` is not > 0.
    """
    if student_topk_logps.shape != teacher_topk_logps.shape or student_topk_logps.dim() != 3:
        raise ValueError(
            f"student_topk_logps {tuple(student_topk_logps.shape)} and teacher_topk_logps "
            f"{tuple(teacher_topk_logps.shape)} must share one (B, T, K) shape"
        )
    if student_topk_logps.shape[:2] != mask.shape or student_topk_logps.size(-1) == 0:
        raise ValueError(f"mask {tuple(mask.shape)} must be (B, T) of the top-k's (B, T, K) with K >= 1")
    if not weight > 0:
        raise ValueError(f"distillation_weight={weight} must be > 0. Fix: use e.g. 1.0")
    present = torch.isfinite(teacher_topk_logps)  # (B, T, K)
    scored = mask.bool() & present.any(dim=-1)  # (B, T)
    teacher = torch.where(present, teacher_topk_logps, torch.full_like(teacher_topk_logps, -torch.inf))
    mass = torch.where(scored, torch.exp(teacher).sum(-1), torch.zeros_like(mask, dtype=teacher.dtype))  # (B, T)
    safe = torch.where(scored.unsqueeze(-1), teacher, torch.zeros_like(teacher))  # a row of -inf would give NaN
    log_q = torch.log_softmax(safe, dim=-1)  # (B, T, K): the renormalized top-k
    q = torch.where(present & scored.unsqueeze(-1), torch.exp(log_q), torch.zeros_like(log_q))
    student = torch.where(present, student_topk_logps, torch.zeros_like(student_topk_logps))
    kl = (q * (torch.where(q > 0, log_q, torch.zeros_like(log_q)) - student)).sum(-1)  # (B, T)
    kl = torch.where(scored, kl, torch.zeros_like(kl))
    n_scored = scored.sum().clamp(min=1)
    metrics = {
        "distill/forward_kl": float(kl.detach().sum() / n_scored),
        "distill/topk_mass": float(mass.sum() / n_scored),
        "distill/topk_scored_fraction": float(scored.sum() / mask.bool().sum().clamp(min=1)),
    }
    return TopKForwardKL(per_token=weight * kl, metrics=metrics)
