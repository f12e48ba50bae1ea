"""Megatron ``SelfAttention`` whose RoPE comes from the packed-sequence cache."""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention

__all__ = ["CachedRopeSelfAttention"]


class CachedRopeSelfAttention(SelfAttention):
    """``SelfAttention`` that leaves RoPE to its core attention (:class:`PackedCoreAttention`).

    Megatron 0.16.1 applies RoPE per layer from ``rotary_pos_emb``; for THD packed batches its
    fused path (``apply_rope_fusion=True``, Megatron-LM's default) runs TE's kernel on device
    ``cu_seqlens``, while its unfused path walks ``cu_seqlens`` with ``.tolist()`` and a tensor ``__bool__`` (2 host syncs
    per call, 4 per layer for q and k, measured by benchmarks/packed_seq.py; with padded
    cu_seqlens it takes an offset branch with one more ``.item()`` per sequence). Here the per-token cos/sin are built once per batch by the cache and
    applied inside core attention, so any ``rotary_pos_emb`` the model computed is not used.
    Everything else (QKV projection, GQA split, output projection, TP) is Megatron's own code.
    """

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs)
