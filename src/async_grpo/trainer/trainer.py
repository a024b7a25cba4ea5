"""The trainer: one optimizer step per `TrainBatch`, with the stale-rollout correction.

It is algorithm-blind where it can be: advantages arrive with the batch, and the loss, the
importance-sampling weights and the KL are plain functions from `async_grpo.algorithms`. Per step it
(1) packs the groups into padded tensors, (2) recomputes the policy's per-token logprobs of the
sampled tokens, (3) weights tokens by rho = exp(trainer-old logp - vLLM sampling logp) bounded per
`vllm_importance_sampling_mode`, (4) takes the clipped GRPO/DAPO loss (+ k3 KL when beta > 0) with
gradient accumulation and one AdamW step.

Old logprobs are always the trainer's own (one optimizer step per batch, so `old = logp.detach()`);
vLLM's sampling logprobs enter only the stale-policy IS weight and OPSM. Rows of replayed groups
(`RolloutGroup.replayed`) were sampled by a policy many versions back: with `replay_recompute_logps`
their sampling logprobs are replaced by the trainer's old logprobs, so their IS weight is exactly 1 and
OPSM sees no drift (they are trained as if on-policy); without it they keep vLLM's logprobs and the IS
correction truncates or masks them by their real staleness.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from async_grpo.algorithms import grpo_loss, high_entropy_mask, importance_sampling_weights
from async_grpo.trainer.liger import completion_hidden_states, fused_grpo_loss
from async_grpo.trainer.logprobs import chunked_token_logps, completion_logps_from_model
from async_grpo.transports.messages import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class LossSettings:
    """Loss options (TRL names). See `async_grpo.config.GRPOConfig` for meanings."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_length: int = 16
    mask_truncated_completions: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "token_truncate"
    vllm_importance_sampling_cap: float = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    top_entropy_quantile: float = 1.0
    replay_recompute_logps: bool = True
    temperature: float = 1.0
    use_liger_kernel: bool = False


@dataclass
class PackedBatch:
    """A batch as padded tensors. N = completions, P = longest prompt, T = longest completion.

    Attributes:
        input_ids: (N, P + T) left-padded prompt followed by right-padded completion.
        attention_mask: (N, P + T) 1 on real tokens.
        position_ids: (N, P + T) positions counted from each sequence's first real token.
        completion_ids: (N, T) sampled tokens.
        completion_mask: (N, T) 1 on tokens that enter the loss.
        sampling_logps: (N, T) vLLM sampling logprobs (0 on padding).
        advantages: (N,) per-completion advantages.
        replayed: (N,) bool, True on rows of replayed groups.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    sampling_logps: torch.Tensor
    advantages: torch.Tensor
    replayed: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def to(self, device: torch.device) -> PackedBatch:
        """The same tensors on `device` (no copy when already there)."""
        return PackedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def slice(self, start: int, end: int) -> PackedBatch:
        """Rows [start, end) as a new PackedBatch (views)."""
        return PackedBatch(*(getattr(self, f)[start:end] for f in self.__dataclass_fields__))


def pack_batch(batch: TrainBatch, pad_token_id: int, mask_truncated: bool = False) -> PackedBatch:
    """Flatten the groups of `batch` into padded tensors (see `PackedBatch` for shapes)."""
    rows = [
        (grp.prompt_ids, ids, lps, trunc, adv, grp.replayed)
        for grp in batch.groups
        for ids, lps, trunc, adv in zip(grp.completion_ids, grp.sampling_logprobs, grp.truncated, grp.advantages,
                                        strict=True)
    ]
    n = len(rows)
    p = max(len(r[0]) for r in rows)
    t = max(max(len(r[1]) for r in rows), 1)
    input_ids = torch.full((n, p + t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, p + t), dtype=torch.long)
    completion_mask = torch.zeros((n, t), dtype=torch.float32)
    sampling_logps = torch.zeros((n, t), dtype=torch.float32)
    for i, (prompt, comp, lps, trunc, _, _) in enumerate(rows):
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        input_ids[i, p : p + len(comp)] = torch.tensor(comp, dtype=torch.long)
        attention_mask[i, p - len(prompt) : p + len(comp)] = 1
        if not (mask_truncated and trunc):
            completion_mask[i, : len(comp)] = 1.0
        sampling_logps[i, : len(lps)] = torch.tensor(lps)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor([r[4] for r in rows], dtype=torch.float32)
    replayed = torch.tensor([r[5] for r in rows], dtype=torch.bool)
    return PackedBatch(input_ids, attention_mask, position_ids, input_ids[:, p:], completion_mask, sampling_logps,
                       advantages, replayed)


def completion_logps(model: torch.nn.Module, mb: PackedBatch, with_entropy: bool = False,
                     chunk_size: int | None = None, temperature: float = 1.0):
    """Per-token logprobs (N, T) of `mb.completion_ids` under `model`, and optionally entropies (N, T).

    `chunk_size=None` materializes only the last T+1 positions' logits (`logits_to_keep`); an int applies
    the LM head `chunk_size` positions at a time (see `trainer.logprobs`). Logits are divided by the sampling
    `temperature` (TRL), so the logprobs compare with vLLM's processed sampling logprobs.
    """
    return completion_logps_from_model(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.completion_ids,
                                       chunk_size=chunk_size, with_entropy=with_entropy, temperature=temperature)


class GRPOLearner:
    """Holds the policy, the optional frozen reference, and the optimizer; `step(batch)` trains once.

    Args:
        model: a transformers causal LM in float32 (train mode is set here).
        learning_rate, weight_decay, max_grad_norm: AdamW settings.
        micro_batch_size: completions per forward/backward (TRL per_device_train_batch_size).
        loss: loss settings.
        pad_token_id: id used for padding.
        skip_zero_advantage_batches: skip micro-batches whose advantages are all 0 (requires beta == 0).
        logprob_chunk_size: LM-head positions per block, or None for full logits (see `trainer.logprobs`).
    """

    def __init__(self, model: torch.nn.Module, *, learning_rate: float, weight_decay: float, max_grad_norm: float,
                 micro_batch_size: int, loss: LossSettings, pad_token_id: int, logprob_chunk_size: int | None = None,
                 skip_zero_advantage_batches: bool = False, fsdp: bool = False):
        self.model = model
        self.model.train()
        self.loss = loss
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.pad_token_id = pad_token_id
        self.logprob_chunk_size = logprob_chunk_size
        self.skip_zero_advantage_batches = skip_zero_advantage_batches
        self.skipped_zero_adv_microbatches = 0  # cumulative count, logged as a metric
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.device = next(model.parameters()).device
        self.ref_model = None
        if loss.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.sharded = fsdp and self.world_size > 1
        if self.sharded:  # after the reference copy, before the optimizer sees the (now sharded) parameters
            if logprob_chunk_size is not None or loss.use_liger_kernel or skip_zero_advantage_batches:
                raise ValueError("fsdp needs logprob_chunk_size=None, use_liger_kernel=false and "
                                 "skip_zero_advantage_batches=false. Fix: unset them.")
            from async_grpo.trainer.distributed import shard_model

            shard_model(self.model)
            if self.ref_model is not None:
                shard_model(self.ref_model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

    def _micro_batches(self, chunks: Iterable[TrainBatch]) -> Iterator[PackedBatch]:
        """Pack each chunk (a whole step batch, or one streamed chunk) and cut it into micro-batches of
        `micro_batch_size` completions, in order."""
        for chunk in chunks:
            if not chunk.groups:
                continue
            packed = pack_batch(chunk, self.pad_token_id, self.loss.mask_truncated_completions).to(self.device)
            for start in range(0, len(packed), self.micro_batch_size):
                yield packed.slice(start, min(start + self.micro_batch_size, len(packed)))

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
            out = [completion_logps(self.model, mb, chunk_size=self.logprob_chunk_size,
                                    temperature=self.loss.temperature)[0].detach() for mb in micro]
            for _ in range(placeholders):  # as many FSDP forwards as the busiest rank
                completion_logps(self.model, self._dummy_packed(), temperature=self.loss.temperature)
            return out
        finally:
            self.model.train(was_training)

    def step(self, batch: TrainBatch | Iterable[TrainBatch], *,
             old_logps: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step over every completion of `batch`; returns loss metrics (TRL names).

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
        cfg = self.loss
        streamed = not isinstance(batch, TrainBatch)
        if streamed and self.world_size > 1:
            raise ValueError("streaming_min_groups with several trainer ranks is not supported. Fix: unset it.")
        micro: Iterable[PackedBatch] = self._micro_batches([batch] if not streamed else batch)
        if streamed:  # normalizers unknown until the last chunk: unnormalized losses, gradients rescaled below
            num_items: torch.Tensor | float = 1.0
            accumulation = 1
        else:
            micro = list(micro)
            local_items = sum((mb.completion_mask.sum() for mb in micro), torch.tensor(0.0, device=self.device))
            num_items = self._all_reduce_sum(local_items)  # TRL: tokens of the accumulation window across ranks
            if old_logps is not None and len(old_logps) != len(micro):
                raise ValueError(f"old_logps has {len(old_logps)} micro-batches, the batch {len(micro)}. "
                                 "Fix: compute them with old_logps(batch) on the same batch.")
            if self.sharded:  # FSDP collectives run per forward/backward: every rank does as many
                micro += [_DUMMY] * (self._max_over_ranks(len(micro)) - len(micro))
            accumulation = len(micro)
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        step_loss = 0.0
        seen_items = 0.0
        seen_micro = 0
        self.optimizer.zero_grad(set_to_none=True)
        for index, mb in enumerate(micro):
            if self.sharded:  # reduce-scatter the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(index == accumulation - 1)
            if mb is _DUMMY:
                self._dummy_pass()
                continue
            seen_micro += 1
            tokens = float(mb.completion_mask.sum())
            seen_items += tokens
            if self.skip_zero_advantage_batches and not bool((mb.advantages != 0).any()):
                # no policy gradient here (and beta == 0, checked by the config): skip the forward/backward;
                # the loss normalizer still counts these tokens, so the step equals the unskipped one
                self.skipped_zero_adv_microbatches += 1
                continue
            hidden = None
            if cfg.use_liger_kernel:  # the fused loss applies the LM head itself; logps here only feed IS/OPSM/metrics
                t = mb.completion_ids.size(1)
                hidden = completion_hidden_states(self.model, mb.input_ids, mb.attention_mask, mb.position_ids, t)
                with torch.no_grad():
                    logps, entropy = chunked_token_logps(hidden.detach(), self.model.get_output_embeddings(),
                                                         mb.completion_ids, self.logprob_chunk_size or t,
                                                         with_entropy=True, temperature=cfg.temperature)
            else:
                logps, entropy = completion_logps(self.model, mb, with_entropy=True,
                                                  chunk_size=self.logprob_chunk_size, temperature=cfg.temperature)
            # one optimizer step per batch: the behaviour policy is the current one; with reuse, the cached pi_old
            old = logps.detach() if old_logps is None else old_logps[index]
            sampling_logps = mb.sampling_logps
            if cfg.replay_recompute_logps and bool(mb.replayed.any()):  # replayed rows count as on-policy
                sampling_logps = torch.where(mb.replayed.unsqueeze(1), old, sampling_logps)
            entropy_mask = None
            if cfg.top_entropy_quantile < 1.0:  # quantile over this micro-batch's valid tokens (TRL, one rank)
                entropy_mask = high_entropy_mask(entropy, mb.completion_mask, cfg.top_entropy_quantile)
            is_weights = None
            if cfg.vllm_importance_sampling_correction:
                is_weights, is_metrics = importance_sampling_weights(
                    old, sampling_logps, mb.completion_mask, cfg.vllm_importance_sampling_mode,
                    cfg.vllm_importance_sampling_cap, cfg.vllm_importance_sampling_clip_min,
                )
                _accumulate(sums, weights, is_metrics, tokens)
            ref_logps = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logps, _ = completion_logps(self.ref_model, mb, chunk_size=self.logprob_chunk_size,
                                                    temperature=cfg.temperature)
            loss_kwargs = dict(
                loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta,
                importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta, ref_logps=ref_logps,
                use_bias_correction_kl=cfg.use_bias_correction_kl, is_weights=is_weights,
                off_policy_threshold=cfg.off_policy_mask_threshold, sampling_logps=sampling_logps,
                entropy_mask=entropy_mask,
                sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                max_completion_length=cfg.max_completion_length, num_items_in_batch=num_items,
                gradient_accumulation_steps=accumulation, num_processes=self.world_size,
            )  # fmt: skip
            if hidden is not None:
                out = fused_grpo_loss(hidden, self.model.get_output_embeddings(), mb.completion_ids,
                                      mb.completion_mask, mb.advantages, None if old_logps is None else old,
                                      current_logps=logps, temperature=cfg.temperature, **loss_kwargs)
            else:
                out = grpo_loss(logps, old, mb.advantages, mb.completion_mask, **loss_kwargs)
            out.loss.backward()
            step_loss += out.loss.item()  # micro-batch losses are pre-scaled: their sum is the step loss
            _accumulate(sums, weights, out.metrics, tokens)
            mask = mb.completion_mask
            _accumulate(sums, weights, {"entropy": float((entropy * mask).sum() / mask.sum().clamp(min=1))}, tokens)
            if entropy_mask is not None:
                kept = float(entropy_mask.sum() / mask.sum().clamp(min=1))
                _accumulate(sums, weights, {"entropy_mask/kept_fraction": kept}, tokens)
        if streamed:
            num_items = seen_items
            scale = 1.0 / max(seen_items, 1.0) if cfg.loss_type in ("dapo", "cispo") else 1.0 / max(seen_micro, 1)
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
            step_loss *= scale
        if not self.sharded:  # FSDP averaged the gradients in its reduce-scatter
            self._all_reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        metrics = {k: sums[k] / max(weights[k], 1e-9) for k in sums}
        metrics["loss"] = step_loss
        metrics["skipped_zero_adv_microbatches"] = float(self.skipped_zero_adv_microbatches)
        metrics["grad_norm"] = float(grad_norm)
        metrics["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        metrics["num_tokens"] = float(num_items)
        return metrics

    # ------------------------------------------------------------------ several ranks (data parallel)
    def _max_over_ranks(self, n: int) -> int:
        value = torch.tensor(float(n), device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    def _dummy_packed(self) -> PackedBatch:
        """A 2-token placeholder row whose completion token has loss weight 0."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long, device=self.device)
        return PackedBatch(ids, torch.ones_like(ids), torch.arange(2, device=self.device).unsqueeze(0), ids[:, 1:],
                           torch.zeros((1, 1), device=self.device), torch.zeros((1, 1), device=self.device),
                           torch.zeros(1, device=self.device), torch.zeros(1, dtype=torch.bool, device=self.device))

    def _dummy_pass(self) -> None:
        """For a rank with fewer micro-batches than the busiest one (FSDP): forward (policy and reference) and
        backward of a placeholder row with weight 0, i.e. zero gradients through the same all-gathers and
        reduce-scatters as a real micro-batch."""
        mb = self._dummy_packed()
        logps, _ = completion_logps(self.model, mb, temperature=self.loss.temperature)
        if self.ref_model is not None:
            with torch.no_grad():
                completion_logps(self.ref_model, mb, temperature=self.loss.temperature)
        (logps.sum() * 0.0).backward()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full (unsharded) state dict on CPU; a collective under FSDP (every rank calls it)."""
        if not self.sharded:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

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


_DUMMY = object()  # marks a placeholder micro-batch in `GRPOLearner.step` (see `_dummy_pass`)


def _accumulate(sums: dict[str, float], weights: dict[str, float], metrics: dict[str, float], w: float) -> None:
    """Token-weighted running means (min/max keys keep the extreme instead)."""
    for k, v in metrics.items():
        v = float(v)
        if k.endswith("/min"):
            sums[k] = min(sums.get(k, v), v)
            weights[k] = 1.0
        elif k.endswith("/max"):
            sums[k] = max(sums.get(k, v), v)
            weights[k] = 1.0
        else:
            sums[k] = sums.get(k, 0.0) + v * w
            weights[k] = weights.get(k, 0.0) + w
