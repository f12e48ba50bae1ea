"""Fake ``transformer_engine.pytorch.attention.dot_product_attention`` (TE v2.10)."""

from .dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
