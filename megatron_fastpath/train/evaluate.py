"""Held-out evaluation of the main job (any data provider with held-out bins)."""

from __future__ import annotations

import torch

__all__ = ["Evaluator"]


class Evaluator:
    """Held-out loss: sum of masked per-token losses / loss tokens over all ranks' bins
    (token-weighted, the same packing and cache as training; no gradients). Reads the result to
    the host: run between steps, never inside one."""

    def __init__(self, model, cache, bins: tuple, device):
        self.model, self.cache, self.bins, self.device = model, cache, bins, device

    @torch.no_grad()
    def __call__(self) -> float:
        from megatron.core import parallel_state as ps

        from megatron_fastpath.packed_seq.runtime import forward, masked_loss_sum

        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            for mb in self.bins:
                with self.cache.batch(mb.lengths) as pb:
                    per_tok = forward(self.model, mb, pb, self.device)
                    sums[0] += masked_loss_sum(per_tok, mb, self.device).double()
                sums[1] += mb.num_loss_tokens
        finally:
            self.model.train(was_training)
        if ps.model_parallel_is_initialized() and ps.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(sums, group=ps.get_data_parallel_group())
        total, tokens = sums.tolist()
        return total / max(tokens, 1.0)
