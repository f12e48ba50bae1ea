"""Attention over the packed-sequence cache: core attention backends and RoPE."""

from megatron_fastpath.attention.backend import BACKENDS, resolve_backend
from megatron_fastpath.attention.core_attention import PackedCoreAttention
from megatron_fastpath.attention.rope import apply_rope_cached

__all__ = ["BACKENDS", "PackedCoreAttention", "apply_rope_cached", "resolve_backend"]
