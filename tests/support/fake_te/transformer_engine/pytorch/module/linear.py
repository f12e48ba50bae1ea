"""Fake ``transformer_engine.pytorch.Linear`` (TE v2.10 ``pytorch/module/linear.py:985``)."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from ..constants import GemmParallelModes
from ..distributed import set_tensor_model_parallel_attributes
from . import _compute
from .base import TransformerEngineBaseModule, init_method_constant
from ..utils import cast_if_needed, divide


def check_tp_and_ub(module, *, tp_group, tp_size, parallel_mode, sequence_parallel, ub_name,
                    ub_flags, symmetric_ar_type) -> None:
    """What Linear / LayerNormLinear's constructors check and set alike."""
    module.init_tp_size(tp_group, tp_size)  # linear.py:1119-1125
    module.parallel_mode = parallel_mode
    # linear.py:1129-1131
    assert module.parallel_mode in GemmParallelModes, f"parallel_mode {parallel_mode} not supported"
    if module.parallel_mode == "column":  # linear.py:1133-1136 (utils.py:148-157 divide)
        module.out_features = divide(module.out_features, module.tp_size)
    elif module.parallel_mode == "row":
        module.in_features = divide(module.in_features, module.tp_size)
    module.sequence_parallel = (module.tp_size > 1) and sequence_parallel  # linear.py:1138
    if any(ub_flags) and module.sequence_parallel and parallel_mode is not None:
        # linear.py:1166-1178: a userbuffers overlap needs ub_name; the fake has no userbuffers
        assert ub_name is not None, f"Comm+GEMM overlap layer '{ub_name}' is not initialized."
        raise NotImplementedError("fake transformer_engine: userbuffers (tp_comm_overlap) are not stood in")
    module.ub_name = ub_name
    if symmetric_ar_type is not None:  # linear.py:1181-1186
        assert tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7), \
            "Torch version must be at least 2.7 to use symmetric memory"


def register_linear_params(module, out_features, parameters_split, init_method,
                           get_rng_state_tracker, device, params_dtype) -> None:
    """weight / bias parameters as TE registers them (linear.py:1190-1292,
    layernorm_linear.py:1280-1382): one buffer each, split by ``parameters_split``."""
    weight_tensor = torch.empty(module.out_features, module.in_features, device=device,
                                dtype=params_dtype)
    bias_tensor = (torch.empty(module.out_features, device=device, dtype=params_dtype)
                   if module.use_bias else None)
    # linear.py:1206-1240: parameter names and split sizes
    if parameters_split is None:
        module.weight_names, module.bias_names = ["weight"], ["bias"]
        sizes = [out_features]
    elif not parameters_split:
        raise ValueError("Cannot split weight buffer into 0 parameters")
    elif isinstance(parameters_split, dict):
        module.weight_names = [f"{n.rstrip('_')}_weight" for n in parameters_split]
        module.bias_names = [f"{n.rstrip('_')}_bias" for n in parameters_split]
        sizes = list(parameters_split.values())
    elif all(isinstance(n, str) for n in parameters_split):
        module.weight_names = [f"{n.rstrip('_')}_weight" for n in parameters_split]
        module.bias_names = [f"{n.rstrip('_')}_bias" for n in parameters_split]
        sizes = [out_features // len(parameters_split)] * len(parameters_split)
    else:
        raise TypeError("Invalid configuration for parameters split")
    if sum(sizes) != out_features:
        raise ValueError(f"Trying to split weight buffer ({out_features=}) with split sizes {sizes}")
    if module.parallel_mode == "column":
        for i, size in enumerate(sizes):
            if size % module.tp_size != 0:
                raise RuntimeError(
                    f"Attempting to distribute a parameter with out_features={size} "
                    f"between {module.tp_size} tensor-parallel processes")
            sizes[i] = size // module.tp_size
    module.parameter_split_sizes = sizes
    offset = 0
    for wname, size in zip(module.weight_names, sizes):
        module.register_parameter(wname, torch.nn.Parameter(weight_tensor[offset:offset + size]),
                                init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker,
                                fp8_meta_index=1)
        offset += size
    if module.use_bias:
        offset = 0
        for bname, size in zip(module.bias_names, sizes):
            module.register_parameter(bname, torch.nn.Parameter(bias_tensor[offset:offset + size]),
                                    init_fn=init_method_constant(0.0))
            offset += size
    else:
        for bname in module.bias_names:
            setattr(module, bname, torch.Tensor().to(dtype=params_dtype, device=device))


def set_linear_tp_attributes(module) -> None:
    """The tensor-parallel marks TE sets on a linear's weights and biases after init
    (linear.py:1325-1345, layernorm_linear.py:1437-1465): weights split along the output
    (column) or input (row) dimension; a row bias carries ``sequence_parallel``, a column bias
    is split with the weight."""
    for w in module.weight_names:
        set_tensor_model_parallel_attributes(getattr(module, w), True,
                                             1 if module.parallel_mode == "row" else 0, 1)
    if module.use_bias:
        for b in module.bias_names:
            if module.parallel_mode == "row":
                setattr(getattr(module, b), "sequence_parallel", module.sequence_parallel)
            elif module.parallel_mode == "column":
                set_tensor_model_parallel_attributes(getattr(module, b), True, 0, 1)


class Linear(TransformerEngineBaseModule):
    """y = x W^T + b with TE's constructor (every keyword of TE 2.10, no other), TE's
    parameter names (``weight``, ``bias``; ``parameters_split`` names) and TE's
    tensor-parallel semantics."""

    def __init__(
        self,
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
        parameters_split: Optional[Union[Tuple[str, ...], Dict[str, int]]] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.symmetric_ar_type = symmetric_ar_type
        self.save_original_input = save_original_input
        self.name = name
        if delay_wgrad_compute:
            raise NotImplementedError("fake transformer_engine: delay_wgrad_compute is not stood in")
        if device == "meta":  # linear.py:1117-1118
            assert parameters_split is None, "Cannot split module parameters on 'meta' device."
        check_tp_and_ub(self, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
                        sequence_parallel=sequence_parallel, ub_name=ub_name,
                        ub_flags=(ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad,
                                  ub_bulk_wgrad),
                        symmetric_ar_type=symmetric_ar_type)

        register_linear_params(self, out_features, parameters_split, init_method,
                               get_rng_state_tracker, device, params_dtype)
        self.reset_parameters(defer_init=device == "meta")
        # linear.py:1298-1304: a row-parallel bias is added after the TP collective
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:  # linear.py:1325-1345
            set_linear_tp_attributes(self)

    def _get_weight_and_bias_tensors(self):
        ws = [getattr(self, n) for n in self.weight_names]
        weight = ws[0] if len(ws) == 1 else torch.cat(ws)
        if self.use_bias:
            bs = [getattr(self, n) for n in self.bias_names]
            bias = bs[0] if len(bs) == 1 else torch.cat(bs)
        else:
            bias = getattr(self, self.bias_names[0])
        return weight, bias

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        if fp8_output or fp8_grad:
            raise NotImplementedError("fake transformer_engine: fp8_output / fp8_grad are not stood in")
        with self.prepare_forward(inp) as inp:
            weight, bias = self._get_weight_and_bias_tensors()
            # linear.py:140
            assert inp.shape[-1] == self.in_features, "GEMM not possible"
            x = _compute.column_input(self, inp)
            gemm_bias = bias if self.apply_bias and not self.gemm_bias_unfused_add else None
            out = _compute.gemm(self, x, weight, gemm_bias)
            out = _compute.row_output(self, out)
        if self.gemm_bias_unfused_add:
            out = out + cast_if_needed(bias, self.activation_dtype)
        if self.return_bias:  # linear.py:1604-1606
            return out, cast_if_needed(bias, self.activation_dtype)
        return out
