"""The trainer: one optimizer step per `TrainBatch`, with the stale-rollout correction.

It is algorithm-blind: advantages arrive with the batch, and each micro-batch's loss comes from the
`GRPOObjective` built from the `LossSettings` (`async_grpo.algorithms.objective`), which owns the
importance-sampling weights, OPSM, the entropy mask, the KL and the plain or liger-fused loss. Per step the
learner (1) packs the groups into padded tensors, (2) runs the forward passes the objective asks for (the
policy's per-token logprobs and entropies, or its hidden states for the fused loss; the reference model's
logprobs when there is a KL term), (3) backpropagates each micro-batch's loss with gradient accumulation and
(4) takes one AdamW step.

Old logprobs are the trainer's own (one optimizer step per batch: the current policy, detached; with rollout
reuse the cached ones from `old_logps`); vLLM's sampling logprobs enter only the stale-policy IS weight and
OPSM, and replayed rows are handled by the objective (`LossSettings.replay_recompute_logps`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from async_grpo.algorithms import GRPOObjective, LossSettings, MicroBatchInputs
from async_grpo.trainer.flattening import completion_hidden_states, completion_logps, flat_row_tokens
from async_grpo.trainer.logprobs import chunked_token_logps
from async_grpo.trainer.lr_schedule import LRSchedule
from async_grpo.trainer.microbatching import MicroBatching, accumulate_metrics, take
from async_grpo.trainer.packing import PackedBatch, pack_batch
from async_grpo.trainer.prefix_sharing import check_model, unsupported_reason
from async_grpo.trainer.protocol import AdapterPush
from async_grpo.transports.messages import TrainBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ForwardPasses:
    """What `GRPOLearner._forward` computed on one micro-batch of N completions and T completion tokens: the
    forward passes `GRPOObjective` asks for, at its sampling temperature (logits divided by it).

    Attributes:
        logps: (N, T) float32 policy logprobs of the sampled tokens (nats; 0 at padding): with grad on the plain
            path, detached on the fused path (the gradient flows through `hidden` there).
        entropies: (N, T) float32 entropies of the policy's next-token distributions (nats), no grad.
        hidden: (N, T, H) decoder hidden states at the positions predicting the completion tokens, with grad, on the
            fused path (`objective.wants_hidden_states`); None otherwise.
        lm_head: the policy's output projection (`weight` (V, H)) on the fused path; None otherwise.
        ref_logps: (N, T) float32 frozen reference-model logprobs (nats), no grad, when the loss has a KL term
            (`objective.needs_reference`); None otherwise.
        topk_logps: (N, T, K) float32 policy logprobs of the teacher's top-k tokens at each completion position
            (`PackedBatch.teacher_topk_ids`; nats, with grad) when the batch carries a top-k (`distillation_loss:
            forward_kl`); None otherwise.
    """

    logps: torch.Tensor
    entropies: torch.Tensor
    hidden: torch.Tensor | None
    lm_head: torch.nn.Module | None
    ref_logps: torch.Tensor | None
    topk_logps: torch.Tensor | None = None


class GRPOLearner:
    """Holds the policy, the optional frozen reference, and the optimizer; `step(batch)` trains once.

    Args:
        model: a transformers causal LM in float32 (train mode is set here).
        learning_rate, weight_decay, max_grad_norm: AdamW settings.
        micro_batch_size: completions per forward/backward (TRL per_device_train_batch_size).
        loss: the loss options; each micro-batch's loss is `GRPOObjective(loss)`'s.
        pad_token_id: id used for padding.
        skip_zero_advantage_batches: skip the forward/backward of completions with a zero advantage (requires
            beta == 0; they carry no policy gradient). Where the loss is separable by rows (`row_skipping`: dapo /
            cispo, whose divisor is the step's token count, counted before the skip, and no top-entropy mask, whose
            quantile is taken over the micro-batch) they are dropped before the cut, so only the others are
            trained, with the same update; otherwise only micro-batches whose advantages are all 0 are skipped.
        logprob_chunk_size: LM-head positions per block, or None for full logits (see `trainer.logprobs`).
        fsdp: shard the model over the ranks with FSDP2 (several ranks only).
        mixed_precision: None (float32 everywhere) or "bf16": forward passes under bfloat16 autocast with float32
            master weights, gradients and optimizer state (TRL `bf16`; `_autocast`).
        lr_schedule: the learning-rate schedule (`trainer.lr_schedule.LRSchedule`, stepped after every optimizer
            step, its state in `state_dict`); None keeps learning_rate constant.
        adam_betas, adam_epsilon: AdamW's betas and eps (transformers `adam_beta1/2`, `adam_epsilon`).
        max_tokens_per_microbatch, batch_flattening, group_by_length: see `trainer.microbatching.MicroBatching`
            (raises ValueError); group_by_length is off for the loss types whose gradient depends on the cut
            (`LossNormalizer.cut_invariant` False: bnpo).
        share_prompt_prefix: run each micro-batch's distinct prompts once and continue their completions from the
            prompt pass's KV cache (`trainer.prefix_sharing`; verl `actor.use_prefix_grouper`): the same logprobs,
            loss and gradients as the padded path up to float rounding, for U x P + N x T positions instead of
            N x (P + T). "auto": where the model and layout allow it (`auto_prompt_sharing`), each chunk is cut with
            shared prompts when that covers at least 10 % fewer positions (`microbatching.AUTO_MIN_SAVING`), else
            padded; nothing is raised.

    Raises:
        ValueError: skip_zero_advantage_batches with a KL term, fsdp with options it cannot run, an unknown
            mixed_precision, or share_prompt_prefix with fsdp, batch_flattening, gradient checkpointing or a model
            whose cache is not all full-attention layers (`prefix_sharing.check_model`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        weight_decay: float,
        max_grad_norm: float,
        micro_batch_size: int,
        loss: LossSettings,
        pad_token_id: int,
        logprob_chunk_size: int | None = None,
        skip_zero_advantage_batches: bool = False,
        fsdp: bool = False,
        mixed_precision: str | None = None,
        lr_schedule: LRSchedule | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_epsilon: float = 1e-8,
        max_tokens_per_microbatch: int | None = None,
        batch_flattening: bool = False,
        group_by_length: bool = False,
        share_prompt_prefix: bool | Literal["auto"] = False,
    ):
        if mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision={mixed_precision!r} is not None or 'bf16'. Fix: use bf16=true or false.")
        self.mixed_precision = mixed_precision
        self.model = model
        self.model.train()
        self.objective = GRPOObjective(loss)
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.pad_token_id = pad_token_id
        self.logprob_chunk_size = logprob_chunk_size
        self.skip_zero_advantage_batches = skip_zero_advantage_batches
        # cumulative counts, logged as metrics: skipped micro-batches and completions (zero advantage); optimizer
        # steps skipped for a NaN/inf gradient
        self.skipped_zero_adv_microbatches = self.skipped_zero_adv_completions = self.skipped_nonfinite_steps = 0
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.device = next(model.parameters()).device
        if skip_zero_advantage_batches and self.objective.needs_reference:
            raise ValueError(
                "skip_zero_advantage_batches needs beta=0: a skipped micro-batch would lose its KL "
                "term. Fix: set beta=0 or skip_zero_advantage_batches=false."
            )
        self.ref_model = self.reference_model(model) if self.objective.needs_reference else None
        self.sharded = fsdp and self.world_size > 1
        if share_prompt_prefix == "auto":
            share_prompt_prefix = self.auto_prompt_sharing(model)  # with batch_flattening MicroBatching keeps it off
        self.batching = MicroBatching(
            micro_batch_size,
            max_tokens_per_microbatch,
            batch_flattening,
            flat_row_tokens(model, self.sharded),  # one row or rows bounded by the longest
            group_by_length and self.objective.normalizer.cut_invariant,  # not bnpo: its token mean depends on the cut
            share_prompt_prefix,
        )
        if share_prompt_prefix is True:
            if self.sharded:
                raise ValueError("share_prompt_prefix with fsdp is not supported. Fix: set share_prompt_prefix=false.")
            check_model(model)  # full-attention KV cache, no gradient checkpointing
        if self.sharded:  # after the reference copy, before the optimizer sees the (now sharded) parameters
            if logprob_chunk_size is not None or self.objective.wants_hidden_states or skip_zero_advantage_batches:
                raise ValueError(
                    "fsdp needs logprob_chunk_size=None, use_liger_kernel=false and "
                    "skip_zero_advantage_batches=false. Fix: unset them."
                )
            from async_grpo.trainer.distributed import shard_model

            shard_model(self.model, mixed_precision)  # bf16: FSDP2's MixedPrecisionPolicy, float32 master weights
            if self.ref_model is not None:
                shard_model(self.ref_model, mixed_precision)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=learning_rate,
            weight_decay=weight_decay,
            betas=adam_betas,
            eps=adam_epsilon,
        )
        self.scheduler = lr_schedule.build(self.optimizer) if lr_schedule is not None else None

    def auto_prompt_sharing(self, model: torch.nn.Module) -> bool | Literal["auto"]:
        """What `share_prompt_prefix: auto` stands for on `model`: "auto" (each chunk shares prompts when that saves
        positions, `MicroBatching.plan`, which also keeps batch_flattening's own layout) where shared-prompt passes
        run exactly, else False (logged with the reason): fsdp, or a model `prefix_sharing.unsupported_reason`
        refuses (gradient checkpointing, a sliding-window or recurrent cache)."""
        reason = "fsdp shards the model" if self.sharded else unsupported_reason(model)
        if reason is not None:
            logger.info("share_prompt_prefix=auto: the padded layout (%s)", reason)
            return False
        return "auto"

    def reference_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference: a copy of the initial policy (`trainer.peft.PeftLearner`: adapters off)."""
        return copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def row_skipping(self) -> bool:
        """True when `skip_zero_advantage_batches` drops single completions with a zero advantage before the cut
        (the step's update is unchanged): the loss divides by the step's token count
        (`LossNormalizer.divides_by_tokens`: dapo, cispo), so each completion's term is independent of the others
        once that count is known, and no top-entropy mask (`top_entropy_quantile` < 1: its quantile is taken
        over the micro-batch's tokens). Needs beta == 0 (checked at construction). False otherwise: then only
        micro-batches whose advantages are all 0 are skipped."""
        settings = self.objective.settings
        return (
            self.skip_zero_advantage_batches
            and self.objective.normalizer.divides_by_tokens
            and settings.top_entropy_quantile >= 1.0
        )

    def _micro_batches(self, chunks: Iterable[TrainBatch], counts: _ChunkCounts | None = None) -> Iterator[PackedBatch]:
        """Pack each chunk (a whole step batch, or one streamed chunk) and cut it into micro-batches, in order
        (`micro_batch_size` completions, or a token budget; padded or flattened: `self.batching`). With
        `row_skipping`, the completions with a zero advantage are dropped from each packed chunk first. `counts`,
        when given, gains each chunk's loss tokens (completion mask sum, dropped completions included) and dropped
        completions before the chunk's micro-batches are yielded (`step` passes it; `old_logps` counts nothing)."""
        for chunk in chunks:
            if not chunk.groups:
                continue
            mask_truncated = self.objective.settings.mask_truncated_completions
            packed = pack_batch(chunk, self.pad_token_id, mask_truncated).to(self.device)
            if counts is not None:
                counts.tokens += float(packed.completion_mask.sum())
            if self.row_skipping:
                keep = packed.carries_gradient().nonzero()[:, 0]  # (K,) rows that carry a policy gradient
                if counts is not None:
                    counts.skipped_completions += len(packed) - len(keep)
                if len(keep) == 0:
                    continue
                if len(keep) < len(packed):
                    packed = take(packed, keep)
            yield from self.batching.cut(packed)

    @torch.no_grad()
    def old_logps(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The current policy's per-token logprobs of `batch`, one (n_i, T) tensor per micro-batch of `step`.

        Pass them to `step(batch, old_logps=...)` when the same batch is trained on more than once
        (`num_iterations`, `mini_epochs`, `steps_per_generation` > 1): pi_old must stay the policy from before
        the rollout's first update (GRPO, arXiv 2402.03300 Alg. 1; TRL computes them at generation time).
        """
        was_training = self.model.training
        self.model.eval()
        try:
            micro = list(self._micro_batches([batch]))
            placeholders = self._max_over_ranks(len(micro)) - len(micro) if self.sharded else 0
            with self._autocast():
                out = [
                    completion_logps(
                        self.model, mb, chunk_size=self.logprob_chunk_size, temperature=self.objective.temperature
                    )[0].detach()
                    for mb in micro
                ]
                for _ in range(placeholders):  # as many FSDP forwards as the busiest rank
                    completion_logps(self.model, self._dummy_packed(), temperature=self.objective.temperature)
            return out
        finally:
            self.model.train(was_training)

    def step(
        self, batch: TrainBatch | Iterable[TrainBatch], *, old_logps: list[torch.Tensor] | None = None
    ) -> dict[str, float]:
        """One optimizer step over every completion of `batch`; returns loss metrics (TRL names).

        The loss normalizers come from the `loss_type`'s row of `algorithms.normalizers.LOSS_NORMALIZERS`
        (`self.objective.normalizer`): every micro-batch's loss gets both step counts, the loss tokens of the step
        summed over the ranks (`num_items_in_batch`, the divisor of dapo / cispo) and the micro-batches per
        optimizer step (`gradient_accumulation_steps`, the divisor of grpo / bnpo / dr_grpo / sapo), and the row
        picks its divisor; a streamed step runs with unit counts and the row rescales the gradients and
        `policy_loss` once the counts are known.

        Args:
            batch: the step's `TrainBatch`, or an iterable of chunks of it (streaming group scoring, e.g. a
                `StepStream`), consumed as they arrive: each chunk's forward/backward runs before the next
                chunk is awaited, and the loss normalizers (token count, micro-batch count) are applied to the
                gradients once the last chunk is in, so the update equals the unstreamed one.
            old_logps: per-micro-batch pi_old logprobs from `old_logps(batch)` (rollout reuse); None uses the
                current policy (one optimizer step per batch: ratio 1, gradient of the clipped objective).

        Raises:
            ValueError: `old_logps` does not match the batch's micro-batches, or a streamed step with several
                ranks (not supported).
        """
        normalizer = self.objective.normalizer  # the loss_type's row of LOSS_NORMALIZERS
        streamed = not isinstance(batch, TrainBatch)
        if streamed and self.world_size > 1:
            raise ValueError("streaming_min_groups with several trainer ranks is not supported. Fix: unset it.")
        counts = _ChunkCounts()  # the step's loss tokens (row-skipped completions included) and skipped completions
        shared_before = self.batching.shared_microbatches
        micro: Iterable[PackedBatch] = self._micro_batches([batch] if not streamed else batch, counts)
        if streamed:  # normalizers unknown until the last chunk: unnormalized losses, gradients rescaled below
            num_items: torch.Tensor | float = 1.0
            accumulation, completions = 1, 1.0  # with a token budget: unit weight per completion, rescaled below
        else:
            micro = list(micro)
            num_items = self._all_reduce_sum(
                torch.tensor(counts.tokens, device=self.device)
            )  # TRL: tokens of the accumulation window across ranks
            if old_logps is not None and len(old_logps) != len(micro):
                raise ValueError(
                    f"old_logps has {len(old_logps)} micro-batches, the batch {len(micro)}. "
                    "Fix: compute them with old_logps(batch) on the same batch."
                )
            # TRL divides grpo/bnpo/dr_grpo/sapo by the micro-batches per step; over ranks with unequal shares
            # that is the real micro-batches of all ranks / world size, so that averaging the ranks' gradients
            # gives exactly one process's update over the same micro-batches (placeholders do not count)
            accumulation = float(self._all_reduce_sum(torch.tensor(float(len(micro)), device=self.device)))
            accumulation /= self.world_size
            completions = self.batching.completions_per_rank(micro, self._all_reduce_sum, self.world_size)
            if self.sharded:  # FSDP collectives run per forward/backward: every rank does as many
                micro += [_DUMMY] * (self._max_over_ranks(len(micro)) - len(micro))
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        step_loss = 0.0
        seen_micro = 0
        self.optimizer.zero_grad(set_to_none=True)
        for index, mb in enumerate(micro):
            if self.sharded:  # reduce-scatter the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(index == len(micro) - 1)
            if mb is _DUMMY:
                self._dummy_pass()
                continue
            seen_micro += len(mb) if self.batching.by_tokens else 1  # the normalizer of a streamed step
            if self.skip_zero_advantage_batches and not bool(mb.carries_gradient().any()):
                # no policy gradient here (and beta == 0, checked by the config): skip the forward/backward;
                # the loss normalizer still counts these tokens, so the step equals the unskipped one
                self.skipped_zero_adv_microbatches += 1
                continue
            with self._autocast():
                passes = self._forward(mb)
            inputs = MicroBatchInputs(
                passes.logps, passes.entropies, mb.completion_mask, mb.advantages, mb.sampling_logps,
                replayed=mb.replayed, old_logps=None if old_logps is None else old_logps[index],
                ref_logps=passes.ref_logps, hidden=passes.hidden, lm_head=passes.lm_head,
                completion_ids=mb.completion_ids, teacher_logps=mb.teacher_logps,
                teacher_baselines=mb.teacher_baselines, topk_logps=passes.topk_logps,
                teacher_topk_logps=mb.teacher_topk_logps if passes.topk_logps is not None else None,
            )  # fmt: skip
            result = self.objective.micro_batch_loss(
                inputs,
                num_items_in_batch=num_items,
                gradient_accumulation_steps=self.batching.accumulation(mb, accumulation, completions),
                num_processes=self.world_size,
            )
            result.output.loss.backward()
            step_loss += result.output.loss.item()  # micro-batch losses are pre-scaled: their sum is the step loss
            accumulate_metrics(sums, weights, result.metrics, result.weight)
        self.skipped_zero_adv_completions += counts.skipped_completions  # every chunk has been packed by now
        if streamed:
            num_items = counts.tokens
            scale = normalizer.streamed_scale(counts.tokens, seen_micro)
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
            step_loss *= scale
        if not self.sharded:  # FSDP averaged the gradients in its reduce-scatter
            self._all_reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the rate this step applied
        if torch.isfinite(grad_norm):  # global (all ranks' gradients): every rank agrees
            self.optimizer.step()
        else:  # a NaN/inf gradient would poison the weights (and vLLM's at the next push): skipped, counted
            self.skipped_nonfinite_steps += 1
            logger.warning("step skipped: gradient norm %s (loss %s)", float(grad_norm), step_loss)
        if self.scheduler is not None:
            self.scheduler.step()
        metrics = {k: sums[k] / max(weights[k], 1e-9) for k in sums}
        if streamed:  # the per-micro-batch metrics were computed with unit normalizers too
            metrics = normalizer.streamed_metrics(metrics, counts.tokens)
        metrics["loss"] = step_loss
        metrics["skipped_zero_adv_microbatches"] = float(self.skipped_zero_adv_microbatches)
        metrics["skipped_zero_adv_completions"] = float(self.skipped_zero_adv_completions)
        metrics["skipped_nonfinite_steps"] = float(self.skipped_nonfinite_steps)
        metrics["oversized_microbatch_sequences"] = float(self.batching.oversized)  # longer than the budget
        metrics["shared_prompt_microbatches"] = float(self.batching.shared_microbatches - shared_before)  # this step
        metrics["grad_norm"] = float(grad_norm)
        metrics["learning_rate"] = learning_rate
        metrics["num_tokens"] = float(num_items)
        return metrics

    def _forward(self, mb: PackedBatch) -> ForwardPasses:
        """The forward passes the objective asks for on one micro-batch (`ForwardPasses`: the policy's logps and
        entropies, its hidden states and LM head on the fused path, the reference's logps with a KL term, the
        policy's logps of the teacher's top-k with `distillation_loss: forward_kl`)."""
        temperature = self.objective.temperature
        hidden = head = topk_logps = None
        if self.objective.wants_hidden_states:  # the fused loss applies the LM head itself; logps: IS/OPSM/metrics
            t, head = mb.completion_ids.size(1), self.model.get_output_embeddings()
            hidden = completion_hidden_states(self.model, mb)
            with torch.no_grad():
                logps, entropy = chunked_token_logps(
                    hidden.detach(),
                    head,
                    mb.completion_ids,
                    self.logprob_chunk_size or t,
                    with_entropy=True,
                    temperature=temperature,
                )
        else:
            targets = mb.scored_targets()  # (N, T, 1 + K): the sampled token, then the teacher's top-k; None: K = 0
            logps, entropy = completion_logps(
                self.model,
                mb,
                with_entropy=True,
                chunk_size=self.logprob_chunk_size,
                temperature=temperature,
                targets=targets,
            )
            if targets is not None:  # one pass scores both: the LM head and its log-softmax run once
                logps, topk_logps = logps[..., 0], logps[..., 1:]
        ref_logps = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logps, _ = completion_logps(
                    self.ref_model, mb, chunk_size=self.logprob_chunk_size, temperature=temperature
                )
        return ForwardPasses(
            logps=logps, entropies=entropy, hidden=hidden, lm_head=head, ref_logps=ref_logps, topk_logps=topk_logps
        )

    def _autocast(self):
        """bf16 autocast around the forward passes (`bf16`, TRL name), else a no-op: matmuls run in bfloat16 while
        the parameters, their gradients and AdamW's state stay float32 (master weights), and logits are cast to
        float32 before the log-softmax (`trainer.logprobs`), so logprobs and the loss are float32."""
        if self.mixed_precision is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ several ranks (data parallel)
    def _max_over_ranks(self, n: int) -> int:
        value = torch.tensor(float(n), device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    def _dummy_packed(self) -> PackedBatch:
        """A 2-token placeholder row whose completion token has loss weight 0."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long, device=self.device)
        return PackedBatch(
            ids,
            torch.ones_like(ids),
            torch.arange(2, device=self.device).unsqueeze(0),
            ids[:, 1:],
            torch.zeros((1, 1), device=self.device),
            torch.zeros((1, 1), device=self.device),
            torch.zeros(1, device=self.device),
            torch.zeros(1, dtype=torch.bool, device=self.device),
            torch.full((1, 1), float("nan"), device=self.device),
            torch.zeros(1, device=self.device),
            torch.zeros((1, 1, 0), dtype=torch.long, device=self.device),
            torch.zeros((1, 1, 0), device=self.device),
        )

    def _dummy_pass(self) -> None:
        """For a rank with fewer micro-batches than the busiest one (FSDP): forward (policy and reference) and
        backward of a placeholder row with weight 0, i.e. zero gradients through the same all-gathers and
        reduce-scatters as a real micro-batch."""
        mb = self._dummy_packed()
        with self._autocast():
            logps, _ = completion_logps(self.model, mb, temperature=self.objective.temperature)
            if self.ref_model is not None:
                with torch.no_grad():
                    completion_logps(self.ref_model, mb, temperature=self.objective.temperature)
        (logps.sum() * 0.0).backward()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full (unsharded) state dict on CPU; a collective under FSDP (every rank calls it)."""
        if not self.sharded:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # ------------------------------------------------------------------ the rest of the Learner protocol
    def state_dict(self) -> dict:
        """Model weights, AdamW state and counters as CPU copies (`Learner.state_dict`); under FSDP the full
        (unsharded) state, gathered with `torch.distributed.checkpoint` (a collective: every rank calls it)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            model, optim = get_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            model = _cpu_copy(self.model.state_dict())
            # keyed by parameter name, as under FSDP, so a state saved at one world size loads at any other
            optim = _cpu_copy(get_optimizer_state_dict(self.model, self.optimizer))
        return {
            "model": model,
            "optimizer": optim,
            "lr_scheduler": self.scheduler and self.scheduler.state_dict(),
            "skipped_zero_adv_microbatches": self.skipped_zero_adv_microbatches,
            "skipped_zero_adv_completions": self.skipped_zero_adv_completions,
            "skipped_nonfinite_steps": self.skipped_nonfinite_steps,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a `state_dict()`. Under FSDP every rank calls it and rank 0's full state is broadcast (the
        others may pass None).

        Raises:
            KeyError / RuntimeError: the state does not fit this model or optimizer.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.sharded:
            state = state or {"model": {}, "optimizer": {}, "skipped_zero_adv_microbatches": 0}
            # model, then optimizer, in two calls: `set_state_dict` with the empty dicts ranks > 0 pass skips the
            # model's broadcast there (it takes an empty model state for "optimizer only") while rank 0 sends it
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        else:
            self.model.load_state_dict(state["model"])
            if _keyed_by_name(state["optimizer"]):  # any world size's state (`state_dict`): full tensors by name
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=StateDictOptions())
            else:  # a checkpoint from before the names (torch's own optimizer state: parameters by position)
                self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_zero_adv_microbatches = int(state["skipped_zero_adv_microbatches"])
        self.skipped_zero_adv_completions = int(state.get("skipped_zero_adv_completions", 0))
        self.skipped_nonfinite_steps = int(state.get("skipped_nonfinite_steps", 0))
        if self.scheduler is not None and state.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])

    def named_parameters_for_push(self):
        """The policy's parameters as vLLM's `ModuleSource` (full tensors; all-gathered under FSDP)."""
        from vllm.distributed.weight_transfer import ModuleSource

        return ModuleSource(self.model)

    def adapter_for_push(self) -> AdapterPush:
        """Raises TypeError: a full fine-tune has no adapter to push (`PeftLearner` has)."""
        raise TypeError(
            "vllm_lora_sync pushes a LoRA adapter, and this policy has none. Fix: set use_peft: true, or "
            "vllm_lora_sync: false."
        )

    def save_pretrained(self, path) -> None:
        """Write the full policy as a Hugging Face folder (a collective under FSDP)."""
        from async_grpo.trainer.distributed import save_pretrained

        save_pretrained(self.model, self.full_state_dict(), path)

    def forget(self, batch: TrainBatch) -> None:
        """Nothing is cached per batch on one rank."""

    def close(self) -> None:
        """No other ranks to release."""

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the trainer ranks (itself with one rank)."""
        if self.world_size == 1:
            return value
        value = value.clone().to(self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
        return value

    def _all_reduce_grads(self) -> None:
        """Average the gradients over the ranks in one flat buffer, as DDP does (so each rank's loss uses TRL's
        per-process normalizers: num_items_in_batch / num_processes for dapo/cispo, a per-rank mean otherwise).
        Parameters without a gradient on this rank contribute zeros, so every rank joins the same collective."""
        if self.world_size == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


@dataclass
class _ChunkCounts:
    """What `GRPOLearner._micro_batches` counts while it packs one step's chunks.

    Attributes:
        tokens: loss tokens (completion mask sum), completions dropped by row skipping included.
        skipped_completions: completions dropped by row skipping (zero advantage).
    """

    tokens: float = 0.0
    skipped_completions: int = 0


_DUMMY = object()  # marks a placeholder micro-batch in `GRPOLearner.step` (see `_dummy_pass`)


def _keyed_by_name(optimizer_state: dict) -> bool:
    """True when an optimizer state dict names its parameters (torch.distributed.checkpoint's form) rather than
    numbering them (torch.optim's own)."""
    keys = list(optimizer_state.get("state", {}))
    params = [p for group in optimizer_state.get("param_groups", []) for p in group.get("params", [])]
    return any(isinstance(k, str) for k in keys + params)


def _cpu_copy(obj):
    """A copy of a (nested) state dict with every tensor cloned to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj
