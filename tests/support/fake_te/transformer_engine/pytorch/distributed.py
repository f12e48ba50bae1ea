"""Fake ``transformer_engine.pytorch.distributed`` (TE v2.10 ``pytorch/distributed.py``)."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

from .quantization import FP8GlobalStateManager

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


def graph_safe_rng_available() -> bool:
    # distributed.py:83-90
    return (hasattr(torch.cuda.CUDAGraph, "register_generator_state")
            and hasattr(torch.Generator, "graphsafe_set_state")
            and hasattr(torch.Generator, "graphsafe_get_state")
            and hasattr(torch.Generator, "clone_state"))


def _default_generator():
    return torch.cuda.default_generators[torch.cuda.current_device()]


def _get_cuda_rng_state(clone: bool = False):
    """distributed.py:93-115: the default CUDA generator's state -- with graph-safe RNG a
    generator object (``clone_state`` / ``graphsafe_get_state``), else a byte tensor."""
    gen = _default_generator()
    if graph_safe_rng_available():
        return gen.clone_state() if clone else gen.graphsafe_get_state()
    return gen.get_state()


def _set_cuda_rng_state(new_state) -> None:
    # distributed.py:118-142
    gen = _default_generator()
    if graph_safe_rng_available():
        gen.graphsafe_set_state(new_state)
    else:
        gen.set_state(new_state)


class CudaRNGStatesTracker:
    """distributed.py:776-885: named CUDA RNG states; with graph-safe RNG (torch >= 2.4) each a
    cloned generator forked by ``graphsafe_set_state`` (under the stand-ins: the fake CUDA
    generator, ``tests/support/fake_cuda_graph.FakeCudaGenerator``)."""

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
        if graph_safe_rng_available():  # distributed.py:841-846
            new_state = _get_cuda_rng_state(clone=True)
            new_state.manual_seed(seed)
            self.states_[name] = new_state
        else:  # distributed.py:847-856
            orig = _get_cuda_rng_state()
            torch.cuda.manual_seed(seed)
            self.states_[name] = _get_cuda_rng_state(clone=True)
            _set_cuda_rng_state(orig)
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        # distributed.py:869-885
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        orig = _get_cuda_rng_state()
        _set_cuda_rng_state(self.states_[name])
        try:
            yield
        finally:
            if not graph_safe_rng_available():  # a graph-safe state advanced in place
                self.states_[name] = _get_cuda_rng_state()
            _set_cuda_rng_state(orig)
