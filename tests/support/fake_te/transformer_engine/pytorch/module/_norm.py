"""LayerNorm / RMSNorm math of the fake modules: computed in float32 (TE's kernels accumulate
in float32), ``zero_centered_gamma``: the scale is ``1 + gamma`` (layernorm_linear.py docstring,
ops/basic/layer_norm.py / rmsnorm.py ``zero_centered_gamma``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def normalize(x: torch.Tensor, weight: torch.Tensor, bias, eps: float, normalization: str,
              zero_centered_gamma: bool, out_dtype: torch.dtype) -> torch.Tensor:
    xf = x.float()
    w = weight.float()
    if zero_centered_gamma:
        w = w + 1
    if normalization == "LayerNorm":
        y = F.layer_norm(xf, (xf.shape[-1],), w, None if bias is None else bias.float(), eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    return y.to(out_dtype)
