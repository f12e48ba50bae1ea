"""ActivationOffloadManager on synthetic tensors: TE quantized-tensor split/rebuild, do-not-offload
marks, deduplication, config / usage errors, and the two-stream timing model."""

from __future__ import annotations

import pytest
import torch

from megatron_fastpath.offload import (
    ActivationOffloadManager,
    BufferMode,
    OffloadConfig,
    RecordingDevice,
    TraceEvent,
)
from megatron_fastpath.offload.te_compat import is_quantized, never_offload
from megatron_fastpath.offload.timing import hidden_fraction, simulate_two_streams

CFG = dict(min_offload_bytes=0, headroom_margin_bytes=0)


class FakeFloat8:
    """Implements TE's save protocol like Float8TensorStorage: data [n] uint8 + transpose (or
    None) + scale_inv [1] fp32. ``prepare_for_saving`` hands the tensors out and drops them."""

    def __init__(self, data, transpose, scale_inv):
        self._data, self._transpose, self._scale_inv = data, transpose, scale_inv
        self.saved = 0

    def prepare_for_saving(self):
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        self.saved += 1
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, self._transpose, self._scale_inv = tensors[:3]
        return tensors[3:]

    def dequantize(self):
        return self._data.float() * self._scale_inv


def _manager(num_layers=3, **cfg):
    dev = RecordingDevice()
    mgr = ActivationOffloadManager(OffloadConfig(**{**CFG, **cfg}), device=dev)
    keys = [mgr.register_layer(i + 1) for i in range(num_layers)]
    return mgr, dev, keys


def _forward_backward(mgr, keys, tensors_per_layer):
    """Pack each layer's tensors in forward order, unpack them in backward order."""
    mgr.begin_step()
    groups, packed = [], []
    for key, tensors in zip(keys, tensors_per_layer):
        g = mgr.open_group(key)
        packed.append([mgr.pack(g, t) for t in tensors])
        mgr.close_group(g)
        groups.append(g)
    out = [None] * len(keys)
    for i in reversed(range(len(keys))):
        mgr.begin_backward(groups[i])
        out[i] = [mgr.unpack(p) for p in packed[i]]
        out[i] = [o.clone() if isinstance(o, torch.Tensor) else o for o in out[i]]
        mgr.end_backward(groups[i])
    return out, mgr.end_step(), packed


def test_quantized_tensor_split_offloaded_and_rebuilt():
    mgr, dev, keys = _manager()
    data = [torch.randint(0, 255, (256,), dtype=torch.uint8) for _ in keys]
    qts = [FakeFloat8(d.clone(), None, torch.tensor([0.5 + i])) for i, d in enumerate(data)]
    plain = [torch.randn(32) for _ in keys]
    expected = [q.dequantize() for q in qts]
    out, stats, packed = _forward_backward(mgr, keys, [[q, p] for q, p in zip(qts, plain)])
    for i in range(2):  # offloaded layers: rebuilt object, same values, data came from buffers
        q, p = out[i]
        assert q is qts[i] and q.saved == 1 and q._transpose is None
        assert torch.equal(q.dequantize(), expected[i]) and torch.equal(p, plain[i])
    # the last layer is never offloaded: its split parts stay the original tensors
    assert out[2][0] is qts[2] and torch.equal(out[2][0].dequantize(), expected[2])
    d2h = [e for e in dev.trace if e.op == "copy" and e.direction == "d2h"]
    assert {e.tag for e in d2h} == {"L1", "L2"}
    # per offloaded layer: uint8 data, fp32 scale_inv, fp32 plain tensor (transpose None)
    assert sorted(e.nbytes for e in d2h if e.tag == "L1") == [4, 128, 256]
    assert stats.layers_offloaded == 2 and stats.bytes_offloaded == stats.bytes_reloaded


def test_do_not_offload_marks_and_parameters_stay():
    mgr, dev, keys = _manager(num_layers=2)
    param = torch.nn.Parameter(torch.randn(64))
    marked_te = torch.randn(64)
    marked_te._TE_do_not_offload = True
    marked_mcore = torch.randn(64)
    marked_mcore.offloading_activation = False
    view_of_param = param[:32]
    normal = torch.randn(64)
    for t in (param, marked_te, marked_mcore, view_of_param):
        assert never_offload(t)
    assert not never_offload(normal) and not is_quantized(normal)
    g = mgr.open_group(keys[0])
    packed = [mgr.pack(g, t) for t in (param, marked_te, marked_mcore, view_of_param, normal)]
    assert packed[:4] == [param, marked_te, marked_mcore, view_of_param]  # passed through
    assert packed[4] is not normal
    mgr.close_group(g)
    assert [e.nbytes for e in dev.trace if e.op == "copy"] == [64 * 4]


def test_same_tensor_saved_twice_is_copied_once_and_small_ones_stay():
    mgr, dev, keys = _manager(num_layers=2, min_offload_bytes=1024)
    big, small = torch.randn(512), torch.randn(8)
    g = mgr.open_group(keys[0])
    p1, p2, p3 = mgr.pack(g, big), mgr.pack(g, big), mgr.pack(g, small)
    mgr.pack(g, big.t() if big.dim() == 2 else big.view(16, 32).t())  # non-contiguous: kept
    assert p3 is small and p1 == p2
    mgr.close_group(g)
    assert len(g.items) == 1 and g.nbytes == 2048
    assert [e.nbytes for e in dev.trace if e.op == "copy"] == [2048]


def test_group_layout_is_aligned_and_mixed_dtypes_roundtrip():
    mgr, dev, keys = _manager(num_layers=2, alignment_bytes=256)
    tensors = [torch.randn(3, 5), torch.randint(0, 9, (7,), dtype=torch.int64),
               torch.rand(11) > 0.5, torch.randn(4, 4, dtype=torch.bfloat16)]
    out, stats, _ = _forward_backward(mgr, keys, [tensors, [torch.randn(2)]])
    for a, b in zip(tensors, out[0]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    g_offsets = [0, 256, 512, 768]
    assert stats.bytes_offloaded == g_offsets[-1] + 32


def test_config_validation():
    with pytest.raises(ValueError, match="min_offload_bytes"):
        OffloadConfig(min_offload_bytes=-1)
    with pytest.raises(ValueError, match="headroom_margin_bytes"):
        OffloadConfig(headroom_margin_bytes=1.5)
    with pytest.raises(ValueError, match="alignment_bytes"):
        OffloadConfig(alignment_bytes=48)
    with pytest.raises(ValueError, match="copy_bandwidth"):
        OffloadConfig(copy_bandwidth_bytes_per_s=0)
    with pytest.raises(TypeError, match="OffloadConfig"):
        ActivationOffloadManager({"enabled": True})
    with pytest.raises(TypeError, match="OffloadDevice"):
        ActivationOffloadManager(OffloadConfig(), device="cuda")


def test_usage_errors():
    mgr, dev, keys = _manager(num_layers=2)
    with pytest.raises(ValueError, match="not registered"):
        mgr.open_group("L9")
    with pytest.raises(ValueError, match="registered twice"):
        mgr.register_layer(1)
    g = mgr.open_group(keys[0])
    p = mgr.pack(g, torch.randn(16))
    mgr.close_group(g)
    with pytest.raises(RuntimeError, match="before its backward started"):
        mgr.unpack(p)


def test_begin_step_drops_a_pass_without_backward():
    """A forward whose backward never ran (e.g. an aborted micro-batch) must not leak pool slots,
    buffers or pending reloads into the next step."""
    mgr, dev, keys = _manager(num_layers=3)
    mgr.begin_step()
    for k in keys:
        g = mgr.open_group(k)
        mgr.pack(g, torch.randn(64))
        mgr.close_group(g)
    mgr.end_step()
    out, stats, _ = _forward_backward(mgr, keys, [[torch.full((64,), float(i))] for i in range(3)])
    assert [o[0][0].item() for o in out] == [0.0, 1.0, 2.0]
    assert stats.layers_offloaded == 2 and mgr.host_pool_bytes == 2 * 256
    assert stats.prefetched_reloads == 2 and stats.just_in_time_reloads == 0


def test_device_buffer_oom_falls_back():
    """alloc_device fails even though the statistics said it fits: next mode down."""
    mgr, dev, keys = _manager(num_layers=3)

    calls = {"n": 0}
    real = dev.alloc_device

    def flaky(nbytes, tag=""):
        calls["n"] += 1
        if calls["n"] == 2:  # second buffer
            raise torch.OutOfMemoryError("simulated")
        return real(nbytes, tag)

    dev.alloc_device = flaky
    data = [[torch.randn(64)] for _ in keys]
    out, stats, _ = _forward_backward(mgr, keys, data)
    assert stats.mode is BufferMode.SINGLE and dev.live_device_buffers == 1
    assert all(torch.equal(o[0], d[0]) for o, d in zip(out, data))


# ---------------------------------------------------------------------------------------------
# timing model
# ---------------------------------------------------------------------------------------------
def _trace(schedule):
    return [TraceEvent(**kw) for kw in schedule]


def _synthetic_trace(L: int, double: bool, nbytes: int = 1000):
    """What the manager records for L layers (backward only), for the model's own tests."""
    t, ev = [], iter(range(10**6))
    owner = {}
    last = f"L{L}"
    bwd_order = [f"L{i}" for i in range(L, 0, -1)]
    reload_ev, free_ev = {}, {}

    def reload(tag, b):
        if b in free_ev:
            t.append(dict(op="wait", stream="copy", event=free_ev[b]))
        t.append(dict(op="copy", stream="copy", tag=tag, nbytes=nbytes, direction="h2d",
                      buffer=b))
        e = next(ev)
        t.append(dict(op="record", stream="copy", event=e))
        reload_ev[tag], owner[b] = e, tag

    buf_of = {}
    for i, tag in enumerate(bwd_order):
        for b in list(owner):
            if owner[b] != tag and owner[b] is not None:
                e = next(ev)
                t.append(dict(op="record", stream="compute", event=e))
                free_ev[b], owner[b] = e, None
        if tag != last:
            if tag not in reload_ev:
                b = 0
                reload(tag, b)
            t.append(dict(op="wait", stream="compute", event=reload_ev[tag]))
            buf_of[tag] = [b for b, o in owner.items() if o == tag][0]
        if double and i + 1 < L:
            nxt = bwd_order[i + 1]
            b = 1 if owner.get(0) is not None else 0
            if owner.get(b) is None:
                reload(nxt, b)
        t.append(dict(op="compute_begin", stream="compute", tag=tag, phase="bwd",
                      buffer=buf_of.get(tag, -1)))
        t.append(dict(op="compute_end", stream="compute", tag=tag, phase="bwd",
                      buffer=buf_of.get(tag, -1)))
    return _trace(t)


@pytest.mark.parametrize("c,g", [(1.0, 2.0), (2.0, 1.0), (1.0, 1.0)])
def test_timing_model_matches_closed_form(c, g):
    L, nbytes = 8, 1000
    double = simulate_two_streams(_synthetic_trace(L, True), {"bwd": g}, nbytes / c)
    single = simulate_two_streams(_synthetic_trace(L, False), {"bwd": g}, nbytes / c)
    assert double.hazards == () and single.hazards == ()
    # last layer kept: its backward runs while the first reload is in flight
    assert double.bwd_span == pytest.approx((L - 1) * max(c, g) + g)
    assert single.bwd_span == pytest.approx(max(g, c) + g + (L - 2) * (c + g))
    assert hidden_fraction(double, L, c, g) == pytest.approx(1.0)
    assert single.stall > double.stall


def test_timing_model_reports_hazards():
    bad = _trace([
        dict(op="copy", stream="copy", tag="L1", nbytes=100, direction="h2d", buffer=0),
        dict(op="compute_begin", stream="compute", tag="L1", phase="bwd", buffer=0),
        dict(op="compute_end", stream="compute", tag="L1", phase="bwd", buffer=0),
        dict(op="copy", stream="copy", tag="L0", nbytes=100, direction="h2d", buffer=0),
        dict(op="wait", stream="copy", event=99),
    ])
    tl = simulate_two_streams(bad, {"bwd": 1.0}, 1000.0)
    msgs = " | ".join(tl.hazards)
    assert "before its reload" in msgs  # compute did not wait for the copy
    assert "before the backward of L1" in msgs  # buffer overwritten while being read
    assert "before it is recorded" in msgs
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        simulate_two_streams(bad, {"bwd": 1.0}, 0.0)
