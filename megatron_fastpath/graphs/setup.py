"""What must happen before a model with per-layer CUDA graphs is built (megatron-core 0.16.1).

``CudaGraphManager.__init__`` (run inside every ``TransformerLayer.__init__``) asserts that
``get_cuda_rng_tracker()`` is Transformer Engine's tracker or a ``CudaRNGStatesTracker`` built
with ``use_cudagraphable_rng=True``. 0.16.1 never reads ``TransformerConfig.use_te_rng_tracker``:
the tracker is created by the first ``get_cuda_rng_tracker()`` call with default arguments (a
plain, non-graphable tracker) unless ``model_parallel_cuda_manual_seed`` made it first. So::

    setup = prepare_cuda_graphs(seed, use_te_rng_tracker=graph_cfg.use_te_rng_tracker)
    model = build_gpt_model(...)          # after, never before

:func:`prepare_cuda_graphs` (1) re-creates the tracker graph-safely and seeds it
(``model_parallel_cuda_manual_seed(seed, te_rng_tracker=..., use_cudagraphable_rng=...,
force_reset_rng=True)``; signature checked against 0.16.1
``megatron/core/tensor_parallel/random.py``) and (2) installs the compat shim that keeps
forward-graph input buffers out of Megatron's reuse pool
(:func:`megatron_fastpath.compat.keep_cudagraph_input_buffers`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["GraphSetup", "graphs_requested", "install_for_config", "prepare_cuda_graphs"]


@dataclasses.dataclass(frozen=True)
class GraphSetup:
    """rng_tracker: "te" (TECudaRNGStatesTracker) or "megatron-graphable"
    (CudaRNGStatesTracker(use_cudagraphable_rng=True)).
    input_buffer_shim: the 0.16.x TensorReusePool shim is installed."""

    rng_tracker: str
    input_buffer_shim: bool


def _te_available() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return bool(getattr(mrandom, "HAVE_TE", False))


def prepare_cuda_graphs(seed: int, use_te_rng_tracker: bool = True) -> GraphSetup:
    """Seed a CUDA-graph-safe RNG tracker and install the graph shims; call after
    ``init_distributed`` (model-parallel ranks are read) and before the model is built.

    ``use_te_rng_tracker=True`` needs Transformer Engine (Megatron would otherwise silently fall
    back to its plain tracker and fail in ``CudaGraphManager``); False uses Megatron's own
    graph-safe tracker (``use_cudagraphable_rng=True``).
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    if use_te_rng_tracker and not _te_available():
        raise ValueError(
            "cuda_graphs.use_te_rng_tracker=true needs Transformer Engine, which is not "
            "importable; install transformer-engine or set cuda_graphs.use_te_rng_tracker=false "
            "(Megatron's own graph-safe tracker)"
        )
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        is_graph_safe_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    from megatron_fastpath.compat.graphs import keep_cudagraph_input_buffers

    model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker=use_te_rng_tracker,
        use_cudagraphable_rng=not use_te_rng_tracker,
        force_reset_rng=True,
    )
    tracker = get_cuda_rng_tracker()
    if not is_graph_safe_cuda_rng_tracker(tracker):  # pragma: no cover - Megatron contract
        raise RuntimeError(f"Megatron made a non-graph-safe RNG tracker {type(tracker).__name__}")
    return GraphSetup(
        rng_tracker="te" if use_te_rng_tracker else "megatron-graphable",
        input_buffer_shim=keep_cudagraph_input_buffers(),
    )


def graphs_requested(config) -> bool:
    """True when a Megatron TransformerConfig asks for per-layer CUDA graphs (``cuda_graph_impl
    == "local"``, or the older ``enable_cuda_graph`` flag 0.16.1 still maps onto it)."""
    return bool(getattr(config, "enable_cuda_graph", False)) or getattr(config, "cuda_graph_impl", "none") == "local"


def install_for_config(config) -> bool:
    """The graph set-up a framework hook applies while its model is built: the input-buffer
    shim when ``config`` turns per-layer graphs on (the framework seeds its own graph-safe RNG
    tracker from the hook's ``use_te_rng_tracker``). Returns whether the shim is installed."""
    if not graphs_requested(config):
        return False
    from megatron_fastpath.compat.graphs import keep_cudagraph_input_buffers

    return keep_cudagraph_input_buffers()
