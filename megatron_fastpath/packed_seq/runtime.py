"""One packed microbatch through a model: the forward every entry point uses (the main job's
CPU and GPU steps, the held-out evaluator, the NeMo and Megatron-Bridge forward steps).

What the model reads comes from the cache slot's :class:`~megatron_fastpath.packed_seq.params.PackedBatch`:
the static ``PackedSeqParams``, the position ids and Megatron's MoE ``padding_mask`` (True on
the padding tail, so padding tokens take no expert capacity and stay out of the aux loss).
Only the token ids and labels come from the caller, already on the device (None on the
pipeline stages that do not read them).

Shape key: T = tokens of a packed microbatch (its batch dimension is 1).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["cp_local", "forward", "masked_loss_sum"]


def cp_local(pb, x_1T: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This context-parallel rank's tokens of a packed [1, T] tensor (token ids, labels, loss
    mask): [1, T / CP] gathered through the cache's ``cp_token_index_T`` on the device (no host
    read), with 0 for a sequence's 2 x CP padding and the tail (no label, no loss). ``x_1T``
    itself without CP (and None stays None: the pipeline stages that do not read it)."""
    index_T = pb.packed_seq_params.cp_token_index_T
    if index_T is None or x_1T is None:
        return x_1T
    x_ext = torch.cat([x_1T, x_1T.new_zeros((1, 1))], dim=1)  # the pad row at index T
    return x_ext.index_select(1, index_T)


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
