"""CUDA graphs: Megatron's CudaGraphManager argument rules (graphs/audit.py) and the
0.16.x forward-input buffer shim (graphs/setup.py)."""

from __future__ import annotations

from typing import Optional

from packaging.version import Version

from megatron_fastpath.compat import MCORE_0_19, MCORE_VERSION, _require_checked_mcore, mcore_line


def cudagraph_arg_tools():
    """``(reference(args, kwargs), mismatch_errors(ref, args, kwargs))`` from Megatron's own
    CudaGraphManager code, so the graph-safety audit applies exactly Megatron's matching rules:
    ``reference`` records the ``ArgMetadata`` of a call's arguments, ``mismatch_errors`` lists
    how a later call's arguments differ from such a reference (empty: the graph may replay).

    0.16.x and 0.19.x keep them on the private ``_CudaGraphRunner`` (an instance method reading
    ``fwd_graph_input_arg_metas``/``fwd_graph_input_kwarg_metas``; 0.19.2
    transformer/cuda_graphs.py:1647 ``get_mismatch_errors``, ``ArgMetadata`` at :253); we call
    it unbound on a namespace holding those two attributes instead of building a runner (which
    needs CUDA).
    """
    import types

    from megatron.core.transformer.cuda_graphs import ArgMetadata, _CudaGraphRunner

    if not hasattr(_CudaGraphRunner, "get_mismatch_errors"):  # pragma: no cover - other versions
        raise ImportError(
            f"megatron-core {MCORE_VERSION} has no _CudaGraphRunner.get_mismatch_errors; the "
            "graph-safety audit's argument check supports the 0.16 and 0.19 lines"
        )

    def reference(args, kwargs):
        return types.SimpleNamespace(
            fwd_graph_input_arg_metas=[ArgMetadata(a) for a in args],
            fwd_graph_input_kwarg_metas={k: ArgMetadata(v) for k, v in kwargs.items()},
        )

    def mismatch_errors(ref, args, kwargs):
        return _CudaGraphRunner.get_mismatch_errors(ref, args, kwargs)

    return reference, mismatch_errors


# =============================================================================================
# CUDA graphs: keep forward-graph input buffers out of Megatron's TensorReusePool (0.16.x)
# =============================================================================================
#
# Why: megatron-core 0.16.x ``_CudaGraphRunner.create_fwd_graph`` ends with
#
#     # if an input buffer requires a copy, and does not have metadata attached to it at this
#     # point, it will not be reused after this forward pass, so return it to the pool
#     ... _CudagraphGlobalRecord.tensor_reuse_pool.insert(buf)
#
# but that buffer is the forward graph's static input, which its backward graph still reads
# (e.g. the first layer's input, saved by its input layernorm). A later backward capture takes
# it from the pool as its incoming-gradient buffer (``create_bwd_graph``:
# ``tensor_reuse_pool.get(o)``), so every backward replay overwrites the first layer's input
# before the first layer's backward runs: the embedding and first-layernorm gradients come out
# wrong while the loss is right. Reproduced on CPU with Megatron's own CudaGraphManager over a
# stock local-spec GPTModel (tests/graphs/test_megatron_cuda_graphs.py). Upstream deleted that
# block ("buffers being reused too early and affecting the correctness of the backward pass",
# NVIDIA/Megatron-LM#4433) and later made saved activations explicit (NVIDIA/Megatron-LM#5975).
#
# The shim swaps the one pool instance for a subclass whose ``insert`` drops forward-graph input
# buffers -- in 0.16.x the only tensors carrying ``can_skip_replay_copy``
# (transformer/cuda_graphs.py:876) -- and forwards everything else (the backward graphs'
# grad-output buffers, whose recycling is sound). Cost: one input-sized buffer per graphed
# layer stays allocated, as on upstream main.
#
# 0.19.x has that fix: there is no TensorReusePool; ``create_fwd_graph`` takes a fresh buffer
# from the graph mempool for every input it does not share with another graph
# (``alloc_tensor_from_graph_mempool``, 0.19.2 transformer/cuda_graphs.py:1223) and keeps the
# forward buffers whose lifetime crosses into backward capture
# (``_weakref_forward_buffers(preserve_forward_to_backward_lifetimes=True)``, :1367). The shim
# is 0.16-only; on 0.19 :func:`keep_cudagraph_input_buffers` installs nothing.

class CudaGraphShimError(RuntimeError):
    """A CUDA-graph shim met a megatron-core whose code it was not checked against."""


def _check_fwd_input_recycling_source(cg) -> None:
    import inspect

    fwd = inspect.getsource(cg._CudaGraphRunner.create_fwd_graph)
    expected = ("_CudagraphGlobalRecord.tensor_reuse_pool.insert(buf)",
                "buf.can_skip_replay_copy = can_skip_replay_copy")
    missing = [e for e in expected if e not in fwd]
    if missing:
        raise CudaGraphShimError(
            f"megatron-core {MCORE_VERSION}: _CudaGraphRunner.create_fwd_graph no longer contains "
            f"{missing}; re-check whether forward-graph input buffers are still returned to the "
            "TensorReusePool (NVIDIA/Megatron-LM#4433, #5975) before using per-layer CUDA graphs"
        )


def _fwd_inputs_kept_upstream(cg) -> None:
    """0.19.x: forward-graph inputs come from the graph mempool, no reuse pool exists."""
    import inspect

    fwd = inspect.getsource(cg._CudaGraphRunner.create_fwd_graph)
    if (hasattr(cg, "TensorReusePool") or "alloc_tensor_from_graph_mempool(ten)" not in fwd
            or "preserve_forward_to_backward_lifetimes=True" not in fwd):
        raise CudaGraphShimError(
            f"megatron-core {MCORE_VERSION}: _CudaGraphRunner.create_fwd_graph does not allocate "
            "its input buffers from the graph mempool and keep those backward reads as 0.19.2 "
            "does; re-check forward-graph input buffer reuse before using per-layer CUDA graphs"
        )


def keep_cudagraph_input_buffers(version: Optional["Version"] = None) -> bool:
    """Stop Megatron 0.16.x from recycling forward-graph input buffers (see the block comment).

    Idempotent; call before the first training step with ``cuda_graph_impl="local"``. Returns
    True when the shim is (already) installed, False on 0.19.x, which keeps those buffers
    itself (after checking its ``create_fwd_graph`` still does). Raises
    :class:`CudaGraphShimError` on a megatron-core line it was not checked against, saying what
    to check.
    """
    line = _require_checked_mcore(
        "keep_cudagraph_input_buffers",
        "transformer/cuda_graphs.py _CudaGraphRunner.create_fwd_graph returning forward-graph input "
        "buffers to tensor_reuse_pool (if it no longer does -- fixed upstream by "
        "NVIDIA/Megatron-LM#4433 / #5975 -- gate the shim off for that line)",
        exc=CudaGraphShimError, version=version)
    from megatron.core.transformer import cuda_graphs as cg

    if line == MCORE_0_19:
        _fwd_inputs_kept_upstream(cg)
        return False
    _check_fwd_input_recycling_source(cg)
    record = cg._CudagraphGlobalRecord
    if isinstance(record.tensor_reuse_pool, _keep_input_pool_class(cg)):
        return True
    record.tensor_reuse_pool = _keep_input_pool_class(cg)()
    return True


_POOL_CLASS = None


def _keep_input_pool_class(cg):
    global _POOL_CLASS
    if _POOL_CLASS is None:

        class KeepFwdInputsPool(cg.TensorReusePool):
            """TensorReusePool that never takes back a forward graph's input buffer."""

            dropped = 0

            def insert(self, tensor):
                if hasattr(tensor, "can_skip_replay_copy"):
                    type(self).dropped += 1
                    return
                super().insert(tensor)

        _POOL_CLASS = KeepFwdInputsPool
    return _POOL_CLASS


def restore_cudagraph_input_recycling() -> None:
    """Undo :func:`keep_cudagraph_input_buffers` (tests show the 0.16.1 bug with it off); a
    no-op on 0.19.x, which has no reuse pool."""
    from megatron.core.transformer import cuda_graphs as cg

    if not hasattr(cg, "TensorReusePool"):
        return
    cg._CudagraphGlobalRecord.tensor_reuse_pool = cg.TensorReusePool()


# ---------------------------------------------------------------------------------------------
# Capture warm-up passes (the MoE router's expert-bias counts)
#
# CudaGraphManager runs ``cuda_graph_warmup_steps`` forward/backward passes of each layer on
# zero inputs, with grad enabled, right before capturing it (transformer/cuda_graphs.py
# ``create_fwd_graph``, between ``_set_warmup_start()`` and ``_set_warmup_end()``). Their tokens
# must not enter the router's expert-bias counts. megatron-core 0.16.x's ``_set_warmup_end``
# declares its global but never resets it, so ``is_graph_warmup()`` stays True from the first
# capture on; the capture that follows is told apart by ``is_graph_capturing()`` (its count
# update is recorded into the graph, so every replay counts its real tokens). Once layers are
# captured their routers run only by replay; an MoE layer left eager after a capture would be
# read as warming up (all MoE layers are captured together: the main job and the hooks turn
# graphs on for every layer).
#
# 0.19.x's ``_set_warmup_end`` resets the flag (0.19.2 transformer/cuda_graphs.py:215-218), so
# ``is_graph_warmup()`` alone is the warm-up, and an eager MoE layer after a capture counts its
# tokens. (0.19 also restores the layer's buffers after a capture, :1157 / :1380, which would
# undo warm-up counts of a captured layer; the router's own check keeps them out on both lines.)
# ---------------------------------------------------------------------------------------------

WARMUP_FLAG_SITE = ("transformer/cuda_graphs.py", "def _set_warmup_end():")


def in_capture_warmup(version: Optional["Version"] = None) -> bool:
    """True inside CudaGraphManager's warm-up passes before a capture (see above)."""
    from megatron.core.transformer.cuda_graphs import is_graph_capturing, is_graph_warmup

    if mcore_line(version) == MCORE_0_19:
        return is_graph_warmup()
    return is_graph_warmup() and not is_graph_capturing()


# =============================================================================================
# Full-iteration graphs: Megatron's FullCudaGraphWrapper keeps its state in class attributes
# =============================================================================================
#
# Why: megatron-core 0.16.x ``full_cuda_graph.FullCudaGraphWrapper`` counts iterations and holds
# the captured graph and its result in class-level dicts (``curr_iteration``, ``cuda_graph``,
# ``result``), and ``StaticBufferLoader`` its static input buffers (``static_buffers``): one
# wrapper per process, captured once. A second job in the same process (a test, an evaluation
# run after training) would find the first job's graph there (``assert
# FullCudaGraphWrapper.cuda_graph[training_str] is None`` at its capture) and replay it. Each
# full-iteration step path starts from a clean state through this function.

_FULL_ITERATION_STATE = {
    "FullCudaGraphWrapper": ("curr_iteration", "cuda_graph", "result"),
    "StaticBufferLoader": ("static_buffers",),
}


def reset_full_cuda_graph_state() -> None:
    """Forget every graph, result, iteration count and static buffer Megatron's
    ``FullCudaGraphWrapper`` / ``StaticBufferLoader`` keep in class attributes (0.16 line; the
    same on 0.19: 0.19.2 full_cuda_graph.py:102, :141-143)."""
    _require_checked_mcore(
        "reset_full_cuda_graph_state",
        "FullCudaGraphWrapper / StaticBufferLoader keep their graph, result, iteration count "
        "and static buffers in class-level {'training', 'validation'} dicts")
    from megatron.core import full_cuda_graph as fcg

    for cls_name, attrs in _FULL_ITERATION_STATE.items():
        cls = getattr(fcg, cls_name)
        for attr in attrs:
            value = getattr(cls, attr, None)
            if not isinstance(value, dict) or set(value) != {"training", "validation"}:
                raise ImportError(
                    f"megatron-core {MCORE_VERSION}: {cls_name}.{attr} is not the "
                    "{'training', 'validation'} dict of the 0.16 / 0.19 lines; the "
                    "full-iteration graph path supports that layout only")
    fcg.FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    fcg.FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    fcg.FullCudaGraphWrapper.result = {"training": None, "validation": None}
    fcg.StaticBufferLoader.static_buffers = {"training": [], "validation": []}


def static_inputs_wait_upstream(version: Optional["Version"] = None) -> bool:
    """Whether Megatron's ``StaticBufferLoader`` itself makes its copy stream wait for the
    current stream before copying a microbatch's inputs into the static buffers. 0.19.x does
    (0.19.2 full_cuda_graph.py:115 and :129); 0.16.x copies without waiting (0.16.1
    full_cuda_graph.py:72-86), so a host running ahead of the GPU (no sync in the step) could
    overwrite inputs the previous step's replay still reads: the full-iteration step path
    adds that wait itself there."""
    return _require_checked_mcore(
        "static_inputs_wait_upstream", "StaticBufferLoader's copy stream and when it waits",
        version=version) == MCORE_0_19


def graph_inputs_per_microbatch(version: Optional["Version"] = None) -> bool:
    """Whether each microbatch of a step needs graph inputs of its own when per-layer graphs run
    under pipeline parallelism. 0.19.x: CudaGraphManager's record metadata (one object per
    input buffer, ``_apply_cudagraph_buffer_metadata``, 0.19.2 transformer/cuda_graphs.py:109-125)
    gives an input that several recorded graphs take one preallocated buffer and counts its
    pending uses (``input_use_count`` -> ``fwd_buffer_reuse_ref_count``, :1233-1245,
    :1337-1339); creating the first backward graph asserts every such buffer consumed (:617).
    Under 1F1B the last stage records microbatch 1's backward before microbatch 2's forward, so
    a packed-cache slot shared by the two (the same record tensors) still has uses pending there
    and the capture fails (the feature matrix's PP2 graph runs). 0.16.1 captures the same runs
    with shared slots (its metadata is per tensor, no ``_apply_cudagraph_buffer_metadata``)."""
    return _require_checked_mcore(
        "graph_inputs_per_microbatch", "CudaGraphManager's shared-input buffers and their "
        "reuse count checked before the first backward graph", version=version) == MCORE_0_19


def full_cuda_graph_captured(stage: str = "training"):
    """The graph ``FullCudaGraphWrapper`` captured for ``stage`` (None before its capture)."""
    from megatron.core import full_cuda_graph as fcg

    return fcg.FullCudaGraphWrapper.cuda_graph[stage]


# =============================================================================================
# Graph inputs that are views of one buffer (0.19.x)
# =============================================================================================
#
# 0.19.x's CudaGraphManager tells a layer's input buffers apart by a metadata object it attaches
# to each input tensor AND to every tensor on its ``_base`` chain
# (``_apply_cudagraph_buffer_metadata``, 0.19.2 transformer/cuda_graphs.py:109-125, called for
# every input by ``apply_cudagraph_record_metadata``, :1553-1561): two views of one base share
# that object, so they count as one input used twice, and ``create_fwd_graph`` gives both ONE
# buffer from the graph mempool, shaped as the first (:1229-1243). The packed cache keeps
# ``cu_seqlens`` / ``position_ids_T`` / ``seq_ids_T`` (and the CP fields) as views of one flat
# record filled by one host-to-device copy; as views they would all be captured into the
# cu_seqlens-sized buffer and the first replay fails to copy a [T] field into it. The tensors
# below alias the record's storage at the same offsets with no ``_base`` (``Tensor.set_``), so
# the one copy still fills them and Megatron sees separate inputs. 0.16.x keys its buffers by the
# tensor itself (``TensorReusePool``), so the views stay views there.
# ---------------------------------------------------------------------------------------------

def separate_graph_inputs(views: tuple, version: Optional["Version"] = None) -> tuple:
    """``views`` of one buffer as tensors Megatron's graphs take for separate inputs (0.19.x:
    same storage and offsets, no ``_base``); unchanged on 0.16.x."""
    import torch

    line = _require_checked_mcore(
        "separate_graph_inputs", "CudaGraphManager shares one buffer among the views of a base "
        "(_apply_cudagraph_buffer_metadata)", version=version)
    if line != MCORE_0_19:
        return tuple(views)
    out = []
    for v in views:
        t = torch.empty(0, dtype=v.dtype, device=v.device)
        with torch.no_grad():
            t.set_(v.untyped_storage(), v.storage_offset(), v.size(), v.stride())
        out.append(t)
    return tuple(out)
