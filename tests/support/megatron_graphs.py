"""Test-only harness: run Megatron's real CudaGraphManager (``cuda_graph_impl="local"``) over the
CPU CUDA-graph stand-in, and compare a graphed model's losses and gradients with an eager twin.

Never imported by the package. Megatron keeps graph state in class/module globals
(``_CudagraphGlobalRecord``, ``TensorReusePool``, the RNG tracker); :func:`graph_session`
saves and restores all of it so one test's graphs never leak into another test.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from tests.support.fake_cuda_graph import fake_cuda_graphs, reset_megatron_cuda_graphs


@contextlib.contextmanager
def megatron_graph_state() -> Iterator[None]:
    """A clean Megatron graph state for the block, restored (RNG tracker and the
    TensorReusePool instance included) on exit. On a GPU this alone wraps a real capture."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer import cuda_graphs as cg

    record = cg._CudagraphGlobalRecord
    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
             getattr(record, "tensor_reuse_pool", None))  # the pool: 0.16.x only
    reset_megatron_cuda_graphs()
    try:
        yield
    finally:
        reset_megatron_cuda_graphs()
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED, pool = saved
        if pool is not None:
            record.tensor_reuse_pool = pool


@contextlib.contextmanager
def graph_session() -> Iterator[None]:
    """fake_cuda_graphs() + :func:`megatron_graph_state` (CPU runs of Megatron's graphs)."""
    with megatron_graph_state(), fake_cuda_graphs():
        yield


def run_steps(model, steps: Sequence[Sequence], forward_step: Callable, seq_length: int,
              micro_batch_size: int = 1):
    """One ``forward_backward_no_pipelining`` call per step over that step's microbatches.
    Returns (losses per step [tensor of per-microbatch losses], grads per step {name: grad}).
    ``forward_step(mb, model) -> (output, loss_func)`` as Megatron's forward_step_func takes."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    _main_grads(model)
    losses, grads = [], []
    for mbs in steps:
        for p in model.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        it = iter(mbs)
        out = forward_backward_no_pipelining(
            forward_step_func=lambda data_it, m: forward_step(next(data_it), m),
            data_iterator=it, model=[model], num_microbatches=len(mbs), seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=False)
        losses.append(torch.stack([o["loss"] for o in out]))
        grads.append({n: (p.main_grad if hasattr(p, "main_grad") else p.grad).detach().clone()
                      for n, p in model.named_parameters() if p.requires_grad})
    return losses, grads


def run_steps_releasing(model, cache, handles: list, steps: Sequence[Sequence],
                        forward_step: Callable, seq_length: int):
    """:func:`run_steps` one step at a time, releasing after each step the cache slots that
    ``forward_step`` took and appended to ``handles`` (held until the step's backward)."""
    losses, grads = [], []
    for mbs in steps:
        step_losses, step_grads = run_steps(model, [mbs], forward_step, seq_length=seq_length)
        for pb in handles:
            cache.release(pb)
        handles.clear()
        losses += step_losses
        grads += step_grads
    return losses, grads


def _main_grads(model) -> None:
    """What Megatron's DDP gives each trained parameter, for a model not wrapped in it: a
    ``main_grad`` buffer, and a hook moving each accumulated ``grad`` into it
    (``_make_backward_post_hook``: ``param.main_grad.add_(param.grad.data); param.grad = None``,
    0.16.1 and 0.19.2 distributed/distributed_data_parallel.py, 0.19.2 :468-494). 0.19.x's backward
    graphs need it: they add the weight gradients into ``param.main_grad`` inside the graph
    and hand autograd None (0.19.2 transformer/cuda_graphs.py:1440-1446, :870); 0.16.x's hand
    autograd the gradients, which the hook moves. Eager and graphed runs read the same buffer.
    Installed once per parameter (a parameter with a ``main_grad`` already has its mover)."""

    def move(p):
        if p.grad is not None:  # as DDP's hook: nothing accumulated, nothing to move
            p.main_grad.add_(p.grad)
        p.grad = None

    for p in model.parameters():
        if p.requires_grad and not hasattr(p, "main_grad"):
            p.main_grad = torch.zeros_like(p)
            p.register_post_accumulate_grad_hook(move)


def graph_runners(model):
    """Megatron's _CudaGraphRunner objects of every graphed layer, in layer order."""
    return [r for m in model.modules() if hasattr(m, "cudagraph_manager")
            for r in m.cudagraph_manager.cudagraph_runners]


def max_rel_diff(a: dict, b: dict) -> dict:
    """{name: max|a-b| / max(|a|)} per gradient."""
    return {n: ((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-12)).item() for n in a}
