"""Fake ``transformer_engine.pytorch.GroupedLinear`` (TE v2.10 ``pytorch/module/grouped_linear.py``):
``num_gemms`` independent linears ``y_i = x_i W_i^T + b_i`` over consecutive row groups of one
input, the group sizes a host list ``m_splits``.

As TE: the constructor's keywords (grouped_linear.py:559-581; any other: TypeError) and checks
(userbuffers, bias with TP > 1, parallel_mode, tp_size dividing the features), parameters
``weight{i}`` [out, in] / ``bias{i}`` (an empty plain tensor when ``bias=False``) initialised by
the base module's ``reset_parameters`` (inside the RNG tracker's fork when one is given), TE's
tensor-parallel attributes, no tensor-parallel communication (grouped_linear.py:552-556: MoE
dispatch / combine do it); ``forward`` asserts what TE asserts (grouped_linear.py:750-753, the
input width 131-135, the split of the input: ``torch.split`` without FP8, ``split_quantize``'s
checks with FP8) and computes each group in float32, cast to the activation dtype (cuBLAS
accumulates in float32). Backward as ``_GroupedLinear.backward`` (grouped_linear.py:288-496):
dgrad, wgrad (into ``main_grad`` with ``fuse_wgrad_accumulation``: accumulated, overwritten on
the first microbatch or with ``overwrite_main_grad``; the dummy gradient for Megatron's DDP),
bias gradients.

FP8 (inside an FP8 autocast): one fp8 meta per module of ``num_gemms * 3`` forward /
``num_gemms * 2`` backward tensors (base.py:731), GEMM ``i`` casting its input with index
``3 i``, its weight ``3 i + 1`` and its output gradient ``2 i`` (grouped_linear.py:604-608,
651, 768-785, 894-898); the same quantise-dequantise as the fake ``Linear``
(``quantization.quantize``) for every recipe. The shape requirements are TE's C++ checks, raised
as RuntimeError with TE's messages: MXFP8 casts (every split and the weight, both dims % 32,
csrc/quantizer.cpp:1114-1116) and cuBLASLt's FP8 GEMM operands as on Hopper
(common/gemm/cublaslt_gemm.cu:102-303; the fake answers as on Hopper, ``quantization.
get_default_fp8_recipe``): per-tensor scaling needs the reduced dimension k % 16 of every
non-empty GEMM -- in features (forward), out features (dgrad), the group's rows (wgrad, so an
unaligned split fails in the backward); block scaling also the outer dims % 8. TE's
GroupedLinear has no Python-side dims assert (no ``assert_dim_for_fp8_exec``, unlike Linear).

Not modelled: delay_wgrad_compute (raises), FP8 calibration (raises), CPU offload, FP8 weight
caching across microbatches (``is_first_microbatch`` only decides main_grad accumulation here:
the weights are re-cast every forward), FP8 primary weights, quantized inputs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Callable, List, Optional, Union

import torch

from ...common.recipe import Float8BlockScaling, MXFP8BlockScaling
from ..constants import GemmParallelModes
from ..distributed import set_tensor_model_parallel_attributes
from ..quantization import MXFP8_BLOCK_SCALING_SIZE, FP8GlobalStateManager, quantize
from ..utils import cast_if_needed, divide
from .base import TransformerEngineBaseModule, init_method_constant

__all__ = ["GroupedLinear"]

# grouped_linear.py:604-608: per-GEMM offsets into the module's fp8 meta
_OFFSETS = {"input": 0, "weight": 1, "output": 2, "grad_output": 0, "grad_input": 1}
_PER_GEMM = {"fwd": 3, "bwd": 2}


# ------------------------------------------------------------------- TE's C++ shape checks
def _split_checks(shape, m_splits) -> list:
    """csrc/extensions/cast.cpp:697-740 (split_quantize): ``split_sections`` binds to a
    ``std::vector<int>`` (pybind11 takes a sequence of integers, not a tensor: TypeError as
    ``torch.split`` raises without FP8); every split >= 0 and inside the input."""
    if isinstance(m_splits, (str, bytes, torch.Tensor)) or not isinstance(m_splits, Sequence):
        raise TypeError("split_quantize(): incompatible function arguments (split_sections "
                        f"must be a sequence of ints, got {type(m_splits).__name__})")
    m_splits = [operator.index(s) for s in m_splits]
    offset = 0
    for s in m_splits:
        if s < 0 or offset + s > shape[0]:
            raise RuntimeError(f"Attempted to split tensor with shape={list(shape)} along dim 0 "
                               f"with split_sections={list(m_splits)}")
        offset += s
    return m_splits


def _mxfp8_cast_check(shape) -> None:
    """csrc/quantizer.cpp:1114-1116 (MXFP8Quantizer::get_scale_shape): every MXFP8 tensor,
    each split of split_quantize included (an empty split passes)."""
    numel = 1
    for d in shape:
        numel *= d
    last = shape[-1]
    if last % MXFP8_BLOCK_SCALING_SIZE or (numel // last) % MXFP8_BLOCK_SCALING_SIZE:
        raise RuntimeError(f"MXFP8 requires tensor dims that are divisible by "
                           f"{MXFP8_BLOCK_SCALING_SIZE} (got shape={list(shape)})")


def _fp8_gemm_check(recipe, a_shape, transa: bool, b_shape, transb: bool,
                    a_dim: int = 1, b_dim: int = 1) -> None:
    """cuBLASLt FP8 GEMM operand requirements, common/gemm/cublaslt_gemm.cu:102-303
    (CanonicalizeGemmInput) as on Hopper, where FP8 GEMMs are TN only: a non-transposed A / a
    transposed B is read from its column-wise (transposed) copy, so both leading dimensions
    are k. ``a_shape`` / ``b_shape``: row-major [rows, cols] (TE's flat dims); ``a_dim`` /
    ``b_dim``: 1 or 2, the block-scaling dimension of the operand. Called for non-empty GEMMs
    only (csrc/extensions/gemm.cpp:470-477 skips a GEMM with an empty operand)."""
    A0, A1 = a_shape
    B0, B1 = b_shape
    m = A0 if transa else A1  # cublaslt_gemm.cu:331-333
    k = A1 if transa else A0
    n = B1 if transb else B0
    if m <= 0 or n <= 0:  # cublaslt_gemm.cu:340-342
        return
    if isinstance(recipe, MXFP8BlockScaling):
        return  # cublaslt_gemm.cu:175-189, 264-274: no dimension check (the casts check)
    if isinstance(recipe, Float8BlockScaling):
        if k % 16:  # cublaslt_gemm.cu:205-206
            raise RuntimeError("Leading dimension requirement on NVTE_BLOCK_SCALING GEMM. "
                               "Caller must pad.")
        if m % 8:  # cublaslt_gemm.cu:209-210
            raise RuntimeError("Outer dimension requirement on A for NVTE_BLOCK_SCALING GEMM. "
                               "Caller must pad.")
        # cublaslt_gemm.cu:291-292 (ldb % 16): ldb == k, already checked for A
        if b_dim == 1 and n % 8:  # cublaslt_gemm.cu:293-297
            raise RuntimeError("Outer dimension requirement on B for NVTE_BLOCK_SCALING GEMM. "
                               "Caller must pad.")
        return
    # per-tensor scaling (delayed, current): lda == ldb == k on Hopper
    if k % 16:  # cublaslt_gemm.cu:155-159, then 246-250
        raise RuntimeError("Leading dimension requirement on A for FP8 GEMM. Caller must pad.")


def _block_dims(recipe):
    """(input, weight, grad) block-scaling dimensions (1 for the other recipes)."""
    if isinstance(recipe, Float8BlockScaling):
        return recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim
    return 1, 1, 1


# ------------------------------------------------------------------------- autograd function
class _GroupedLinear(torch.autograd.Function):
    """grouped_linear.py:56-496 on the CPU (float32 math, cast to the activation dtype)."""

    @staticmethod
    def forward(ctx, inp, args, *weights_and_biases):
        (m_splits, use_bias, is_first_microbatch, fp8, fuse_wgrad_accumulation,
         activation_dtype, is_grad_enabled, module, save_original_input) = args
        num_gemms = len(m_splits)
        weights = weights_and_biases[:num_gemms]
        biases = weights_and_biases[num_gemms:]
        meta = module.fp8_meta if fp8 else None
        recipe = meta["recipe"] if fp8 else None
        # grouped_linear.py:100-101 (Float8Quantizer: the delayed-scaling quantizer)
        if fp8 and save_original_input and recipe.delayed():
            raise ValueError("DelayedScaling recipe is not supported with save_original_input")
        in_features = weights[0].size(-1)
        if inp.size(-1) != in_features:  # grouped_linear.py:130-135
            raise ValueError(f"Input tensor (shape={tuple(inp.size())}) is not compatible with "
                             f"weight tensor (shape={tuple(weights[0].size())})")
        inp_view = inp.reshape(-1, in_features)
        x_dim, w_dim, _ = _block_dims(recipe)
        if fp8:  # grouped_linear.py:138-139: tex.split_quantize
            m_splits = _split_checks(inp_view.shape, m_splits)
            starts = [sum(m_splits[:i]) for i in range(num_gemms)]
            inputmats = [inp_view[s:s + m] for s, m in zip(starts, m_splits)]
            if isinstance(recipe, MXFP8BlockScaling):
                for x in inputmats:
                    _mxfp8_cast_check(x.shape)
            inputmats = [
                quantize(x, meta, True, _OFFSETS["input"] + i * _PER_GEMM["fwd"], "input")
                if x.shape[0] else x.float()
                for i, x in enumerate(inputmats)]
            # grouped_linear.py:148-160: the weights' FP8 casts (base.py:1420-1439
            # get_weight_workspace -> quantizer.quantize -> tex.quantize: the C++ check)
            if isinstance(recipe, MXFP8BlockScaling):
                for w in weights:
                    _mxfp8_cast_check(w.shape)
            wmats = [quantize(w, meta, True, _OFFSETS["weight"] + i * _PER_GEMM["fwd"], "weight")
                     for i, w in enumerate(weights)]
        else:  # grouped_linear.py:141, 163
            inputmats = [x.float() for x in
                         torch.split(cast_if_needed(inp_view, activation_dtype), m_splits)]
            wmats = [cast_if_needed(w, activation_dtype).float() for w in weights]
        # grouped_linear.py:166-169: FP8 GEMMs take a BF16 / FP16 bias
        bias_dtype = torch.bfloat16 if fp8 and activation_dtype == torch.float32 else activation_dtype
        if use_bias:
            biases = [cast_if_needed(b, bias_dtype) for b in biases]
        outs = []
        for i in range(num_gemms):  # general_grouped_gemm, layout TN
            if fp8 and inputmats[i].shape[0]:
                _fp8_gemm_check(recipe, wmats[i].shape, True, inputmats[i].shape, False,
                                w_dim, x_dim)
            y = inputmats[i] @ wmats[i].t()
            if use_bias:
                y = y + biases[i].float()
            outs.append(y.to(activation_dtype))
        out = torch.cat(outs) if outs else inp_view.new_empty(0, weights[0].size(0))

        ctx.save_for_backward(*(x.detach() for x in inputmats), *(w.detach() for w in wmats))
        ctx.weights = weights  # main_grad and the DDP marks live on the parameters
        ctx.m_splits, ctx.num_gemms, ctx.use_bias = m_splits, num_gemms, use_bias
        ctx.fp8, ctx.meta, ctx.recipe = fp8, meta, recipe
        ctx.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        ctx.is_first_microbatch = is_first_microbatch
        ctx.activation_dtype = activation_dtype
        ctx.inp_shape, ctx.weights_shape_1 = inp.shape, weights[0].shape[1]
        ctx.requires_dgrad = inp.requires_grad
        ctx.weights_requires_grad = weights[0].requires_grad
        ctx.reduce_and_update_bwd_fp8_tensors = False
        bias_rg = use_bias and biases[0].requires_grad
        if fp8 and is_grad_enabled and (inp.requires_grad or weights[0].requires_grad
                                                or bias_rg):
            # grouped_linear.py:275-280 (no graph-capture exception: TE 2.10's GroupedLinear
            # backward updates at 489-490 unconditionally, unlike Linear's linear.py:969)
            ctx.reduce_and_update_bwd_fp8_tensors = FP8GlobalStateManager.is_first_fp8_module()
        # grouped_linear.py:285-286
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        N = ctx.num_gemms
        saved = ctx.saved_tensors
        inputmats, wmats = saved[:N], saved[N:]
        weights = ctx.weights
        # grouped_linear.py:256-260, 298: main_grad is read in the backward
        main_grads = ([w.main_grad for w in weights] if ctx.fuse_wgrad_accumulation
                      and ctx.weights_requires_grad else [None] * N)
        g_view = grad_output.contiguous().view(-1, grad_output.shape[-1])
        grads = list(torch.split(g_view, ctx.m_splits))  # grouped_linear.py:311-347
        grad_biases = [None] * N
        _, w_dim, g_dim = _block_dims(ctx.recipe)
        if ctx.fp8:
            if ctx.use_bias:  # grouped_linear.py:315-333: from the high-precision gradient
                grad_biases = [g.sum(dim=0) for g in grads]
            if isinstance(ctx.recipe, MXFP8BlockScaling):
                for g in grads:
                    _mxfp8_cast_check(g.shape)
            grads = [quantize(g, ctx.meta, False, _OFFSETS["grad_output"] + i * _PER_GEMM["bwd"],
                              "grad") if g.shape[0] else g.float()
                     for i, g in enumerate(grads)]
        else:
            grads = [cast_if_needed(g, ctx.activation_dtype).float() for g in grads]

        # grouped_linear.py:349-354
        if ctx.is_first_microbatch is not None:
            accumulate = ctx.fuse_wgrad_accumulation and not ctx.is_first_microbatch
        else:
            accumulate = ctx.fuse_wgrad_accumulation

        dgrad = None
        if ctx.requires_dgrad:  # grouped_linear.py:356-384, layout NN
            parts = []
            for i in range(N):
                if ctx.fp8 and grads[i].shape[0]:
                    _fp8_gemm_check(ctx.recipe, wmats[i].shape, False, grads[i].shape, False,
                                    w_dim, g_dim)
                parts.append((grads[i] @ wmats[i]).to(ctx.activation_dtype))
            dgrad = (torch.cat(parts) if parts else g_view.new_empty(0, ctx.weights_shape_1))
            dgrad = dgrad.view(ctx.inp_shape)  # grouped_linear.py:492

        wgrad_list = [None] * N
        if ctx.weights_requires_grad:  # grouped_linear.py:386-478, layout NT
            x_dim = _block_dims(ctx.recipe)[0]
            # grouped_linear.py:431-435: overwrite_main_grad turns accumulation off
            if getattr(weights[0], "overwrite_main_grad", False):
                accumulate = False
            for i in range(N):
                if ctx.fp8 and inputmats[i].shape[0]:
                    _fp8_gemm_check(ctx.recipe, inputmats[i].shape, False, grads[i].shape, True,
                                    x_dim, g_dim)
                wgrad = grads[i].t() @ inputmats[i]  # float32; empty group: zeros
                if ctx.use_bias and grad_biases[i] is None:
                    # non-FP8: the bias gradient is fused into the wgrad GEMM (428, 443-445)
                    grad_biases[i] = grads[i].sum(dim=0).to(ctx.activation_dtype)
                if ctx.fuse_wgrad_accumulation:
                    mg = main_grads[i]
                    if accumulate:
                        mg.add_(wgrad.to(mg.dtype))
                    else:  # gemm.cpp:470-471: an empty group's output is zeroed, not skipped
                        mg.copy_(wgrad.to(mg.dtype))
                    wgrad_list[i] = None
                else:
                    wgrad_list[i] = wgrad.to(ctx.activation_dtype)
            for i, w in enumerate(weights):  # grouped_linear.py:451-478
                if ctx.fuse_wgrad_accumulation and hasattr(w, "grad_added_to_main_grad"):
                    w.grad_added_to_main_grad = True
                    # base.py:79-92 get_dummy_wgrad: an uninitialised (zeroed with
                    # zero_out_wgrad) buffer -- zeros here, a valid value of either
                    wgrad_list[i] = torch.zeros(w.main_grad.shape, dtype=w.dtype)
        if not ctx.use_bias:  # grouped_linear.py:482-487
            grad_biases = [None] * N
        else:
            grad_biases = [None if b is None else b.to(ctx.activation_dtype) for b in grad_biases]

        if ctx.reduce_and_update_bwd_fp8_tensors:  # grouped_linear.py:489-490
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return (dgrad, None, *wgrad_list, *grad_biases)


# ---------------------------------------------------------------------------------- module
class GroupedLinear(TransformerEngineBaseModule):
    """TE 2.10's GroupedLinear (grouped_linear.py:499-902) on the CPU."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
    ) -> None:
        super().__init__()
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.ub_overlap_rs = ub_overlap_rs
        self.ub_overlap_ag = ub_overlap_ag
        self.ub_name = ub_name
        self.save_original_input = save_original_input
        # grouped_linear.py:596-598
        assert not ub_overlap_rs and not ub_overlap_ag, (
            "GroupedLinear doesn't support Userbuffer overlap.")
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        if delay_wgrad_compute:  # grouped_linear.py:602 WeightGradStore
            raise NotImplementedError("fake transformer_engine: delay_wgrad_compute is not stood in")
        self._offsets = dict(_OFFSETS)
        self._num_fp8_tensors_per_gemm = dict(_PER_GEMM)

        self.init_tp_size(tp_group, tp_size)  # grouped_linear.py:610-617
        self.set_nccl_overlap_warning_if_tp()
        if self.tp_size > 1 and bias:  # grouped_linear.py:619-623
            raise ValueError(
                "GroupedLinear doesn't support bias when TP > 1. "
                "Because the TP communication is handled outside of this module.")
        self.parallel_mode = parallel_mode
        # grouped_linear.py:625-628
        assert self.parallel_mode in GemmParallelModes, f"parallel_mode {parallel_mode} not supported"
        if self.parallel_mode == "column":  # grouped_linear.py:630-633
            self.out_features = divide(self.out_features, self.tp_size)
        elif self.parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel  # grouped_linear.py:635

        for i in range(self.num_gemms):  # grouped_linear.py:637-669
            self.register_parameter(
                f"weight{i}",
                torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device,
                                               dtype=params_dtype)),
                init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker,
                fp8_meta_index=self._offsets["weight"] + i * self._num_fp8_tensors_per_gemm["fwd"])
            if self.use_bias:
                self.register_parameter(
                    f"bias{i}",
                    torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                   dtype=params_dtype)),
                    init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=params_dtype, device=device))
        self.reset_parameters(defer_init=device == "meta")  # grouped_linear.py:674

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """grouped_linear.py:682-693."""
        super().set_meta_tensor(fwd, recipe)
        if FP8GlobalStateManager.get_fp8_recipe().float8_current_scaling():
            assert not self.tp_size > 1, (
                "GroupedLinear doesn't support TP > 1 with Float8 current scaling. "
                "Because the TP communication is handled outside of this module.")

    def reset_parameters(self, defer_init=False):
        """grouped_linear.py:695-718: the base init, then the TP attributes."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            for i in range(self.num_gemms):
                set_tensor_model_parallel_attributes(
                    getattr(self, f"weight{i}"), True, 1 if self.parallel_mode == "row" else 0, 1)
            if self.use_bias:
                for i in range(self.num_gemms):
                    if self.parallel_mode == "row":
                        setattr(getattr(self, f"bias{i}"), "sequence_parallel",
                                self.sequence_parallel)
                    elif self.parallel_mode == "column":
                        set_tensor_model_parallel_attributes(getattr(self, f"bias{i}"), True, 0, 1)

    def forward(self, inp: torch.Tensor, m_splits: List[int],
                is_first_microbatch: Optional[bool] = None):
        """grouped_linear.py:720-818."""
        # grouped_linear.py:753
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        is_grad_enabled = torch.is_grad_enabled()  # grouped_linear.py:755 (off inside apply)
        with self.prepare_forward(inp, num_gemms=self.num_gemms) as inp:
            if self.fp8_calibration:
                raise NotImplementedError("fake transformer_engine: FP8 calibration is not stood in")
            weight_tensors = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            bias_tensors = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
            args = (m_splits, self.apply_bias, is_first_microbatch, self.fp8,
                    self.fuse_wgrad_accumulation, self.activation_dtype, is_grad_enabled, self,
                    self.save_original_input)
            out = _GroupedLinear.apply(inp, args, *weight_tensors, *bias_tensors)
        if self.return_bias:  # grouped_linear.py:816-817: a list, one bias per GEMM
            return out, [cast_if_needed(b, self.activation_dtype) for b in bias_tensors]
        return out

    def backward_dw(self):
        """grouped_linear.py:820-843: nothing is delayed (delay_wgrad_compute refused)."""
        return None
