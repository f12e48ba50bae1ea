"""Fake ``transformer_engine.pytorch.tensor``: ``QuantizedTensor`` for Megatron's isinstance
checks (``fp8_utils.py``: ``FP8_TENSOR_CLASS``). The fake never makes one: its FP8 linears
quantise and dequantise inside the GEMM, parameters stay high precision."""


class QuantizedTensor:  # never instantiated by the fake
    pass
