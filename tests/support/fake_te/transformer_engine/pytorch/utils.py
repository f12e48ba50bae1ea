"""Fake ``transformer_engine.pytorch.utils`` (TE v2.10 ``pytorch/utils.py``)."""

from __future__ import annotations

import math

import torch


def ensure_divisibility(numerator: int, denominator: int) -> None:
    # pytorch/utils.py:148-150
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def divide(numerator: int, denominator: int) -> int:
    # pytorch/utils.py:153-157
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """pytorch/utils.py:439-447: an FP8 GEMM operand's leading dims (flattened) must be
    divisible by 8 and its last dim by 16 (TE's message)."""
    for tensor in tensors:
        assert math.prod(tensor.shape[:-1]) % 8 == 0 and tensor.shape[-1] % 16 == 0, (
            "FP8 execution requires the product of all dimensions except the last to be divisible"
            " by 8 and the last dimension to be divisible by 16, but got tensor with"
            f" dims={list(tensor.size())}"
        )


def cast_if_needed(tensor, dtype):
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)
