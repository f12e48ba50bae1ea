"""Fake ``TransformerEngineBaseModule`` (TE v2.10 ``pytorch/module/base.py``): parameter
registration with deferred init functions, ``reset_parameters`` under the RNG tracker, the
tensor-parallel group, ``prepare_forward``'s checks, FP8 metadata (``init_fp8_metadata``,
``init_fp8_meta_tensors`` / ``reset_fp8_meta_tensors``) and the pickled ``_extra_state``.

Not modelled: ``assert torch.cuda.is_available()`` (base.py:606) and ``assert inp.is_cuda``
(base.py:1049) -- the fake runs on a CPU by design (the CUDA-as-CPU mode keeps "cuda" tensors
on the CPU); userbuffers, debug, FSDP, FP8 primary weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from typing import Callable, Optional

import torch

from ...common.recipe import DelayedScaling
from .. import distributed as te_dist
from ..quantization import (
    DelayedScalingRecipeState,
    FP8GlobalStateManager,
    make_recipe_state,
)


@dataclasses.dataclass
class _ParameterInitMeta:
    init_fn: Optional[Callable] = None
    get_rng_state_tracker: Optional[Callable] = None
    fp8_meta_index: Optional[int] = None

    def __post_init__(self):
        if self.init_fn is None:  # base.py: default init (normal, std 0.023)
            self.init_fn = lambda w: torch.nn.init.normal_(w, mean=0.0, std=0.023)


def init_method_constant(val: float):
    def init_(tensor):
        return torch.nn.init.constant_(tensor, val)

    return init_


class TransformerEngineBaseModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.name = None
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_parameters = False
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.quantizers = {"scaling_fwd": {}, "scaling_bwd": {}}
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()
        if self.primary_weights_in_fp8:
            raise NotImplementedError("fake transformer_engine: FP8 primary weights are not stood in")
        self.preserve_high_precision_init_val = False
        self.fsdp_wrapped = False
        self.fsdp_group = None
        self.activation_dtype: Optional[torch.dtype] = None
        self.wgrad_accumulation_and_reduce_hooks = []
        self.forwarded_at_least_once = False

    # ---------------------------------------------------------------------------- parameters
    def register_parameter(self, name, param, **kwargs):
        # base.py:1208-1219
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        # base.py:1221-1251: each parameter's init_fn, under the tracker's fork when given
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            meta = self.param_init_meta[name]
            if meta.get_rng_state_tracker is None:
                meta.init_fn(param)
            elif getattr(self, "rng_tracker_name", None):
                with meta.get_rng_state_tracker().fork(self.rng_tracker_name):
                    meta.init_fn(param)
            else:
                with meta.get_rng_state_tracker().fork():
                    meta.init_fn(param)

    def set_tensor_parallel_group(self, tp_group) -> None:
        # base.py:946-957
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def set_nccl_overlap_warning_if_tp(self) -> None:
        pass

    def init_tp_size(self, tp_group, tp_size: int) -> None:
        """The tensor-parallel size and group every TE module's constructor sets alike
        (linear.py:1119-1125, grouped_linear.py:610-617, dot_product_attention.py:353-359):
        ``tp_size`` without a group (and the group None at size 1), else the group's size."""
        from ..distributed import get_distributed_world_size

        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(tp_group)
        else:
            self.tp_size = get_distributed_world_size(tp_group)
            self.set_tensor_parallel_group(tp_group)

    # --------------------------------------------------------------------------------- FP8
    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """base.py:706-740: a delayed-scaling state already made is kept (only its history length
        adjusted); otherwise a new recipe state of num_gemms * 3 (forward) / * 2 (backward)."""
        key = "scaling_fwd" if fwd else "scaling_bwd"
        if self.fp8_meta_tensors_initialized:
            state = self.fp8_meta[key]
            if recipe.delayed() and isinstance(state, DelayedScalingRecipeState):
                self.adjust_amax_history_length(recipe.amax_history_len, fwd=fwd)
                return
            if not recipe.delayed() and type(state.recipe) is type(recipe):
                return
        n = self.fp8_meta["num_gemms"] * (3 if fwd else 2)
        self.fp8_meta[key] = make_recipe_state(recipe, mode="forward" if fwd else "backward",
                                               num_quantizers=n)

    def adjust_amax_history_length(self, length: int, fwd: Optional[bool] = None) -> None:
        for key, f in (("scaling_fwd", True), ("scaling_bwd", False)):
            if fwd is not None and f != fwd:
                continue
            state = self.fp8_meta[key]
            cur = state.amax_history.shape[0]
            if length < cur:
                state.amax_history = state.amax_history[:length].clone()
            elif length > cur:
                state.amax_history = torch.nn.functional.pad(state.amax_history, (0, 0, 0, length - cur))

    def init_fp8_meta_tensors(self, recipe) -> None:
        # base.py:767-772
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fp8_meta_tensors_initialized = True

    def get_fp8_meta_tensors(self):
        if "scaling_fwd" not in self.fp8_meta or "scaling_bwd" not in self.fp8_meta:
            return None
        with torch.no_grad():
            return {k: [self.fp8_meta[k].scale.clone(), self.fp8_meta[k].amax_history.clone()]
                    for k in ("scaling_fwd", "scaling_bwd")}

    def reset_fp8_meta_tensors(self, fp8_meta_tensors=None) -> None:
        # base.py:787-804: in place, so the states keep their tensors
        def reset(key):
            if key in self.fp8_meta:
                state = self.fp8_meta[key]
                if fp8_meta_tensors is None:
                    state.scale.copy_(torch.ones_like(state.scale))
                    state.amax_history.copy_(torch.zeros_like(state.amax_history))
                else:
                    assert key in fp8_meta_tensors, "Cannot reset fp8 tensors."
                    state.scale.copy_(fp8_meta_tensors[key][0])
                    state.amax_history.copy_(fp8_meta_tensors[key][1])

        with torch.no_grad():
            reset("scaling_fwd")
            reset("scaling_bwd")

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """base.py:971-1017."""
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        enabled = self.fp8 or self.fp8_calibration
        self.fp8_meta["fp8_checkpoint"] = enabled
        if not enabled:
            self.fp8_initialized = False
            return
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if self.fp8_initialized and recipe == self.fp8_meta["recipe"]:
            return
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["num_gemms"] = num_gemms
        self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
        if hasattr(recipe, "fp8_format"):
            self.fp8_meta["fp8_max_fwd"] = recipe.fp8_format.value.max_fwd
            self.fp8_meta["fp8_max_bwd"] = recipe.fp8_format.value.max_bwd
        self.init_fp8_meta_tensors(recipe)
        self.fp8_initialized = True

    # ------------------------------------------------------------------------------ forward
    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        # base.py:925-944
        if torch.is_autocast_enabled():
            self.activation_dtype = torch.get_autocast_dtype("cuda")
            return
        if self.activation_dtype == inp.dtype:
            return
        for name, param in self.named_parameters():
            if param is not None:
                assert inp.dtype == param.dtype, (
                    "Data types for parameters must match when outside of autocasted region. "
                    f" Found input dtype: {inp.dtype} and {name!r} dtype: {param.dtype}")
        self.activation_dtype = inp.dtype

    @contextlib.contextmanager
    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1,
                        allow_non_contiguous: bool = False):
        """base.py:1028-1077."""
        self.forwarded_at_least_once = True
        if self.fp8 and te_dist.in_fp8_activation_recompute_phase():
            pass  # a recomputed forward: the forward's metadata stands
        else:
            if self.tp_size > 1:  # base.py:1051-1052
                assert getattr(self, "tp_group_initialized", False), "TP group not initialized."
            self.set_activation_dtype(inp)
            self.init_fp8_metadata(num_gemms=num_gemms)
            if self.fp8 and self.fp8_meta["recipe"].delayed():
                if self.sequence_parallel:  # base.py:1060-1064
                    assert self.fp8_meta["recipe"].reduce_amax, (
                        "Amax reduction across tensor parallel group is "
                        "necessary when using sequence parallelism with FP8.")
                if not FP8GlobalStateManager.fp8_graph_capturing():
                    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        if not allow_non_contiguous and not inp.is_contiguous():
            inp = inp.contiguous()
        yield inp

    # -------------------------------------------------------------------------- extra state
    def get_extra_state(self) -> torch.Tensor:
        """base.py:806-865: empty uint8 without FP8; else the pickled recipe, the delayed
        scaling tensors and the plain fp8_meta values."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        state = {"recipe": self.fp8_meta["recipe"]}
        if state["recipe"].delayed():
            for d in ("fwd", "bwd"):
                s = self.fp8_meta[f"scaling_{d}"]
                state[f"scale_{d}"] = s.scale.detach().cpu().clone()
                state[f"amax_history_{d}"] = s.amax_history.detach().cpu().clone()
        state["extra_fp8_variables"] = {
            k: v for k, v in self.fp8_meta.items()
            if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list))}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """base.py:867-918."""
        if state is None:
            return
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            state = pickle.loads(state.detach().cpu().numpy().tobytes())
        else:
            raise RuntimeError("Unsupported checkpoint format.")
        if state is None:
            return
        if "recipe" not in state:
            state["recipe"] = DelayedScaling()
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        if self.fp8_meta["recipe"].delayed():
            for d in ("fwd", "bwd"):
                s = self.fp8_meta[f"scaling_{d}"]
                s.scale.copy_(state[f"scale_{d}"])
                s.amax_history.copy_(state[f"amax_history_{d}"])
