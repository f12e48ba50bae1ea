"""The fake linears' compute: tensor-parallel communication with TE's semantics (written with
Megatron-Core's own ``tensor_parallel.mappings`` autograd functions, whose forward / backward
pairs are the ones TE's ``_Linear`` / ``_LayerNormLinear`` use), the GEMM (high precision, or FP8
quantise-dequantise under an FP8 autocast) and the weight-gradient accumulation into
``main_grad`` (``fuse_wgrad_accumulation``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quantization import FP8GlobalStateManager, quantize
from ..utils import assert_dim_for_fp8_exec


def _mappings():
    # imported when first used: Megatron imports transformer_engine while it is being imported
    from megatron.core.tensor_parallel import mappings

    return mappings


def column_input(module, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel GEMM's input: all-gathered along dim 0 under sequence parallelism
    (backward: reduce-scatter; linear.py:211-216 gather_along_first_dim, 745-750
    reduce_scatter_along_first_dim of dgrad), else used as is with its gradient all-reduced over
    the TP group (linear.py:752-756 allreduce of dgrad)."""
    if module.tp_size <= 1 or module.parallel_mode != "column":
        return x
    if module.sequence_parallel:
        return _mappings().gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=module.tp_group)
    return _mappings().copy_to_tensor_model_parallel_region(x, group=module.tp_group)


def row_output(module, out: torch.Tensor) -> torch.Tensor:
    """A row-parallel GEMM's output: reduce-scattered along dim 0 under sequence parallelism,
    else all-reduced (linear.py:355-364 reduce_scatter_along_first_dim / allreduce)."""
    if module.tp_size <= 1 or module.parallel_mode != "row":
        return out
    if module.sequence_parallel:
        return _mappings().reduce_scatter_to_sequence_parallel_region(out, group=module.tp_group)
    return _mappings().reduce_from_tensor_model_parallel_region(out, group=module.tp_group)


class _WgradIntoMainGrad(torch.autograd.Function):
    """``fuse_wgrad_accumulation``: the weight gradient is added to ``weight.main_grad``;
    with Megatron's DDP (``grad_added_to_main_grad`` present) TE marks it and returns a dummy
    gradient, else none (linear.py:944-966)."""

    @staticmethod
    def forward(ctx, weight):
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        assert hasattr(weight, "main_grad"), (
            "fuse_wgrad_accumulation needs weight.main_grad (Megatron's DDP buffer)")
        weight.main_grad.add_(grad.to(weight.main_grad.dtype))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            return torch.zeros_like(weight)
        return None


class _FP8Gemm(torch.autograd.Function):
    """y = Q(x) Q(w)^T + b in float32, cast to x's dtype; backward dgrad = Q_b(g) Q(w),
    wgrad = Q_b(g)^T Q(x) (Q: the recipe's quantise-dequantise, Q_b with the backward format).
    The first FP8 module of the autocast updates the backward delayed-scaling state at the end
    of its backward, except while a graph is captured (linear.py:969-971,
    ``reduce_and_update_bwd_fp8_tensors``; Megatron's replay updates after each layer instead)."""

    @staticmethod
    def forward(ctx, x, weight, bias, meta, update_bwd):
        xq = quantize(x, meta, True, 0, "input")
        wq = quantize(weight, meta, True, 1, "weight")
        out = xq @ wq.t()
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(xq, wq)
        ctx.meta, ctx.update_bwd, ctx.has_bias = meta, update_bwd, bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xq, wq = ctx.saved_tensors
        gq = quantize(g, ctx.meta, False, 0, "grad")
        dx = (gq @ wq).to(ctx.x_dtype)
        dw = (gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])).to(ctx.w_dtype)
        db = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        from ..graph import is_graph_capturing

        if ctx.update_bwd and not is_graph_capturing():  # linear.py:969, layernorm_linear.py:1017
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return dx, dw, db, None, None


def gemm(module, x: torch.Tensor, weight: torch.Tensor, bias):
    """The module's GEMM on the (gathered) input."""
    if module.fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled():
        weight = _WgradIntoMainGrad.apply(weight)
    if module.fp8:
        assert_dim_for_fp8_exec(x, weight)  # linear.py:177, layernorm_linear.py:161
        update_bwd = FP8GlobalStateManager.is_first_fp8_module()
        return _FP8Gemm.apply(x, weight, bias, module.fp8_meta, update_bwd)
    # one 2-D GEMM over the flattened leading dims, as TE runs it (layernorm_linear.py:158
    # inp.view((-1, in_features)); linear.py hands general_gemm the input as is, one GEMM): not
    # F.linear on the N-D input, whose aten::matmul picks mm or a batched bmm by the input's
    # strides when the weight is frozen (LoRA), rounding differently
    out = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])
