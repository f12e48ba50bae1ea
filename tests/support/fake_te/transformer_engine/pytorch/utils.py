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


# The fake's GPU: a Hopper (sm90), as the rest of the fake answers (quantization.py
# get_default_fp8_recipe; the fake CUDA graph's device_capability_standin((9, 0))), with a recent
# cuDNN. TE reads both for its attention backend selection (attention/dot_product_attention/
# utils.py:351-352, get_attention_backend).
FAKE_DEVICE_COMPUTE_CAPABILITY = (9, 0)
FAKE_CUDNN_VERSION = (9, 15, 0)


def get_device_compute_capability():
    """pytorch/utils.py:67-69: the current GPU's (major, minor) -- the fake's sm90."""
    return FAKE_DEVICE_COMPUTE_CAPABILITY


def get_cudnn_version():
    """pytorch/utils.py:500-508: the runtime cuDNN (major, minor, patch) -- 9.15.0 here (on sm90
    every cuDNN >= 9.7 other than 9.10.0 gives TE 2.10's attention backend selection the same
    answers for the inputs the fake DotProductAttention serves)."""
    return FAKE_CUDNN_VERSION


def cast_if_needed(tensor, dtype):
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


def make_weak_ref(x):
    """utils.py:759-790: a CUDA tensor becomes a new leaf tensor over the same memory, without
    autograd history (TE: ``torch.as_tensor`` of a ``_WeakRefTensor``; a CPU tensor is returned
    as is). Under the CUDA-as-CPU mode the "CUDA" tensors are CPU tensors, so the CUDA branch is
    modelled for every tensor: ``x.detach()`` (same storage, a leaf; unlike TE it keeps the
    memory alive -- no effect on values)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, tuple):
        return tuple(make_weak_ref(i) for i in x)
    if isinstance(x, list):
        return [make_weak_ref(i) for i in x]
    if isinstance(x, dict):
        return {k: make_weak_ref(v) for k, v in x.items()}
    if isinstance(x, (int, float, bool)):
        return x
    if x is None:
        return None
    raise TypeError(f"Invalid type {type(x)} to make weak ref")
