"""Rotary position embedding applied from cached per-token cos/sin (no per-layer split/cat,
no cu_seqlens walk, no host reads)."""

from __future__ import annotations

import torch

__all__ = ["apply_rope_cached", "rotate_half"]


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Megatron's ``_rotate_half``: (x1, x2) -> (-x2, x1) on halves, or on (even, odd) pairs."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope_cached(
    x_THd: torch.Tensor, cos_T1D: torch.Tensor, sin_T1D: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first D channels of every head of every packed token.

    x_THd: [T, heads, d] (d >= D); cos_T1D / sin_T1D: [T, 1, D] in x's dtype, from
    :meth:`PackedSeqCache.rope_cos_sin`. Channels beyond D (``rotary_percent < 1``) pass through.
    Numerically identical to Megatron's ``_apply_rotary_pos_emb_bshd`` for each sequence.
    """
    rot_dim = cos_T1D.shape[-1]
    if rot_dim == x_THd.shape[-1]:
        return x_THd * cos_T1D + rotate_half(x_THd, interleaved) * sin_T1D
    x_rot, x_pass = x_THd[..., :rot_dim], x_THd[..., rot_dim:]
    x_rot = x_rot * cos_T1D + rotate_half(x_rot, interleaved) * sin_T1D
    return torch.cat((x_rot, x_pass), dim=-1)
