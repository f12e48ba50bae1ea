"""Fake ``transformer_engine.pytorch.graph`` (TE v2.10 ``pytorch/graph.py``): what Megatron-Core
0.16.1's ``transformer/cuda_graphs.py`` imports (its ``HAVE_TE_GRAPHS`` then holds, as with
real TE): the capture flag, the FP8 meta save / restore around a capture. ``make_graphed_callables``
(``cuda_graph_impl=transformer_engine``) is not stood in."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch

from ..common.recipe import DelayedScaling

_IS_GRAPH_CAPTURING = False


def set_capture_start() -> None:
    # graph.py:40-43
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = True


def set_capture_end() -> None:
    # graph.py:46-49
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = False


def is_graph_capturing() -> bool:
    return _IS_GRAPH_CAPTURING


def save_fp8_tensors(modules: Iterable[torch.nn.Module], recipe) -> Optional[List[Any]]:
    """graph.py:859-883: each TE module's (scale, amax_history) copies, delayed scaling only."""
    from .module.base import TransformerEngineBaseModule

    if not isinstance(recipe, DelayedScaling):
        return None
    return [m.get_fp8_meta_tensors() if isinstance(m, TransformerEngineBaseModule) else None
            for module in modules for m in module.modules()]


def restore_fp8_tensors(modules: Iterable[torch.nn.Module], fp8_tensors) -> None:
    """graph.py:886-906."""
    from .module.base import TransformerEngineBaseModule

    if fp8_tensors is None:
        return
    for module in modules:
        for m in module.modules():
            tensors = fp8_tensors.pop(0)
            if isinstance(m, TransformerEngineBaseModule):
                m.reset_fp8_meta_tensors(tensors)
    if len(fp8_tensors) != 0:
        raise RuntimeError(f"Got FP8 state for {len(fp8_tensors)} more modules than expected. "
                           "There is probably a discrepancy with `save_fp8_tensors`.")


def make_graphed_callables(*args, **kwargs):
    raise NotImplementedError(
        "fake transformer_engine: make_graphed_callables (cuda_graph_impl=transformer_engine) is "
        "not stood in")
