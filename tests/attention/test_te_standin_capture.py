"""The TE attention stand-in (``tests/support/gpu_standins.TEDotProductAttentionStandIn``) at
context-parallel size 1: device-only attention equal to the varlen reference, captured in a
(fake) CUDA graph without a host read and replayed over another packing in the same
cu_seqlens buffer, as TE's THD kernels (which read cu_seqlens on the device) are; and TE
2.10's capture-time check of the RNG tracker class (dot_product_attention.py L1009-1016)."""

import types

import pytest
import torch

from tests.support import gpu_standins
from tests.support.gpu_standins import TEDotProductAttentionStandIn

T, HEADS, KV_HEADS, DIM = 24, 4, 2, 8
SCALE = 0.3
PACKINGS = {  # one static buffer of 5 sequences + 1 (empty ones close at T, as the cache's)
    "a": [0, 5, 12, 20, 24, 24],
    "b": [0, 3, 4, 13, 18, 24],
}
WINDOWS = [(-1, 0), (2, 0)]


def _config(window=(-1, 0), sequence_parallel=False):
    # what the stand-in's constructor reads of Megatron's TransformerConfig
    return types.SimpleNamespace(window_size=None if window == (-1, 0) else window,
                                 window_attn_skip_freq=None, attention_dropout=0.0,
                                 context_parallel_size=1, sequence_parallel=sequence_parallel)


def _layer(window=(-1, 0), sequence_parallel=False):
    from megatron.core.transformer.enums import AttnMaskType

    layer = TEDotProductAttentionStandIn(
        _config(window, sequence_parallel), layer_number=1,
        attn_mask_type=AttnMaskType.padding_causal, attention_type="self", softmax_scale=SCALE,
        pg_collection=types.SimpleNamespace(cp=None))
    assert layer.window_size == window
    return layer


def _params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=T, max_seqlen_kv=T)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


def _call(layer, q, k, v, cu):
    from megatron.core.transformer.enums import AttnMaskType

    out = layer(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal,
                packed_seq_params=_params(cu))
    return out.view(T, HEADS, DIM)


def _eager(layer, cu, seed):
    q, k, v, dout = (x.requires_grad_(i < 3) for i, x in enumerate(_inputs(seed)))
    out = _call(layer, q, k, v, cu)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _reference(cu, seed, window):
    q, k, v, dout = (x.requires_grad_(i < 3) for i, x in enumerate(_inputs(seed)))
    out = gpu_standins.flash_attn_varlen_func(q, k, v, cu, cu, T, T, softmax_scale=SCALE,
                                              causal=True, window_size=window)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


@pytest.fixture(autouse=True)
def _calls(monkeypatch):
    monkeypatch.setattr(TEDotProductAttentionStandIn, "calls", [])


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("packing", sorted(PACKINGS))
def test_cp1_equals_the_varlen_reference(packing, window):
    """Output and q / k / v gradients (GQA, a softmax scale, TE's window) equal the per-sequence
    reference's (``gpu_standins._varlen_reference`` through ``flash_attn_varlen_func``)."""
    cu = torch.tensor(PACKINGS[packing], dtype=torch.int32)
    got, ref = _eager(_layer(window), cu, 1), _reference(cu, 1, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert TEDotProductAttentionStandIn.calls == [("padding_causal", False)]


def test_cp1_window_changes_the_result():
    """The window is honoured (a window of 2 differs from plain causal on a long sequence)."""
    cu = torch.tensor(PACKINGS["a"], dtype=torch.int32)
    assert not torch.allclose(_eager(_layer((2, 0)), cu, 1)[0], _eager(_layer(), cu, 1)[0])


def test_cp1_longer_than_max_seqlen_refused_on_eager_calls():
    """The stand-in's own check (a host read, eager calls only), as the reference's."""
    layer, (q, k, v, _) = _layer(), _inputs(1)
    cu = torch.tensor(PACKINGS["a"], dtype=torch.int32)
    params = _params(cu)
    params.max_seqlen_q = params.max_seqlen_kv = 7
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(RuntimeError, match="sequence of 8 tokens > max_seqlen=7"):
        layer(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_cp1_captures_forward_and_backward_and_replays_another_packing(window):
    """Under the fake CUDA graph (a host read during capture raises HostReadDuringCapture):
    forward and backward (``torch.autograd.grad``, as Megatron's create_bwd_graph) capture; a
    replay after copying another packing into the same static cu_seqlens buffer (and new
    q / k / v / dout into theirs) gives the eager result of that packing. The per-sequence
    reference, by contrast, reads cu_seqlens on the host and cannot be captured."""
    from tests.support.fake_cuda_graph import HostReadDuringCapture
    from tests.support.megatron_graphs import graph_session

    layer = _layer(window)
    with graph_session():
        cu = torch.tensor(PACKINGS["a"], dtype=torch.int32)
        q, k, v, dout = _inputs(1)
        for x in (q, k, v):
            x.requires_grad_(True)
        fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd):
            out = _call(layer, q, k, v, cu)
        bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bwd):
            grads = torch.autograd.grad(out, (q, k, v), dout)
        assert len(TEDotProductAttentionStandIn.calls) == 1
        for packing, seed in (("b", 2), ("a", 3)):
            with torch.no_grad():
                cu.copy_(torch.tensor(PACKINGS[packing], dtype=torch.int32))
                for static, new in zip((q, k, v, dout), _inputs(seed)):
                    static.copy_(new)
            fwd.replay()
            bwd.replay()
            expected = _eager(_layer(window), torch.tensor(PACKINGS[packing], dtype=torch.int32), seed)
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), expected):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{packing} {name}")
            ref = _reference(torch.tensor(PACKINGS[packing], dtype=torch.int32), seed, window)
            torch.testing.assert_close(out.detach(), ref[0], rtol=1e-5, atol=1e-5)
        assert len(TEDotProductAttentionStandIn.calls) == 1 + 2  # replays ran no Python

        g = torch.cuda.CUDAGraph()
        with pytest.raises(HostReadDuringCapture, match="Tensor.tolist"):
            with torch.cuda.graph(g):
                gpu_standins.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True)


# ----------------------------------------------------------------- TE's RNG tracker check
@pytest.fixture
def megatron_tracker(monkeypatch):
    """Megatron's own tracker, initialized (a seed added), as after model_parallel_cuda_manual_seed
    without TE; restored after the test."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker._is_initialized = True  # what add() sets
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", tracker)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    return tracker


@pytest.fixture
def megatron_capturing(monkeypatch):
    """Megatron's capture flag (set by create_cudagraphs around every capture, with TE's own
    when the layers hold a TE module, as TE's DotProductAttention is)."""
    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "_IS_GRAPH_CAPTURING", True)


def _run(layer):
    q, k, v, _ = _inputs(1)
    return _call(layer, q, k, v, torch.tensor(PACKINGS["a"], dtype=torch.int32))


def test_te_rng_check_refuses_megatrons_tracker_during_capture(megatron_tracker, megatron_capturing):
    """TE 2.10 dot_product_attention.py L1010-1013: while TE's capture flag is set, a tracker
    that is not TE's CudaRNGStatesTracker fails "Unsupported RNG states tracker." -- with every
    dropout 0 (the check does not look at dropout)."""
    layer = _layer()
    assert layer.rng_states_tracker is megatron_tracker and layer.attention_dropout == 0.0
    with pytest.raises(AssertionError, match="^Unsupported RNG states tracker.$"):
        _run(layer)


def test_te_rng_check_only_while_capturing(megatron_tracker):
    """Eager calls (TE's capture flag unset) take any tracker."""
    _run(_layer())


def test_te_rng_check_skipped_without_a_tracker(megatron_tracker, megatron_capturing, monkeypatch):
    """TE keeps no tracker with sequence parallelism (dpa L383) or when Megatron hands it no
    getter, i.e. its tracker is not initialized (mcore L1325-1327): no check."""
    layer = _layer(sequence_parallel=True)
    assert layer.rng_states_tracker is None
    _run(layer)
    megatron_tracker._is_initialized = False
    layer = _layer()
    assert layer.rng_states_tracker is None
    _run(layer)


def test_te_rng_check_takes_tes_tracker_with_graph_safe_rng(megatron_capturing, monkeypatch):
    """A tracker of TE's class passes the class check (here: the fake TE's CudaRNGStatesTracker,
    standing in for TE's); the second assert (dpa L1014-1016) needs graph-safe RNG, which the
    fake CUDA graph's CUDAGraph has (register_generator_state) and a CPU build's does not."""
    from megatron.core.tensor_parallel import random as mrandom

    from tests.support.fake_te.transformer_engine.pytorch.distributed import CudaRNGStatesTracker
    from tests.support.fake_cuda_graph import fake_cuda_graphs

    class TETracker(CudaRNGStatesTracker):  # Megatron's TECudaRNGStatesTracker subclasses TE's
        def is_initialized(self):
            return True

    monkeypatch.setattr(gpu_standins, "_te_cuda_rng_states_tracker_cls", lambda: CudaRNGStatesTracker)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", TETracker())
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    layer = _layer()
    with fake_cuda_graphs():
        _run(layer)
    if not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        with pytest.raises(AssertionError, match="Upgrade PyTorch version to get RNG manipulation"):
            _run(layer)
