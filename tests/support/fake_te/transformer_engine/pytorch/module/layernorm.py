"""Fake ``transformer_engine.pytorch.LayerNorm`` / ``RMSNorm`` (TE v2.10
``pytorch/module/layernorm.py`` / ``rmsnorm.py`` over ``ops/basic/layer_norm.py`` /
``rmsnorm.py``): the modules' keywords (``normalized_shape`` or the deprecated
``hidden_size``, ``eps``, ``sequence_parallel``, deprecated ``params_dtype``,
``zero_centered_gamma``, and the op's keyword-only ``device``, ``dtype``, ``sm_margin``; any
other raises TypeError as the op's signature does), parameters ``weight`` (+ ``bias``), computed
in the weight's dtype through float32."""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Union

import torch

from ._norm import normalize


class _Norm(torch.nn.Module):
    _kind = "LayerNorm"

    def __init__(self, normalized_shape: Union[Iterable[int], int, None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None, **kwargs):
        # module/layernorm.py:59-104 / module/rmsnorm.py:63-108 (same checks)
        if normalized_shape is None:
            if hidden_size is None:
                raise RuntimeError(
                    "Neither `normalized_shape` nor `hidden_size` (deprecated) args are provided")
            warnings.warn("`hidden_size` arg has been renamed to `normalized_shape` "
                          "for compatibility with `torch.nn.LayerNorm`.", DeprecationWarning,
                          stacklevel=2)
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise RuntimeError("Both `normalized_shape` and `hidden_size` (deprecated) args are provided")
        if params_dtype is not None:
            if "dtype" in kwargs:
                raise RuntimeError("Both `dtype` and `params_dtype` (deprecated) kwargs are provided")
            kwargs["dtype"] = params_dtype
        self.sequence_parallel = sequence_parallel
        self._op_init(normalized_shape, eps=eps, zero_centered_gamma=zero_centered_gamma, **kwargs)

    def _op_init(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin=0) -> None:
        # ops/basic/layer_norm.py:70-78 (keyword-only; rmsnorm.py the same)
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        device = torch.device("cuda" if device is None else device) if not isinstance(device, int) \
            else torch.device("cuda", device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if self._kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        else:
            self.bias = None
        self.reset_parameters()

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        # ops/basic/layer_norm.py:140-170; module/layernorm.py:132-135 (sequence_parallel attribute)
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()
        if self.sequence_parallel is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            if self.bias is not None:
                self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        wd = tuple(self.weight.shape)
        idims = tuple(inp.shape)
        # ops/basic/layer_norm.py:189-194
        if len(idims) < len(wd) or idims[-len(wd):] != wd:
            raise ValueError(f"Input tensor (shape={idims}) "
                             f"and weight tensor (shape={wd}) are not compatible")
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else self.weight.dtype
        return normalize(inp.to(dtype), self.weight, self.bias, self.eps, self._kind,
                         self.zero_centered_gamma, dtype)


class LayerNorm(_Norm):
    _kind = "LayerNorm"


class RMSNorm(_Norm):
    _kind = "RMSNorm"
