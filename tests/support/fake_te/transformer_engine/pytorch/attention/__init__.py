"""Fake ``transformer_engine.pytorch.attention`` (TE v2.10): ``DotProductAttention``, the base
of Megatron-Core 0.16.1's ``TEDotProductAttention`` (see ``dot_product_attention/``)."""

from .dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
