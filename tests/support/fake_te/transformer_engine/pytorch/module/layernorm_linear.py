"""Fake ``transformer_engine.pytorch.LayerNormLinear`` (TE v2.10
``pytorch/module/layernorm_linear.py:1036``): norm, then linear."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from . import _compute
from ._norm import normalize
from .base import TransformerEngineBaseModule, init_method_constant
from .linear import check_tp_and_ub, register_linear_params, set_linear_tp_attributes
from ..utils import cast_if_needed


class LayerNormLinear(TransformerEngineBaseModule):
    """TE's constructor keywords (2.10, no other), parameters ``layer_norm_weight``
    (``layer_norm_bias`` for LayerNorm) registered before ``weight`` / ``bias``, and the
    ``return_layernorm_output`` / ``return_layernorm_output_gathered`` returns TE reads at
    every forward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        name: str = None,
    ) -> None:
        super().__init__()
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.normalization = normalization
        # layernorm_linear.py:1173
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = self.use_bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        # layernorm_linear.py:1178-1180
        self.return_layernorm_output_gathered = (
            return_layernorm_output_gathered if return_layernorm_output else False)
        self.zero_centered_gamma = zero_centered_gamma
        self.symmetric_ar_type = symmetric_ar_type
        self.name = name
        if delay_wgrad_compute:
            raise NotImplementedError("fake transformer_engine: delay_wgrad_compute is not stood in")
        # layernorm_linear.py:1187-1257 (as linear.py: TP group, parallel_mode, divide, SP, ub)
        check_tp_and_ub(self, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
                        sequence_parallel=sequence_parallel, ub_name=ub_name,
                        ub_flags=(ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_wgrad,
                                  ub_bulk_dgrad),
                        symmetric_ar_type=symmetric_ar_type)
        self.eps = eps
        # layernorm_linear.py:1259-1275
        self.register_parameter(
            "layer_norm_weight",
            torch.nn.Parameter(torch.empty(self.in_features, device=device, dtype=params_dtype)),
            init_fn=init_method_constant(float(not self.zero_centered_gamma)))
        if self.normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias",
                torch.nn.Parameter(torch.empty(self.in_features, device=device, dtype=params_dtype)),
                init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None
        register_linear_params(self, out_features, parameters_split, init_method,
                               get_rng_state_tracker, device, params_dtype)
        self.reset_parameters(defer_init=device == "meta")
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:  # layernorm_linear.py:1437-1465
            setattr(self.layer_norm_weight, "sequence_parallel", self.sequence_parallel)
            if self.normalization != "RMSNorm":
                setattr(self.layer_norm_bias, "sequence_parallel", self.sequence_parallel)
            set_linear_tp_attributes(self)

    _get_weight_and_bias_tensors = None  # set below (same as Linear's)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        if fp8_output or fp8_grad:
            raise NotImplementedError("fake transformer_engine: fp8_output / fp8_grad are not stood in")
        with self.prepare_forward(inp, allow_non_contiguous=False) as inp:
            weight, bias = self._get_weight_and_bias_tensors()
            # layernorm_linear.py:157
            assert inp.shape[-1] == self.in_features, "GEMM not possible"
            ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                               self.normalization, self.zero_centered_gamma, self.activation_dtype)
            x = _compute.column_input(self, ln_out)
            gemm_bias = bias if self.apply_bias and not self.gemm_bias_unfused_add else None
            out = _compute.gemm(self, x, weight, gemm_bias)
            out = _compute.row_output(self, out)
            # layernorm_linear.py:237-252, 534-538: the norm's output, this rank's rows unless
            # return_layernorm_output_gathered (then the all-gathered rows the GEMM read)
            ln_ret = x if self.return_layernorm_output_gathered else ln_out
        if self.gemm_bias_unfused_add:
            out = out + cast_if_needed(bias, self.activation_dtype)
        # layernorm_linear.py:1605-1611
        if self.return_bias:
            if self.return_layernorm_output:
                return out, cast_if_needed(bias, self.activation_dtype), ln_ret
            return out, cast_if_needed(bias, self.activation_dtype)
        if self.return_layernorm_output:
            return out, ln_ret
        return out


from .linear import Linear as _Linear  # noqa: E402

LayerNormLinear._get_weight_and_bias_tensors = _Linear._get_weight_and_bias_tensors
