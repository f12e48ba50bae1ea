"""Fake ``transformer_engine.pytorch.attention``: ``DotProductAttention`` exists for Megatron's
``TEDotProductAttention`` subclass to be defined; building one raises (attention is stood in by
``tests/support/gpu_standins.TEDotProductAttentionStandIn`` through the package's seam)."""

import torch


class DotProductAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "fake transformer_engine: DotProductAttention is not stood in here; use the package's "
            "'te' attention backend under tests.support.graph_safe_standins.gpu_standins() "
            "(TEDotProductAttentionStandIn) or another backend")
