"""One packed microbatch through a model: the forward every caller in the package uses (the main
job's CPU and GPU steps, the held-out evaluator).

Shape key: T = tokens of a packed microbatch (its batch dimension is 1).
"""

from __future__ import annotations

__all__ = ["forward", "masked_loss_sum"]


def forward(model, mb, pb, device, with_labels: bool = True):
    """Model output for one packed microbatch: per-token losses [1, T] on the last pipeline
    stage (``with_labels=False``: the logits [1, T, V / TP] instead), hidden states on the
    others."""
    return model(
        mb.tokens_1T.to(device, non_blocking=True),
        pb.position_ids_1T,
        None,
        labels=mb.labels_1T.to(device, non_blocking=True) if with_labels else None,
        packed_seq_params=pb.packed_seq_params,
        padding_mask=pb.padding_mask_1T,  # MoE routing skips padding (Megatron: True = padding)
    )


def masked_loss_sum(per_token_1T, mb, device):
    """Sum of per-token losses over the microbatch's loss mask (response tokens)."""
    return (per_token_1T.float() * mb.loss_mask_1T.to(device, non_blocking=True)).sum()
