"""One packed microbatch through a model: the forward every entry point uses (the main job's
CPU and GPU steps, the held-out evaluator, the NeMo and Megatron-Bridge forward steps).

What the model reads comes from the cache slot's :class:`~megatron_fastpath.packed_seq.cache.PackedBatch`:
the static ``PackedSeqParams``, the position ids and Megatron's MoE ``padding_mask`` (True on
the padding tail, so padding tokens take no expert capacity and stay out of the aux loss).
Only the token ids and labels come from the caller, already on the device (None on the
pipeline stages that do not read them).

Shape key: T = tokens of a packed microbatch (its batch dimension is 1).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["forward", "masked_loss_sum"]


def forward(model, pb, tokens_1T: Optional[torch.Tensor], labels_1T: Optional[torch.Tensor] = None):
    """``model`` (Megatron's ``GPTModel``, or a wrapper passing keyword arguments through to
    it: DDP, ``Float16Module``) on packed batch ``pb``: per-token losses [1, T] on the last
    pipeline stage when ``labels_1T`` is given (the logits [1, T, V / TP] when it is None),
    hidden states on the other stages."""
    return model(
        tokens_1T,
        pb.position_ids_1T,
        None,  # attention mask: the packed params carry the boundaries
        labels=labels_1T,
        packed_seq_params=pb.packed_seq_params,
        padding_mask=pb.padding_mask_1T,  # MoE routing skips padding (Megatron: True = padding)
    )


def masked_loss_sum(per_token_1T: torch.Tensor, loss_mask_1T: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses over a loss mask on the same device (response tokens)."""
    return (per_token_1T.float() * loss_mask_1T).sum()
