"""compat.graphs.reset_full_cuda_graph_state: Megatron 0.16.1's FullCudaGraphWrapper keeps its
graph, result, iteration count and static buffers in class attributes; each full-iteration job
starts from a clean state, and a layout other than the 0.16 line's is refused."""

import pytest

from megatron_fastpath.compat.graphs import full_cuda_graph_captured, reset_full_cuda_graph_state


def test_reset_clears_megatron_class_state(monkeypatch):
    from megatron.core import full_cuda_graph as fcg

    wrapper, loader = fcg.FullCudaGraphWrapper, fcg.StaticBufferLoader
    for cls, attr in ((wrapper, "curr_iteration"), (wrapper, "cuda_graph"), (wrapper, "result"),
                      (loader, "static_buffers")):
        monkeypatch.setattr(cls, attr, getattr(cls, attr))  # restored after the test
    wrapper.curr_iteration = {"training": 7, "validation": 2}
    wrapper.cuda_graph = {"training": object(), "validation": None}
    loader.static_buffers = {"training": [{"x": 1}], "validation": []}
    assert full_cuda_graph_captured() is wrapper.cuda_graph["training"]
    reset_full_cuda_graph_state()
    assert wrapper.curr_iteration == {"training": 0, "validation": 0}
    assert wrapper.cuda_graph == {"training": None, "validation": None}
    assert wrapper.result == {"training": None, "validation": None}
    assert loader.static_buffers == {"training": [], "validation": []}
    assert full_cuda_graph_captured() is None


def test_other_layout_refused(monkeypatch):
    from megatron.core import full_cuda_graph as fcg

    monkeypatch.setattr(fcg.FullCudaGraphWrapper, "cuda_graph", None)
    with pytest.raises(ImportError, match="FullCudaGraphWrapper.cuda_graph is not"):
        reset_full_cuda_graph_state()
