"""Fake ``transformer_engine.pytorch.quantization`` (TE v2.10 ``pytorch/quantization.py``):
the FP8 global state, ``autocast`` / ``fp8_autocast`` / ``fp8_model_init``, the recipes' per-module
state and the quantise-dequantise the fake linears compute with.

Numerics (not TE's kernels, deterministic, FP8-like): a tensor is scaled, rounded to
``torch.float8_e4m3fn`` (forward; gradients ``float8_e5m2`` under ``Format.HYBRID``, pytorch/
quantization.py:117-123) and dequantised:

* delayed (``DelayedScaling``): the module's ``fp8_meta["scaling_fwd"|"scaling_bwd"]`` hold
  ``scale`` and ``amax_history`` [len, n] (quantization.py:1039-1078); a cast records the
  tensor's amax in ``amax_history[0]`` and uses the current ``scale``; at the exit of the
  outermost autocast (forward, quantization.py:591-601) and in the backward of the first module
  (backward) the amaxes of every module registered in the autocast's buffer (once, at its first
  forward: quantization.py:350-402) are max-reduced over the autocast's group and the scales updated with
  TE's rule ``scale = fp8_max / amax / 2**margin`` (kept when amax is 0 or not finite,
  quantization.py:880-904), then the history rolls (quantization.py:855-862);
* tensorwise (``Float8CurrentScaling``): one scale from the tensor's current amax;
* mxfp8 (``MXFP8BlockScaling``): 32 consecutive values along the last dim share a power-of-two
  scale (E8M0); TE requires both dims (flattened) divisible by 32 (tensor/mxfp8_tensor.py:112-118);
* blockwise (``Float8BlockScaling``): 1x128 blocks (1D; inputs and gradients) or 128x128
  blocks (2D; weights), power-of-two float32 scales unless ``use_f32_scales``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ..common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

MXFP8_BLOCK_SCALING_SIZE = 32  # pytorch/constants.py
BLOCKWISE_LEN = 128  # tensor/float8_blockwise_tensor.py:54


def get_default_fp8_recipe() -> Recipe:
    # quantization.py:102-109 picks by GPU generation; the fake answers as on Hopper
    return DelayedScaling()


def get_fp8_torch_dtype(recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    # quantization.py:117-123
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def get_fp8_max(recipe: Recipe, fprop_tensor: bool = True) -> float:
    # quantization.py:142-148
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return Format.E4M3.value.max_fwd
    return Format.E5M2.value.max_fwd


# ------------------------------------------------------------------------------ quantisation
def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    """x (float32) * scale rounded to ``dtype`` (saturating, as TE's cast) and back / scale."""
    q = (x * scale).clamp(-fmax, fmax).to(dtype)
    return q.to(torch.float32) / scale


def _pow2_floor(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(s)))


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, dtype, fmax) -> torch.Tensor:
    return _cast(x.float(), scale.float(), dtype, fmax)


def current_scale(x: torch.Tensor, fmax: float, power_2: bool = False) -> torch.Tensor:
    amax = x.detach().abs().amax().float()
    s = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
    return _pow2_floor(s) if power_2 else s


def quantize_blocks(x: torch.Tensor, rows: int, cols: int, dtype, fmax, power_2: bool,
                    e8m0: bool = False) -> torch.Tensor:
    """x viewed as 2-D [M, K] (leading dims flattened), each ``rows`` x ``cols`` block scaled by
    its own amax (partial edge blocks allowed), quantised and dequantised."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    M, K = x2.shape
    pm, pk = (-M) % rows, (-K) % cols
    xp = torch.nn.functional.pad(x2, (0, pk, 0, pm))
    blocks = xp.reshape((M + pm) // rows, rows, (K + pk) // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    if e8m0:  # MXFP8: the smallest power of two with amax / scale_inv <= fmax
        scale_inv = torch.exp2(torch.ceil(torch.log2(amax / fmax)))
        scale_inv = torch.where(amax > 0, scale_inv, torch.ones_like(scale_inv))
        scale = 1.0 / scale_inv
    else:
        scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
        if power_2:
            scale = _pow2_floor(scale)
    deq = _cast(blocks, scale, dtype, fmax).reshape(M + pm, K + pk)[:M, :K]
    return deq.reshape(shape)


class FP8State:
    """One linear's FP8 state for its autocast's recipe (``fp8_meta`` of TE's module):
    which tensor is cast how. Index: forward 0 input, 1 weight, 2 output; backward 0 grad
    output, 1 grad input (TE's FP8FwdTensors / FP8BwdTensors)."""


class DelayedScalingRecipeState:
    """quantization.py:1039-1078: ``scale`` [n] and ``amax_history`` [len, n] float32."""

    def __init__(self, recipe: DelayedScaling, *, mode: str, num_quantizers: int = 1, device=None):
        self.recipe, self.mode, self.num_quantizers = recipe, mode, num_quantizers
        self.dtype = get_fp8_torch_dtype(recipe, mode == "forward")
        self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers,
                                        dtype=torch.float32, device=device)


class StatelessRecipeState:
    """Current / MXFP8 / block scaling: no history (quantization.py:1089-1198)."""

    def __init__(self, recipe: Recipe, *, mode: str, num_quantizers: int = 1, device=None):
        self.recipe, self.mode, self.num_quantizers = recipe, mode, num_quantizers
        self.dtype = get_fp8_torch_dtype(recipe, mode == "forward")


def make_recipe_state(recipe: Recipe, *, mode: str, num_quantizers: int, device=None):
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingRecipeState(recipe, mode=mode, num_quantizers=num_quantizers,
                                         device=device)
    if isinstance(recipe, NVFP4BlockScaling) or recipe.custom():
        raise NotImplementedError(
            f"fake transformer_engine: {type(recipe).__name__} is not stood in")
    return StatelessRecipeState(recipe, mode=mode, num_quantizers=num_quantizers)


def quantize(x: torch.Tensor, meta: dict, fwd: bool, index: int, role: str) -> torch.Tensor:
    """x quantised and dequantised (float32) as ``meta``'s recipe casts tensor ``index`` of the
    forward (``fwd``) or backward set; ``role``: "input", "weight" or "grad" (block shapes)."""
    recipe = meta["recipe"]
    state = meta["scaling_fwd" if fwd else "scaling_bwd"]
    dtype, fmax = state.dtype, get_fp8_max(recipe, fwd)
    if isinstance(recipe, DelayedScaling):
        with torch.no_grad():  # record this cast's amax for the next scale update
            amax = x.detach().abs().amax().float()
            state.amax_history[0, index] = torch.maximum(state.amax_history[0, index], amax)
        return quantize_per_tensor(x, state.scale[index], dtype, fmax)
    if isinstance(recipe, Float8CurrentScaling):
        return quantize_per_tensor(x, current_scale(x, fmax, recipe.use_power_2_scales), dtype, fmax)
    if isinstance(recipe, MXFP8BlockScaling):
        shape = x.shape  # tensor/mxfp8_tensor.py:112-118
        assert (shape[-1] % MXFP8_BLOCK_SCALING_SIZE == 0
                and math.prod(shape[:-1]) % MXFP8_BLOCK_SCALING_SIZE == 0), (
            f"Incorrect shape {tuple(shape)} for MXFP8. Tensor dims must be divisible by"
            f" {MXFP8_BLOCK_SCALING_SIZE}")
        return quantize_blocks(x, 1, MXFP8_BLOCK_SCALING_SIZE, dtype, fmax, True, e8m0=True)
    if isinstance(recipe, Float8BlockScaling):
        dim = {"input": recipe.x_block_scaling_dim, "weight": recipe.w_block_scaling_dim,
               "grad": recipe.grad_block_scaling_dim}[role]
        rows = BLOCKWISE_LEN if dim == 2 else 1
        return quantize_blocks(x, rows, BLOCKWISE_LEN, dtype, fmax, not recipe.use_f32_scales)
    raise NotImplementedError(f"fake transformer_engine: {type(recipe).__name__}")


def _amax_and_scale_update(state: DelayedScalingRecipeState, recipe: DelayedScaling,
                           fmax: float) -> None:
    """quantization.py:855-954 for one state: amax from the history (max or most recent),
    scale = fmax / amax / 2**margin where amax is finite and > 0, history rolled, row 0 zeroed."""
    hist = state.amax_history
    if callable(recipe.amax_compute_algo):
        amax = recipe.amax_compute_algo(hist)
    elif recipe.amax_compute_algo == "max":
        amax = hist.max(dim=0).values
    else:
        amax = hist[0].clone()
    if recipe.scaling_factor_compute_algo is not None:
        new = recipe.scaling_factor_compute_algo(amax, state.scale, fmax, recipe)
    else:
        sf = (fmax / amax) / (2 ** recipe.margin)
        sf = torch.where(amax > 0.0, sf, state.scale)
        sf = torch.where(torch.isfinite(amax), sf, state.scale)
        new = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
    state.scale.copy_(new)
    if hist.shape[0] > 1:
        hist.copy_(torch.roll(hist, -1, 0))
    hist[0].fill_(0.0)


# ----------------------------------------------------------------------------- global state
class FP8GlobalStateManager:
    """quantization.py:224-660: the autocast state and the delayed-scaling buffers."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Optional[Recipe] = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    AUTOCAST_DEPTH = 0
    skip_fp8_weight_update_tensor = None
    # quantization.py:238-247: the delayed-scaling buffers, per key "forward_<autocast key>" /
    # "backward_<autocast key>": here the fp8_meta dicts registered under it (TE keeps their
    # amax / history / scale tensors), and each autocast key's (recipe, group)
    global_amax_buffer: dict = {}
    autocast_arguments: dict = {}

    @classmethod
    def reset(cls) -> None:
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.FP8_PARAMETERS = False
        cls.HIGH_PRECISION_INIT_VAL = cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = cls.skip_fp8_weight_update_tensor = None
        cls.AUTOCAST_DEPTH = 0
        cls.global_amax_buffer, cls.autocast_arguments = {}, {}

    @classmethod
    def get_unique_autocast_key(cls, recipe=None, group=None) -> str:
        return f"{str(recipe)}:{hash(group)}"  # quantization.py:541-550

    @classmethod
    def is_fp8_available(cls):
        return True, ""

    @classmethod
    def is_mxfp8_available(cls):
        return True, ""

    @classmethod
    def is_fp8_block_scaling_available(cls):
        return True, ""

    @classmethod
    def is_nvfp4_available(cls):
        return False, "fake transformer_engine: NVFP4 is not stood in"

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        if cls.skip_fp8_weight_update_tensor is None:
            cls.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32)
        cls.skip_fp8_weight_update_tensor.fill_(skip)

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        # quantization.py:429-436: True once per outermost autocast, then False
        first = cls.IS_FIRST_FP8_MODULE
        cls.IS_FIRST_FP8_MODULE = False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        if cls.FP8_RECIPE is not None:
            return cls.FP8_RECIPE
        return get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def get_autocast_state(cls):
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state) -> None:
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """quantization.py:350-402: a delayed-scaling module registers ONCE (``fp8_meta`` keeps
        "buffer_index_and_autocast_key"; its amax tensors are static), in the forward and the
        backward buffer of its (recipe, group); every later update of that buffer updates it --
        whether or not the module ran since (a graph replay runs no module code)."""
        if not fp8_meta["recipe"].delayed():
            return
        index_in_buffer = "buffer_index_and_autocast_key"  # get_buffer_info, L323-330
        if index_in_buffer in fp8_meta:
            return
        fp8_meta[index_in_buffer] = []
        autocast_key = cls.get_unique_autocast_key(fp8_meta["recipe"], fp8_meta["fp8_group"])
        for forward in (True, False):
            if ("scaling_fwd" if forward else "scaling_bwd") not in fp8_meta:
                continue
            key = f"{'forward' if forward else 'backward'}_{autocast_key}"  # get_key_in_buffer
            cls.global_amax_buffer.setdefault(key, []).append(fp8_meta)
            fp8_meta[index_in_buffer] += [len(cls.global_amax_buffer[key]) - 1, key]

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """quantization.py:487-539: for every buffer of the direction, max-reduce the registered
        modules' current amaxes over the autocast's group and update their scales and histories."""
        for key, metas in cls.global_amax_buffer.items():
            fwd, autocast_key = key.startswith("forward_"), key.split("_", 1)[1]
            if fwd != forward or not metas:
                continue
            recipe, group = cls.autocast_arguments[autocast_key]
            for meta in metas:
                state = meta["scaling_fwd" if forward else "scaling_bwd"]
                if (recipe.reduce_amax and torch.distributed.is_initialized()
                        and torch.distributed.get_world_size(group=group) > 1):
                    torch.distributed.all_reduce(state.amax_history[0], op=torch.distributed.ReduceOp.MAX,
                                                 group=group)
                _amax_and_scale_update(state, recipe, get_fp8_max(recipe, forward))

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None,
                       _graph=False) -> None:
        # quantization.py:553-589
        fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        cls.autocast_arguments[cls.get_unique_autocast_key(fp8_recipe, fp8_group)] = (fp8_recipe, fp8_group)
        cls.FP8_ENABLED = enabled
        cls.FP8_CALIBRATION = calibrating
        cls.FP8_RECIPE = fp8_recipe
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.FP8_GRAPH_CAPTURING = _graph
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1
        if enabled and isinstance(fp8_recipe, NVFP4BlockScaling):
            ok, why = cls.is_nvfp4_available()
            assert ok, why

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        # quantization.py:591-601
        cls.AUTOCAST_DEPTH -= 1
        if enabled and cls.AUTOCAST_DEPTH == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)

    # activation recompute (quantization.py:603-660): the fake keeps no per-forward copies; a
    # recomputed forward re-casts with the current scales, which a delayed-scaling update between
    # the forward and its recompute (none in one Megatron step) would change
    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta) -> None:
        pass

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta) -> None:
        pass

    @staticmethod
    def restore_fp8_meta_tensors(fp8_meta) -> None:
        pass


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """quantization.py:790-852."""
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=enabled, calibrating=calibrating,
                                         fp8_recipe=recipe, fp8_group=amax_reduction_group,
                                         _graph=_graph)
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(state)
        FP8GlobalStateManager.autocast_exit(enabled, _graph=_graph)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False):
    """quantization.py:756-787 (deprecated spelling of :func:`autocast`)."""
    with autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                  amax_reduction_group=fp8_group, _graph=_graph):
        yield


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """quantization.py:693-753: FP8 primary weights -- not stood in (the fake keeps parameters
    in high precision): entering it enabled raises."""
    if enabled:
        raise NotImplementedError(
            "fake transformer_engine: FP8 primary weights (fp8_model_init / quantized_model_init, "
            "Megatron's fp8_param) are not stood in")
    yield


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """quantization.py:662-690."""
    with quantized_model_init(enabled=enabled, recipe=recipe,
                              preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield
