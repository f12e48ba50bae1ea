"""Fake ``transformer_engine.pytorch.ops`` (TE's operation-based API): Megatron-Core 0.16.1
names ``te.pytorch.ops.Sequential`` / ``FusibleOperation`` in annotations of ``TEFusedMLP``
(evaluated when the class is defined) and builds ops only for ``use_te_op_fuser`` /
``use_te_activation_func``; the fake's ops raise when built."""


class FusibleOperation:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"fake transformer_engine: te.pytorch.ops.{type(self).__name__} is not stood in "
            "(use_te_op_fuser / use_te_activation_func)")


def _op(name):
    return type(name, (FusibleOperation,), {})


Sequential = _op("Sequential")
BasicLinear = _op("BasicLinear")
Bias = _op("Bias")
LayerNorm = _op("LayerNorm")
RMSNorm = _op("RMSNorm")
AllReduce = _op("AllReduce")
ReduceScatter = _op("ReduceScatter")
AllGather = _op("AllGather")
GELU = _op("GELU")
GEGLU = _op("GEGLU")
SiLU = _op("SiLU")
SwiGLU = _op("SwiGLU")
ReLU = _op("ReLU")
ReGLU = _op("ReGLU")
