"""CPU stand-ins for the GPU-only attention libraries, honouring their contracts.

* :func:`flash_attn_varlen_func`: flash-attn 2.8's varlen signature. Like FA2, its output and
  its dq / dk / dv are allocated uninitialised (here: NaN) and only rows inside a sequence
  ``[cu_seqlens[i], cu_seqlens[i+1])`` are written (flash-attention PR #2324); a sequence longer
  than ``max_seqlen`` is an error. ``window_size=(left, right)``: flash-attn 2.8's sliding
  window (``flash_attn_interface.py`` docstring: query i attends the keys in
  [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] inclusive, -1: unbounded),
  on top of ``causal``. ``softcap`` > 0: flash-attn >= 2.6's logit soft-capping
  (``flash_attn_interface.py`` docstring "softcap: float. Anything > 0 activates softcapping
  attention"; the kernel caps the scaled scores, ``softcap * tanh(q.k * softmax_scale / softcap)``,
  before the mask and softmax: ``flash_api.cpp`` sets ``params.softcap = softmax_scale / softcap``
  and ``params.scale_softmax = softcap``); 0.0 (its default): off.
* :class:`TEDotProductAttentionStandIn`: Megatron 0.16.1's ``TEDotProductAttention``
  constructor and ``forward`` signature (checked against the installed source by the tests);
  it forwards the base ``PackedSeqParams`` fields as TE's ``DotProductAttention`` receives them
  and decides ``pad_between_seqs`` with TE 2.10's own expression (``torch.equal`` on the
  device tensors: a host sync when ``cu_seqlens_*_padded`` are given and not one view of one
  storage; the cache gives none). Reads the RNG tracker as TE does (Megatron's getter if its
  tracker is initialized, none with sequence parallelism) and asserts, as TE 2.10's forward does
  while TE's capture flag is set, that it is TE's ``CudaRNGStatesTracker`` and that torch has
  graph-safe RNG (at any CP size, with or without dropout). Without context parallelism it
  computes on the device only (``_te_thd_attention``: the row mask of ``graph_safe_standins``
  from ``cu_seqlens`` by ``searchsorted``, one masked SDPA, TE's ``window_size``), so a CUDA
  graph captures forward and backward and replays any packing.
  With context parallelism (``config.context_parallel_size`` > 1) it also takes the CP
  arguments Megatron's constructor hands TE (group, global ranks, stream, comm type), asserts
  TE 2.9-2.11's THD + CP contract at every call (each assertion cites the TE source line it
  mirrors; the message is TE's) and computes the result for real: K/V all-gathered over the
  CP group (the package's ``all_gather_cp``, as the ``sdpa`` backend), every local query
  attending its own sequence causally at global positions -- the layout derived from what TE
  is given only (global ``cu_seqlens`` and the rank), TE's DualChunkSwap order. The mask is
  built on the device (static shapes, ``searchsorted``), so a CUDA graph captures the call and
  replays it over any packing; the stand-in's own checks of ``cu_seqlens`` values (host reads)
  run on eager calls only (real TE checks none of these values: its THD + CP p2p path reads no
  device value on the host, see ``_te_thd_cp_attention``).
* :func:`te_apply_rotary_pos_emb`: TE's ``apply_rotary_pos_emb`` keywords, computed with
  Megatron's ``_apply_rotary_pos_emb_bshd`` (the unfused reference).

Host reads of ``cu_seqlens`` happen inside the stand-ins only (a real kernel reads them on the
device). Those of the stand-ins the GPU path runs (TE's THD attention, with and without CP) are
the stand-ins' own checks and run :func:`unseen_by_the_sync_sentinel`, so the package's sync
sentinel counts what a GPU run would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.nn.functional as F


def _window_mask(n: int, window, device=None):
    """[n, n] bool of one sequence (s_q = s_k = n): causal, and inside flash-attn / TE's
    ``window_size=(left, right)`` -- key j of query i iff i - left <= j <= i + right (-1:
    unbounded); None when the window bounds nothing."""
    left, right = window
    if left < 0 and right < 0:
        return None
    i = torch.arange(n, device=device)
    back = i[:, None] - i[None, :]  # i - j
    keep = back >= 0
    if left >= 0:
        keep &= back <= left
    if right >= 0:
        keep &= -back <= right
    return keep


def _softcapped(q, k, v, keep, scale, cap):
    """[h, n, d] attention with scores cap * tanh(q.k * scale / cap), causal within ``keep``."""
    n = q.shape[1]
    if keep is None:
        i = torch.arange(n, device=q.device)
        keep = i[:, None] >= i[None, :]
    scores = torch.tanh(q @ k.transpose(-2, -1) * scale / cap) * cap
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1, dtype=torch.float32)
    return probs.to(q.dtype) @ v


def _varlen_reference(q, k, v, cu, max_seqlen, scale, window=(-1, -1), softcap=0.0):
    """Causal attention per sequence (within ``window``); NaN on rows outside every sequence."""
    out = torch.full_like(q, float("nan"))
    bounds = cu.tolist()
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        if b - a > max_seqlen:
            raise RuntimeError(f"sequence of {b - a} tokens > max_seqlen={max_seqlen}")
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        keep = _window_mask(b - a, window, q.device)
        if softcap > 0:
            out[a:b] = _softcapped(qs, ks, vs, keep, scale, softcap).transpose(0, 1)
            continue
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, is_causal=keep is None,
                                                  scale=scale).transpose(0, 1)
    return out


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, max_seqlen, scale, window=(-1, -1), softcap=0.0):
        ctx.save_for_backward(q, k, v, cu_q)
        ctx.max_seqlen, ctx.scale, ctx.window, ctx.softcap = max_seqlen, scale, window, softcap
        return _varlen_reference(q, k, v, cu_q, max_seqlen, scale, window, softcap)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu = ctx.saved_tensors
        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))  # empty_like in FA2
        bounds = cu.tolist()
        for a, b in zip(bounds, bounds[1:]):
            if b <= a:
                continue
            with torch.enable_grad():
                xs = [x[a:b].detach().requires_grad_(True) for x in (q, k, v)]
                o = _varlen_reference(*xs, torch.tensor([0, b - a]), ctx.max_seqlen, ctx.scale,
                                      ctx.window, ctx.softcap)
                g = torch.autograd.grad(o, xs, dout[a:b])
            dq[a:b], dk[a:b], dv[a:b] = g
        return dq, dk, dv, None, None, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    assert causal and dropout_p == 0.0
    assert len(window_size) == 2 and all(isinstance(w, int) and w >= -1 for w in window_size), \
        f"flash-attn window_size is (left, right), each -1 or >= 0; got {window_size!r}"
    assert isinstance(softcap, (int, float)) and softcap >= 0, f"softcap >= 0; got {softcap!r}"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _FlashVarlen.apply(q, k, v, cu_seqlens_q, max_seqlen_q, scale, tuple(window_size),
                              float(softcap))


def fake_flash_attn_module() -> types.ModuleType:
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.__version__ = "2.8.3"
    return mod


def _new_cuda_stream():
    """``torch.cuda.Stream()`` (the CUDA-as-CPU mode's fake stream), or a placeholder where no
    CUDA stand-in is installed (a unit test on a CPU build)."""
    try:
        return torch.cuda.Stream()
    except (RuntimeError, AssertionError, AttributeError):
        return object()


# TE's cp_comm_type values: anything else ends in attn_forward_func_with_cp's
# ValueError("Unsupported communication type: ...") (context_parallel.py v2.10/2.11 L4108, v2.9 L3888)
TE_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class TEDotProductAttentionStandIn(torch.nn.Module):
    """Megatron 0.16.1 ``TEDotProductAttention`` signature over device-only packed attention
    (capturable; equal to the varlen reference); with CP, TE 2.9-2.11's THD + CP contract
    asserted and attention computed over all-gathered K/V.

    Line numbers below are of the TE tags v2.9 / v2.10 / v2.11 (transformer_engine/pytorch/
    attention/dot_product_attention/: dpa = dot_product_attention.py, be = backends.py,
    cp = context_parallel.py, ut = utils.py) and of megatron-core 0.16.1
    (megatron/core/extensions/transformer_engine.py, "mcore")."""

    calls: list = []
    cp_stream = None  # mcore L1149: one stream shared by every layer (class attribute)

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 num_splits=None, cp_comm_type="p2p", pg_collection=None):
        super().__init__()
        from megatron.core.packed_seq_params import PackedSeqParams

        self.config, self.softmax_scale = config, softmax_scale
        # Megatron's constructor hands TE window_size=config.window_size on the layers
        # is_layer_window_attention marks (mcore L1262-1270); TE's check_set_window_size
        # (dot_product_attention/utils.py) takes (-1, 0) or (>= 0, 0) with causal masks, and
        # DotProductAttention keeps for query i the keys in [i + s_k - s_q - window_size[0],
        # i + s_k - s_q + window_size[1]] (its window_size docstring; s_k = s_q here)
        from megatron.core.transformer.utils import is_layer_window_attention

        self.window_size = (-1, 0)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            assert right == 0 and (left == -1 or left >= 0), \
                f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=padding_causal; got {config.window_size}"
            self.window_size = (left, right)
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # the RNG tracker, read as TE reads it: Megatron's constructor hands TE
        # get_rng_state_tracker=get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized()
        # else None, and sequence_parallel=config.sequence_parallel (mcore L1323-1327); TE's
        # __init__ keeps none with sequence parallelism or no getter, else calls the getter once
        # (dpa v2.10 L382-388: self.rng_states_tracker = get_rng_state_tracker())
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        getter = get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None
        self.rng_states_tracker = None
        if not (config.sequence_parallel or getter is None):
            self.rng_states_tracker = getter()
        self.kept = [f.name for f in dataclasses.fields(PackedSeqParams)
                     if f.name not in ("cp_group", "local_cp_size")]
        # TE DotProductAttention.__init__ defaults (dpa v2.10 L333-336): no CP, "p2p"
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = None, None, None, "p2p"
        # Megatron's constructor (mcore L1198-1252), mirrored: at CP > 1 TE gets pg_collection's
        # CP group, its global ranks, the shared stream and cp_comm_type (None -> "p2p";
        # "a2a+p2p" -> the hierarchical groups)
        if pg_collection is None:
            from megatron.core import parallel_state as ps

            cp_group = ps.get_context_parallel_group(check_initialized=False)
            hcp = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
        else:
            assert hasattr(pg_collection, "cp"), "TEDotProductAttention pg_collection must have cp pg"
            cp_group, hcp = pg_collection.cp, getattr(pg_collection, "hcp", None)
        if config.context_parallel_size > 1:
            if TEDotProductAttentionStandIn.cp_stream is None:
                TEDotProductAttentionStandIn.cp_stream = _new_cuda_stream()
            self.cp_group = cp_group
            self.cp_global_ranks = torch.distributed.get_process_group_ranks(cp_group)
            self.cp_stream = TEDotProductAttentionStandIn.cp_stream
            if cp_comm_type is None:
                self.cp_comm_type = "p2p"
            elif cp_comm_type == "a2a+p2p":
                self.cp_comm_type, self.cp_group = "a2a+p2p", hcp
            else:
                self.cp_comm_type = cp_comm_type

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """TE's ``DotProductAttention.set_context_parallel_group`` (dpa v2.10 L529-568)."""
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        from megatron.core.transformer.enums import AttnMaskType

        kw = {k: getattr(packed_seq_params, k) for k in self.kept}
        assert kw["qkv_format"] == "thd" and attention_mask is None
        # TE DotProductAttention.forward's first check (dpa v2.10 L1009-1016), at any CP size and
        # dropout: while TE's capture flag is set, a tracker must be TE's CudaRNGStatesTracker
        # (Megatron's TECudaRNGStatesTracker subclasses it) and torch must have graph-safe RNG
        if self.rng_states_tracker is not None and _te_graph_capturing():
            assert isinstance(self.rng_states_tracker, _te_cuda_rng_states_tracker_cls()), \
                "Unsupported RNG states tracker."
            assert _graph_safe_rng_available(), \
                "Upgrade PyTorch version to get RNG manipulation support for cuda graph capture."
        # Megatron's forward (mcore L1347-1353): params carrying a cp_group reset TE's group
        assert getattr(packed_seq_params, "cp_group", None) is None, "the cache passes no cp_group"
        # ... and its THD mask conversion (mcore L1397-1404): causal -> padding_causal
        if attn_mask_type == AttnMaskType.causal:
            attn_mask_type = AttnMaskType.padding_causal
        elif attn_mask_type == AttnMaskType.no_mask:
            attn_mask_type = AttnMaskType.padding
        # TE DotProductAttention.forward (dpa v2.10 L1298-1307), verbatim logic; torch.equal as
        # on CUDA (pytorch aten/src/ATen/native/cuda/Equal.cpp: the same view of one storage
        # is equal without a device read, anything else reads back, a host sync)
        pad_between_seqs = (
            kw["cu_seqlens_q_padded"] is not None
            and not _cuda_equal(kw["cu_seqlens_q_padded"][:-1], kw["cu_seqlens_q"][:-1])
        ) or (
            kw["cu_seqlens_kv_padded"] is not None
            and not _cuda_equal(kw["cu_seqlens_kv_padded"][:-1], kw["cu_seqlens_kv"][:-1])
        )
        type(self).calls.append((attn_mask_type.name, pad_between_seqs))
        scale = self.softmax_scale or query.shape[-1] ** -0.5
        if _group_size(self.cp_group) > 1:
            out = _te_thd_cp_attention(self, query, key, value, attn_mask_type.name, kw,
                                       pad_between_seqs, scale)
            return out.reshape(out.shape[0], -1)
        out = _te_thd_attention(query, key, value, kw, scale, self.window_size)
        return out.reshape(out.shape[0], -1)


def _cuda_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` as CUDA answers it (aten/src/ATen/native/cuda/Equal.cpp ``cuda_equal``),
    in its order: different sizes -> false and no elements -> true, both without reading the
    device; true for two identical views of one storage (its alias fast path); else
    ``eq(a, b).all().item()``, a comparison read back (a host sync)."""
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    if (a.is_alias_of(b) and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype
            and a.stride() == b.stride()):
        return True
    return torch.equal(a, b)


def _te_graph_capturing() -> bool:
    """TE's ``is_graph_capturing()`` (graph.py v2.10 L52-54: its ``_IS_GRAPH_CAPTURING``, set by
    ``make_graphed_callables`` and by ``set_capture_start``). Megatron's local capture
    (``cuda_graph_impl="local"``) calls ``te_set_capture_start()`` along with its own flag
    whenever the captured layers hold a TE module (mcore 0.16.1 transformer/cuda_graphs.py
    L363-369, L396-398, L467-469), and TE's ``DotProductAttention`` is one (dpa v2.10 L154,
    ``class DotProductAttention(TransformerEngineBaseModule)``): so for the layer this stand-in
    sits in, TE's flag is Megatron's (``cuda_graphs.is_graph_capturing()``), or TE's own where
    (the fake) TE is imported. A bare ``torch.cuda.graph`` capture sets neither, as on a GPU."""
    import sys

    from megatron.core.transformer import cuda_graphs

    if cuda_graphs.is_graph_capturing():
        return True
    te_graph = sys.modules.get("transformer_engine.pytorch.graph")
    return te_graph is not None and te_graph.is_graph_capturing()


def _te_cuda_rng_states_tracker_cls():
    """TE's ``CudaRNGStatesTracker`` (distributed.py v2.10 L776; dpa v2.10 L41-46 imports it),
    or, without TE importable, a class no tracker is an instance of (Megatron then builds its
    own tracker: ``TECudaRNGStatesTracker`` needs TE, random.py ``initialize_rng_tracker``)."""
    try:
        from transformer_engine.pytorch.distributed import CudaRNGStatesTracker
    except ImportError:
        return type("NoTransformerEngineTracker", (), {})
    return CudaRNGStatesTracker


def _graph_safe_rng_available() -> bool:
    """TE's ``graph_safe_rng_available()`` (distributed.py v2.10 L83-90), its expression."""
    return (hasattr(torch.cuda.CUDAGraph, "register_generator_state")
            and hasattr(torch.Generator, "graphsafe_set_state")
            and hasattr(torch.Generator, "graphsafe_get_state")
            and hasattr(torch.Generator, "clone_state"))


def _te_thd_attention(q, k, v, kw, scale, window):
    """TE's THD self-attention at CP = 1, on the device only: each row's sequence from
    ``cu_seqlens_q`` (``searchsorted``), one masked SDPA over the packed rows
    (``graph_safe_standins.flash_attn_varlen_func``), autograd through it -- no host read in
    forward or backward, so a CUDA graph captures it and replays any packing held in the same
    cu_seqlens buffer, as TE's fused / flash THD kernels read cu_seqlens on the device. Keys of
    query i: its own sequence's within TE's ``window_size`` (dpa v2.10 docstring: [i + s_k - s_q
    - window_size[0], i + s_k - s_q + window_size[1]], s_k = s_q here; (-1, 0): causal). GQA by
    head repetition. Rows outside every sequence: NaN (uninitialised; the cache closes the
    tail at T, so there are none). The stand-in's own check that no sequence exceeds
    ``max_seqlen_q`` (a host read; TE checks no cu_seqlens value) runs on eager calls only."""
    from tests.support.graph_safe_standins import flash_attn_varlen_func

    cu, max_seqlen = kw["cu_seqlens_q"], kw["max_seqlen_q"]
    if not _capturing() and max_seqlen is not None:
        with unseen_by_the_sync_sentinel():
            longest = max((cu[1:] - cu[:-1]).tolist(), default=0)
        if longest > max_seqlen:
            raise RuntimeError(f"sequence of {longest} tokens > max_seqlen={max_seqlen}")
    return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale,
                                  causal=True, window_size=tuple(window))


@contextlib.contextmanager
def unseen_by_the_sync_sentinel():
    """Run a stand-in's own check -- host reads the real library does not make (TE reads no
    cu_seqlens value on the host) -- outside every torch function and dispatch mode, so the
    package's sync sentinel counts what a GPU run would: none of it. Only on eager calls (a
    host read during a capture still raises in the fake CUDA graph: callers check
    ``_capturing()`` first)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def _capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` (the fake CUDA graph answers it in the
    stand-ins); False on a CPU build of torch outside them, where it raises."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):
        return False


def _group_size(group) -> int:
    """TE's CP size (dpa v2.10 L1208-1214): the group's size, the product over a list."""
    if group is None:
        return 1
    if isinstance(group, list):
        n = 1
        for g in group:
            n *= torch.distributed.get_world_size(g)
        return n
    return torch.distributed.get_world_size(group)


def _te_thd_cp_attention(layer, q, k, v, mask_type, kw, pad_between_seqs, scale):
    """TE 2.9-2.11's THD + CP call, its contract asserted (TE's messages), computed on the CPU.

    Not modelled (asserted away): dropout, attention bias, sliding windows, padding between
    sequences (``pad_between_seqs``), non-causal masks -- none of which the cache's call uses."""
    import torch.distributed as dist

    from megatron_fastpath.attention.context_parallel import all_gather_cp

    group, ranks, stream, comm = layer.cp_group, layer.cp_global_ranks, layer.cp_stream, layer.cp_comm_type
    cu_q, cu_kv = kw["cu_seqlens_q"], kw["cu_seqlens_kv"]
    # -- DotProductAttention.forward's THD checks (dpa v2.10/2.11 L1106-1123, v2.9 L1081-1098)
    assert all(x.dim() == 3 for x in (q, k, v)), \
        "Queries, keys and values must be 3D tensors when qkv_format = thd!"
    assert "padding" in mask_type, \
        "Attention mask type must be padding or padding_causal for qkv_format=thd!"
    assert cu_q is not None and cu_kv is not None, \
        "cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd!"
    assert cu_q.shape == cu_kv.shape and cu_q.dim() == 1 and cu_kv.dim() == 1, \
        "cu_seqlens_q and cu_seqlens_q must both have shape [batch_size + 1]!"
    assert cu_q.dtype == torch.int32 and cu_kv.dtype == torch.int32, \
        "cu_seqlens_q and cu_seqlens_q must both be in dtype torch.int32!"
    # max_seqlen None makes TE read the lengths back (dpa v2.10 L1125-1136: .item(), a host
    # sync); the cache passes its static bound
    assert kw["max_seqlen_q"] is not None and kw["max_seqlen_kv"] is not None, \
        "max_seqlen_q/kv None: TE reads the lengths back with .item() (a host sync)"
    # -- backend selection (ut v2.10 L761-830): with CP no backend takes bottom-right causal
    # masks or causal cross-attention (max_seqlen_q != max_seqlen_kv): "No dot product
    # attention backend is available"
    assert "bottom_right" not in mask_type and kw["max_seqlen_q"] == kw["max_seqlen_kv"], \
        "No dot product attention backend is available for the provided inputs."
    # -- FusedAttention.forward fills absent padded boundaries with cu_seqlens (be v2.10/2.11
    # L1834-1837, v2.9 L1819-1822); FlashAttention passes cu_seqlens as them (be v2.10 L878-879)
    padded_q = cu_q if kw["cu_seqlens_q_padded"] is None else kw["cu_seqlens_q_padded"]
    padded_kv = cu_kv if kw["cu_seqlens_kv_padded"] is None else kw["cu_seqlens_kv_padded"]
    # -- attn_forward_func_with_cp (cp v2.10/2.11 L3986-4021, v2.9 L3766-3801)
    if comm == "a2a+p2p":
        assert isinstance(group, list) and len(group) == 2, \
            "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!"
        assert False, "thd format is not supported with hierarchical CP implementation yet!"
    assert isinstance(group, dist.ProcessGroup), \
        f"cp_group must be {dist.ProcessGroup} type for {comm=}!"
    assert padded_q is not None and padded_kv is not None, \
        "cu_seqlens_padded can not be None for context parallelism and qkv_format = 'thd'!"
    if comm not in TE_CP_COMM_TYPES:  # cp v2.10/2.11 L4108, v2.9 L3888
        raise ValueError(f"Unsupported communication type: {comm}!")
    # all_gather refuses THD in every version (cp v2.10/2.11 L2842, v2.9 L2670); a2a in 2.9
    # (cp v2.9 L3193; 2.10 added THD to a2a): what runs THD across 2.9-2.11 is p2p
    assert comm == "p2p", "thd format is not supported!"
    # -- AttnFuncWithCPAndKVP2P.forward: ring peers from cp_global_ranks (cp v2.10 L1294, v2.9
    # L1122), the second compute stream cp_stream (cp v2.10 L1524, v2.9 L1352)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    assert ranks is not None and len(ranks) == cp and ranks == dist.get_process_group_ranks(group), \
        "cp_global_ranks must list the global ranks of cp_group (the P2P ring's send/recv peers)"
    assert stream is not None, "cp_stream is None: the P2P ring overlaps on a second stream"
    # not modelled here (the cache's call has none of them)
    assert not pad_between_seqs and "causal" in mask_type and (layer.attention_dropout == 0.0 or not layer.training), \
        "stand-in: only causal attention without padding between sequences or dropout"
    assert k.shape[0] == v.shape[0] == q.shape[0], "q, k, v hold different token counts"
    # -- the DualChunkSwap layout TE assumes (cp v2.10 L3930-3931, docstring: "requires sequence
    # lengths to be, or are padded to be, divisible by (cp_size * 2)"; ut v2.10 L761): the P2P
    # steps divide the boundaries by CP and 2 x CP (cp v2.10 L1323-1327, L707, L743) -- silently
    # wrong otherwise. The tokens each rank holds: T / CP of the global T (TE's
    # thd_get_partitioned_indices / get_batch_on_this_cp_rank, cp v2.10 L4226-4320).
    # These are checks of device VALUES, the stand-in's own: real TE checks none of them, and
    # its THD + CP p2p path (bf16) reads no device value on the host -- cu_seqlens are divided
    # on the device (cp v2.9-2.11 cp_p2p_fwd_prepare_qkv: ``cu_seqlens_q // cp_size``), handed
    # as device pointers to tex.thd_read_half_tensor / thd_out_correction /
    # thd_second_half_lse_correction (pytorch/csrc/extensions/attention.cpp: shapes only) and to
    # fused_attn_fwd/bwd, which TE 2.10-2.11 call with cuda_graph=is_graph_capturing() (cp
    # L888, L1151); the ring is NCCL isend/irecv plus stream / event waits. So the checks run on
    # eager calls and are skipped while a CUDA graph is being captured (a host read there
    # invalidates a real capture; the fake graph raises): the layout is then not checked at
    # all, as on real TE.
    if not _capturing():
        with unseen_by_the_sync_sentinel():  # host reads of the stand-in's own
            lens = (padded_q[1:] - padded_q[:-1]).tolist()
            same = padded_q.tolist() == padded_kv.tolist()
            total = int(padded_q[-1])
        assert all(n % (2 * cp) == 0 for n in lens) and same, \
            f"sequence lengths must be divisible by 2 x cp_size = {2 * cp}: {lens}"
        # the local rows may run past the last sequence: TE takes a THD tensor longer than
        # cu_seqlens[-1] and zero-fills its output first (pytorch/csrc/extensions/attention.cpp
        # v2.10/2.11 L157-159, v2.9 L152-154: te_O.zero_() for bf16 / fp16 THD). The cache's
        # batches fill every row; Megatron's graph warm-up calls each layer with zeroed inputs
        # (transformer/cuda_graphs.py create_fwd_graph, mcore L911-914: zeros_like) -- every
        # cu_seqlens 0, every row past the last sequence
        assert total <= q.shape[0] * cp, \
            f"this CP rank holds {q.shape[0]} tokens, not the global {total} / cp_size {cp}"
        assert max(lens) <= kw["max_seqlen_q"], f"a sequence of {max(lens)} > max_seqlen_q"
    # -- the result: K/V all-gathered (rank order), each local query attends its own sequence's
    # keys at global positions <= its own -- the layout from cu_seqlens and the rank alone,
    # built on the device (static shapes, no host read: capturable, replays any packing)
    k_all, v_all = all_gather_cp(k, group), all_gather_cp(v, group)
    allowed_TK = _dual_chunk_swap_mask(padded_q, cp, rank, q.shape[0])
    mask_TK = torch.zeros(allowed_TK.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~allowed_TK, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k_all.transpose(0, 1).unsqueeze(0),
        v_all.transpose(0, 1).unsqueeze(0), attn_mask=mask_TK, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    out = out.squeeze(0).transpose(0, 1)
    # rows past the last sequence: TE's zero-filled output (see above), on the device
    inside_T = _dual_chunk_swap_inside(padded_q, cp, rank, q.shape[0])
    return torch.where(inside_T[:, None, None], out, torch.zeros_like(out))


def _dual_chunk_swap_inside(cu_C: torch.Tensor, cp: int, rank: int, local: int) -> torch.Tensor:
    """[T_l] bool: local row i holds a token of a sequence of ``cu_C`` (not past the last one)."""
    return torch.arange(local, dtype=torch.int64, device=cu_C.device) < cu_C[-1].to(torch.int64) // cp


def _dual_chunk_swap_mask(cu_C: torch.Tensor, cp: int, rank: int, local: int) -> torch.Tensor:
    """[T_l, CP x T_l] bool: local query i may attend gathered key j (same piece of ``cu_C``,
    j's global index <= i's). Device ops only: each global token g of piece s (start a, length
    n, chunk c = n / 2CP) lies in chunk h = (g - a) // c, held by rank h (h < CP) or 2CP-1-h,
    at local index a / CP + (g - a) - h c (+ c for the second chunk): TE's order. The rows past
    ``cu_C[-1]`` (each rank's last ones) count as one more piece, so the map stays a
    permutation; their output is zeroed by the caller."""
    t = local * cp
    g = torch.arange(t, dtype=torch.int64, device=cu_C.device)
    cu = torch.cat([cu_C.to(torch.int64), torch.full((1,), t, dtype=torch.int64, device=cu_C.device)])
    seq = torch.searchsorted(cu[1:].contiguous(), g, right=True).clamp_(max=cu.numel() - 2)
    a, n = cu[seq], cu[seq + 1] - cu[seq]
    c = (n // (2 * cp)).clamp_(min=1)
    h = (g - a) // c
    first = h < cp
    owner = torch.where(first, h, 2 * cp - 1 - h)
    pos = a // cp + (g - a) - h * c + torch.where(first, 0, c)
    global_of = torch.empty(t, dtype=torch.int64, device=cu.device)
    global_of[owner * local + pos] = g  # gathered index -> global index
    g_q = global_of[rank * local:(rank + 1) * local]
    return (seq[g_q][:, None] == seq[global_of][None, :]) & (global_of[None, :] <= g_q[:, None])


def te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                            interleaved=False, fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    assert tensor_format == "sbhd" and freqs.dtype == torch.float32 and freqs.dim() == 4
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
