"""Fake ``transformer_engine.pytorch.distributed`` (TE v2.10 ``pytorch/distributed.py``)."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

from transformer_engine.pytorch.quantization import FP8GlobalStateManager

_FP8_ACTIVATION_RECOMPUTE_ENABLED = False
_FP8_ACTIVATION_RECOMPUTE_PHASE = False
_ALL_ACTIVE_RNG_STATES: Dict = {}

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1,
                                      "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    # distributed.py:145-154
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attribute)
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def get_distributed_world_size(group=None) -> int:
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def get_distributed_rank(group=None) -> int:
    if not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


def get_all_rng_states():
    # distributed.py:72-74
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


class activation_recompute_forward(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    """distributed.py:228-263: the FP8 recompute flags (and the first-module flag carried from
    the forward to its recompute)."""

    _is_first_fp8_module: list = []

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        super().__init__()
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self):
        global _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE
        _FP8_ACTIVATION_RECOMPUTE_ENABLED = (
            self.activation_recompute and FP8GlobalStateManager.is_fp8_enabled())
        _FP8_ACTIVATION_RECOMPUTE_PHASE = self.recompute_phase
        if self.activation_recompute and not self.recompute_phase:
            activation_recompute_forward._is_first_fp8_module.append(
                FP8GlobalStateManager.IS_FIRST_FP8_MODULE)
        if self.activation_recompute and self.recompute_phase:
            FP8GlobalStateManager.IS_FIRST_FP8_MODULE = (
                activation_recompute_forward._is_first_fp8_module.pop(0))

    def __exit__(self, *exc_details):
        global _FP8_ACTIVATION_RECOMPUTE_ENABLED, _FP8_ACTIVATION_RECOMPUTE_PHASE
        _FP8_ACTIVATION_RECOMPUTE_ENABLED = False
        _FP8_ACTIVATION_RECOMPUTE_PHASE = False


def is_fp8_activation_recompute_enabled() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_ENABLED


def in_fp8_activation_recompute_phase() -> bool:
    return _FP8_ACTIVATION_RECOMPUTE_PHASE


def checkpoint(function, *args, **kwargs):
    """distributed.py:623 (Megatron's ``te_checkpoint``: recompute with FP8): not stood in."""
    raise NotImplementedError(
        "fake transformer_engine: transformer_engine.pytorch.distributed.checkpoint (Megatron's "
        "te_checkpoint, activation recompute under FP8) is not stood in")


class CudaRNGStatesTracker:
    """distributed.py:776-885 without graph-safe generators (``graph_safe_rng_available()``
    False): states are ``torch.cuda.get_rng_state()`` tensors (the CPU generator's under the
    CUDA-as-CPU mode)."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        # distributed.py:833-839
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        orig = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        self.states_[name] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(orig)
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        # distributed.py:869-885
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        orig = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(orig)
