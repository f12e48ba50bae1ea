"""Test-only: the GPU stand-ins of a CPU run of the main job on ``training.device=cuda`` with
CUDA graphs captured -- :func:`gpu_standins` installs them all -- and the two it adds to
``cuda_as_cpu.py`` / ``fake_cuda_graph.py`` / ``gpu_standins.py``:

* :func:`flash_attn_varlen_func`, a flash-attn varlen stand-in a (fake) CUDA graph can capture
  and replay. ``gpu_standins.flash_attn_varlen_func`` loops over ``cu_seqlens.tolist()`` in
  Python: a host read, which the CUDA-graph stand-in refuses during capture, and a loop a
  replay would freeze at the captured packing. The real kernel reads ``cu_seqlens`` on the
  device, so a captured layer replays any packing; here too: each row's sequence comes from
  ``searchsorted`` over ``cu_seqlens`` on the device and attention is one masked SDPA call.
  Same contract otherwise (flash-attn 2.8's signature, causal within each sequence, GQA by
  head repetition, output rows outside every sequence uninitialised -- NaN here). Not
  modelled: the ``max_seqlen`` bound (a host check), dropout. ``window_size=(left, right)`` as
  flash-attn 2.8 (query i attends keys i - left .. i + right of its sequence, -1: unbounded).
* :class:`FakeCUDAGraphReplayingCollectives`, the fake CUDA graph replaying captured collectives.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
import types
from typing import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from tests.support.fake_cuda_graph import FakeCUDAGraph, FakeCudaGenerator, _Op
from tests.support.flex_standin import flex_attention_fn_standin


def _row_mask(cu_seqlens: torch.Tensor, T: int,
              window=(-1, -1)) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, T] bool: query row i may attend key j, [T] bool: row i is inside a sequence);
    ``window``: flash-attn's (left, right) -- inside a sequence index differences are position
    differences."""
    pos = torch.arange(T, device=cu_seqlens.device)
    bounds = cu_seqlens.to(pos.dtype)
    seq = torch.searchsorted(bounds[1:].contiguous(), pos, right=True)  # empty sequences skipped
    inside = pos < bounds[-1]
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :]) & inside[:, None]
    left, right = window
    if left >= 0:
        mask &= pos[:, None] - pos[None, :] <= left
    if right >= 0:
        mask &= pos[None, :] - pos[:, None] <= right
    return mask, inside


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    assert causal and dropout_p == 0.0
    T, heads = q.shape[0], q.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    assert len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size), \
        f"flash-attn window_size is (left, right), each -1 or >= 0; got {window_size!r}"
    mask, inside = _row_mask(cu_seqlens_q, T, tuple(window_size))
    rep = heads // k.shape[1]
    qs, ks, vs = (x.transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    # a row outside every sequence has no key: keep it out of the softmax, then NaN it
    keep = mask | ~inside[:, None]
    if softcap > 0:  # flash-attn >= 2.6: softcap * tanh(q.k * scale / softcap) (gpu_standins)
        scores = torch.tanh(qs @ ks.transpose(-2, -1) * scale / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1, dtype=torch.float32)
        out = probs.to(qs.dtype) @ vs
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, scale=scale)
    out = out.transpose(0, 1)
    return torch.where(inside[:, None, None], out, torch.full_like(out, float("nan")))


def graph_safe_flash_attn_module() -> types.ModuleType:
    """A ``flash_attn`` module for ``sys.modules`` (install with monkeypatch.setitem and clear
    ``megatron_fastpath._optional._try_import``'s cache)."""
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.__version__ = "2.8.3"
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # importlib.util.find_spec reads it
    return mod


def _waited(collective):
    """``collective`` (a c10d op, which returns its Work) run to completion."""

    def run(*args, **kwargs):
        out = collective(*args, **kwargs)
        for work in tree_flatten(out)[0]:
            if hasattr(work, "wait") and not isinstance(work, torch.Tensor):
                work.wait()
        return out

    return run


class FakeCUDAGraphReplayingCollectives(FakeCUDAGraph):
    """``fake_cuda_graph.FakeCUDAGraph`` whose replay also re-issues the ``c10d`` collectives
    captured in it (and waits for them), as a real graph replays a captured NCCL kernel. The
    base class records them but skips them on replay: their schemas
    (``c10d.alltoall_base_(Tensor output, ...) -> Work``) do not mark the output as written, so
    a replay read the buffers of the capture step (an EP=2 MoE layer replayed with the tokens
    received at capture: losses off the eager run's from step 2 on)."""

    def _record(self, func, args, kwargs, out):
        if func.namespace == "c10d":
            self.ops.append(_Op(_waited(func), args, kwargs, (), True))
        else:
            super()._record(func, args, kwargs, out)


class NvtxRanges:
    """``torch.cuda.nvtx.range_push`` / ``range_pop`` (torch 2.13 and 2.11 cuda/nvtx.py:27-38:
    ``_nvtx.rangePushA(msg)`` / ``_nvtx.rangePop()``, pybind11 bindings of nvtxRangePushA /
    nvtxRangePop, torch/csrc/cuda/shared/nvtx.cpp) with a tool attached that tracks the
    ranges (a profiler: without one NVTX returns NVTX_NO_PUSH_POP_TRACKING, -2, from both):

    * ``range_push(msg)``: ``msg`` is the ``const char*`` argument -- pybind11 takes a str (or
      bytes, or None as NULL); anything else raises TypeError ("rangePushA(): incompatible
      function arguments"); returns the zero-based depth of the range started (nvtx.py:29);
    * ``range_pop()``: no argument (nvtx.py:37); returns the zero-based depth of the range
      ended (nvtx.py:38), a negative value when there is none to end (NVTX: "if an error
      occurs, a negative value is returned") -- counted in ``underflows``;
    * the open ranges are ``stack``; :meth:`assert_balanced` raises unless every push was
      popped and no pop underflowed (``gpu_standins`` calls it when its block exits without an
      exception: an unbalanced push / pop over a step fails the test). A CPU build of torch
      raises 'NVTX functions not installed' from both (nvtx.py:13-16); a CUDA build without a
      tool returns -2 from both, GPU or not."""

    def __init__(self):
        self.stack: list = []
        self.pushed = 0
        self.underflows = 0

        def range_push(msg):
            if not (msg is None or isinstance(msg, (str, bytes))):
                raise TypeError(
                    "rangePushA(): incompatible function arguments. The following argument types "
                    f"are supported:\n    1. (arg0: str) -> int\n\nInvoked with: {msg!r}")
            self.stack.append(msg)
            self.pushed += 1
            return len(self.stack) - 1

        def range_pop():
            if not self.stack:
                self.underflows += 1
                return -1
            self.stack.pop()
            return len(self.stack)

        self.range_push, self.range_pop = range_push, range_pop

    def assert_balanced(self) -> None:
        if self.stack or self.underflows:
            raise AssertionError(
                f"unbalanced torch.cuda.nvtx ranges: {len(self.stack)} pushed and never popped "
                f"({self.stack!r}), {self.underflows} pop(s) with no range open")


# The NVTX stand-in of the latest gpu_standins() block (its ranges stay readable after it).
NVTX = NvtxRanges()


def _require_with_te_standins(real_require):
    """The attention modules' ``require`` with Transformer Engine answered by the stand-ins (its
    attention and fused RoPE only: TE's linears, FP8 and RNG tracker stay missing)."""

    def require(name, feature, alternatives=""):
        if name.startswith("transformer_engine"):
            return types.SimpleNamespace(__name__=name)
        return real_require(name, feature, alternatives)

    return require


@contextlib.contextmanager
def gpu_standins() -> Iterator[None]:
    """The GPU stand-in environment of a CPU run of the main job with ``training.device=cuda``:

    * ``tests.support.megatron_graphs.graph_session`` -- the CUDA-as-CPU mode, the fake CUDA
      graph (capture records, replay re-runs; a host read during capture raises) and a clean
      Megatron graph state, restored on exit;
    * collectives captured in a graph replayed with it (:class:`FakeCUDAGraphReplayingCollectives`);
    * the fake CUDA generator, a ``torch.Generator`` (``fake_cuda_graph.FakeCudaGenerator``);
    * ``torch.cuda.nvtx`` ranges recorded by a fresh :class:`NvtxRanges` (:data:`NVTX`: the
      offload manager marks its copies with them; a CPU build of torch raises "NVTX functions
      not installed"), checked balanced when the block exits without an exception;
    * flash-attn: this module's graph-safe varlen stand-in in ``sys.modules``;
    * torch's compiled FlexAttention on the job's CUDA device: ``tests.support.flex_standin``
      (the real flex forward, a dense backward, the CUDA kernel's contracts), through
      ``core_attention._flex_attention_fn``;
    * Transformer Engine's attention: ``gpu_standins.TEDotProductAttentionStandIn`` and its
      fused RoPE, through the seams of ``core_attention`` and ``kernels`` (TE's linears, FP8 and
      RNG tracker are not stood in: what needs them stays refused as missing);
    * the environment variables a graph plan sets (``apply_env``) are restored on exit.
    """
    global NVTX
    from megatron_fastpath import _optional
    from megatron_fastpath.attention import backend as attention_backend
    from megatron_fastpath.attention import core_attention, kernels
    from tests.support.gpu_standins import TEDotProductAttentionStandIn, te_apply_rotary_pos_emb
    from tests.support.megatron_graphs import graph_session

    TEDotProductAttentionStandIn.calls = []
    NVTX = nvtx = NvtxRanges()
    patches = [
        mock.patch.dict(os.environ),
        mock.patch.object(core_attention, "_te_dot_product_attention_cls",
                          lambda: TEDotProductAttentionStandIn),
        mock.patch.object(kernels, "_te_apply_rotary_pos_emb", lambda: te_apply_rotary_pos_emb),
        mock.patch.object(attention_backend, "require", _require_with_te_standins(attention_backend.require)),
        mock.patch.object(kernels, "require", _require_with_te_standins(kernels.require)),
        mock.patch.object(core_attention, "_flex_attention_fn", flex_attention_fn_standin),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        # one key of sys.modules (patch.dict would drop every module imported in the block)
        before = sys.modules.get("flash_attn")
        sys.modules["flash_attn"] = graph_safe_flash_attn_module()
        stack.callback(lambda: sys.modules.__setitem__("flash_attn", before) if before is not None
                       else sys.modules.pop("flash_attn", None))
        _optional._try_import.cache_clear()
        stack.callback(_optional._try_import.cache_clear)
        stack.enter_context(graph_session())
        for p in (mock.patch("torch.cuda.CUDAGraph", FakeCUDAGraphReplayingCollectives),
                  mock.patch("torch.cuda.default_generators", (FakeCudaGenerator(),)),
                  mock.patch("torch.cuda.nvtx.range_push", nvtx.range_push),
                  mock.patch("torch.cuda.nvtx.range_pop", nvtx.range_pop)):
            stack.enter_context(p)
        yield
        nvtx.assert_balanced()  # not reached when the block raised


__all__ = ["FakeCUDAGraphReplayingCollectives", "NvtxRanges",
           "flash_attn_varlen_func", "gpu_standins", "graph_safe_flash_attn_module"]
