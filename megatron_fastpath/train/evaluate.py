"""Held-out evaluation of the main job (any data provider with held-out bins).

Shape key: T = tokens of a packed microbatch, V = vocabulary (V / TP per tensor-parallel rank).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

__all__ = ["Evaluator", "EvalResult", "perplexity"]


def perplexity(loss: float) -> float:
    """exp(loss), capped below a double's overflow (exp overflows above ~709)."""
    return math.exp(min(loss, 700.0))


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Token-weighted held-out loss, its perplexity, and the share of loss tokens whose
    greedy (argmax) prediction is the label (None when the model gives no logits)."""

    loss: float
    token_accuracy: Optional[float] = None

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)


def vocab_parallel_argmax(logits_1TV: torch.Tensor) -> torch.Tensor:
    """Global argmax over a vocabulary split across the tensor-parallel group (each rank holds
    V / TP consecutive ids); ties go to the lowest id, as ``torch.argmax``."""
    from megatron.core import parallel_state as ps

    best_1T, idx_1T = logits_1TV.float().max(-1)
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return idx_1T
    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    idx_1T = idx_1T + ps.get_tensor_model_parallel_rank() * logits_1TV.shape[-1]
    bests, idxs = [torch.empty_like(best_1T) for _ in range(tp)], [torch.empty_like(idx_1T) for _ in range(tp)]
    torch.distributed.all_gather(bests, best_1T, group=group)
    torch.distributed.all_gather(idxs, idx_1T, group=group)
    winner_1T = torch.stack(bests).argmax(0, keepdim=True)  # first rank holding the max
    return torch.stack(idxs).gather(0, winner_1T)[0]


class Evaluator:
    """Held-out loss, perplexity and token accuracy: sums over all ranks' bins of masked
    per-token losses and of correct greedy predictions, over the loss tokens (token-weighted,
    the same packing and cache as training; no gradients). The loss is Megatron's own
    ``compute_language_model_loss`` of the logits, as in training. Reads the result to the host:
    run between steps, never inside one."""

    def __init__(self, model, cache, bins: tuple, device):
        from megatron_fastpath.packed_seq.staging import PinnedStaging

        self.model, self.cache, self.bins, self.device = model, cache, bins, device
        self.staging = PinnedStaging(cache.config.max_tokens, device)

    @torch.no_grad()
    def __call__(self) -> EvalResult:
        from megatron.core import parallel_state as ps

        from megatron_fastpath.packed_seq.runtime import cp_local, forward, masked_loss_sum

        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, tokens
        logits = hasattr(self.model, "compute_language_model_loss")
        try:
            for mb in self.bins:
                with self.cache.batch(mb.lengths) as pb:
                    tokens_1T, labels_1T, mask_1T = (
                        cp_local(pb, x) for x in self.staging.to_device(mb))
                    if logits:
                        logits_1TV = forward(self.model, pb, tokens_1T)
                        per_tok_1T = self.model.compute_language_model_loss(
                            labels_1T, logits_1TV.transpose(0, 1).contiguous())
                        hit_1T = vocab_parallel_argmax(logits_1TV) == labels_1T
                        sums[1] += (hit_1T * mask_1T.bool()).sum().double()
                    else:
                        per_tok_1T = forward(self.model, pb, tokens_1T, labels_1T)
                    sums[0] += masked_loss_sum(per_tok_1T, mask_1T).double()
                # each CP rank holds part of the microbatch; the sum over DP x CP counts it once
                sums[2] += mb.num_loss_tokens / self.cache.config.context_parallel_size
        finally:
            self.model.train(was_training)
        if (ps.model_parallel_is_initialized()
                and ps.get_data_parallel_world_size(with_context_parallel=True) > 1):
            torch.distributed.all_reduce(
                sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        total, correct, tokens = sums.tolist()
        tokens = max(tokens, 1.0)
        return EvalResult(total / tokens, correct / tokens if logits else None)
