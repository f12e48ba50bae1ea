"""Losses computed without the full logits: :func:`linear_cross_entropy` (the output layer and
Megatron's vocab-parallel cross-entropy fused, chunked over tokens)."""

from megatron_fastpath.loss.linear_cross_entropy import DEFAULT_CHUNK_BYTES, chunk_rows, linear_cross_entropy

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_rows", "linear_cross_entropy"]
