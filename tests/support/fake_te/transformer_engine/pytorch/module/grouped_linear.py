"""Fake ``transformer_engine.pytorch.GroupedLinear``: the class exists for Megatron's
``TEGroupedLinear`` subclass to be defined; building one raises (MoE grouped GEMM on TE is not
stood in)."""

import torch


class GroupedLinear(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("fake transformer_engine: GroupedLinear is not stood in")
