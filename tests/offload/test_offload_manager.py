"""ActivationOffloadManager on synthetic tensors: TE quantized-tensor split/rebuild, do-not-offload
marks, deduplication, config / usage errors, and the two-stream timing model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_fastpath.offload import (
    ActivationOffloadManager,
    BufferMode,
    OffloadConfig,
    RecordingDevice,
    TraceEvent,
)
from megatron_fastpath.compat.te_quantized import is_quantized, never_offload
from megatron_fastpath.offload.config import StepCounters
from megatron_fastpath.offload.timing import replay_schedule, step_hidden_fraction
from tests.offload.offload_models import manager_step_trace

CFG = dict(min_offload_bytes=0, headroom_margin_bytes=0)


class FakeFloat8:
    """TE 2.10's Float8TensorStorage contract (storage/float8_tensor_storage.py): constructed
    from keywords (data, fp8_scale_inv, data_transpose), ``get_metadata()`` returns those
    keywords, and ``prepare_for_saving`` hands out [data, transpose, scale_inv] AND clears them
    on the object it is called on (``self._data = None`` ...), as TE does."""

    views = 0  # objects made from get_metadata() (detached views)

    def __init__(self, data, data_transpose=None, fp8_scale_inv=None):
        self._data, self._transpose, self._scale_inv = data, data_transpose, fp8_scale_inv
        self.saved = 0

    def get_metadata(self):
        FakeFloat8.views += 1
        return dict(data=self._data, data_transpose=self._transpose,
                    fp8_scale_inv=self._scale_inv)

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
    for i in range(2):  # offloaded layers: a rebuilt view, same values, data from the buffers
        q, p = out[i]
        assert isinstance(q, FakeFloat8) and q is not qts[i] and q.saved == 1
        assert q._transpose is None and q._data.data_ptr() != qts[i]._data.data_ptr()
        assert torch.equal(q.dequantize(), expected[i]) and torch.equal(p, plain[i])
    # the last layer is never offloaded: its view holds the original tensors
    assert out[2][0]._data is qts[2]._data and torch.equal(out[2][0].dequantize(), expected[2])
    d2h = [e for e in dev.trace if e.op == "copy" and e.direction == "d2h"]
    assert {e.tag for e in d2h} == {"L1", "L2"}
    # per offloaded layer: uint8 data, fp32 scale_inv, fp32 plain tensor (transpose None)
    assert sorted(e.nbytes for e in d2h if e.tag == "L1") == [4, 128, 256]
    assert stats.layers_offloaded == 2 and stats.bytes_offloaded == stats.bytes_reloaded


def test_live_quantized_tensor_keeps_its_data_after_pack():
    """TE's prepare_for_saving clears _data / _scale_inv on the object it is
    called on. The forward may still read the live tensor after autograd saved it, so the
    manager must split a detached view; the original keeps its data, untouched, through the
    whole forward and backward."""
    mgr, dev, keys = _manager(num_layers=2)
    q = FakeFloat8(torch.randint(0, 255, (256,), dtype=torch.uint8),
                   fp8_scale_inv=torch.tensor([0.25]))
    data, scale = q._data, q._scale_inv
    expected = q.dequantize()
    mgr.begin_step()
    g = mgr.open_group(keys[0])
    packed = mgr.pack(g, q)
    assert q._data is data and q._scale_inv is scale and q.saved == 0  # live object intact
    assert torch.equal(q.dequantize(), expected)  # the forward can still read it
    mgr.close_group(g)
    mgr.begin_backward(mgr.open_group(keys[1]))  # last layer: nothing to reload
    mgr.begin_backward(g)
    rebuilt = mgr.unpack(packed)
    assert rebuilt is not q and torch.equal(rebuilt.dequantize(), expected)
    assert q._data is data and torch.equal(q.dequantize(), expected)


class FakeFloat8Tensor(torch.Tensor):
    """TE 2.10's QuantizedTensor contract: a torch.Tensor subclass whose ``detach()`` is
    ``make_like(self)`` (a new object sharing the data tensors) and whose
    ``prepare_for_saving`` clears the object it is called on."""

    @staticmethod
    def __new__(cls, data, scale_inv):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)
        self._data, self._scale_inv = data, scale_inv
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"stand-in: {func} not needed by the offload manager")

    def detach(self):
        return FakeFloat8Tensor(self._data, self._scale_inv)

    def prepare_for_saving(self):
        tensors = [self._data, self._scale_inv]
        self._data = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, self._scale_inv = tensors[:2]
        return tensors[2:]


def test_live_quantized_tensor_subclass_split_on_detach():
    mgr, dev, keys = _manager(num_layers=2)
    q = FakeFloat8Tensor(torch.arange(64, dtype=torch.uint8), torch.tensor([2.0]))
    data = q._data
    mgr.begin_step()
    g0 = mgr.open_group(keys[0])
    packed = mgr.pack(g0, q)
    mgr.close_group(g0)
    assert q._data is data and q._scale_inv is not None  # live tensor untouched
    g1 = mgr.open_group(keys[1])
    mgr.close_group(g1)
    mgr.begin_backward(g1)
    mgr.begin_backward(g0)
    rebuilt = mgr.unpack(packed)
    assert type(rebuilt) is FakeFloat8Tensor and rebuilt is not q
    assert torch.equal(rebuilt._data, data) and rebuilt._data.data_ptr() != data.data_ptr()
    assert mgr.end_step().layers_offloaded == 1 and q._data is data


def test_quantized_tensor_without_a_view_stays_on_device():
    class NoView(FakeFloat8):
        get_metadata = None

    mgr, dev, keys = _manager(num_layers=2)
    q = NoView(torch.zeros(256, dtype=torch.uint8), fp8_scale_inv=torch.tensor([1.0]))
    g = mgr.open_group(keys[0])
    assert mgr.pack(g, q) is q and q._data is not None and q.saved == 0


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


@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_step_counters_are_the_stats_totals(double):
    """The manager's named step counters (StepCounters, once a string-keyed dict) become the
    step's stats field for field: L1 offloaded, L2's larger group kept (the buffers were sized
    at L1, this step's first offload), L3 the last layer; L1 comes back prefetched (DOUBLE: at
    L3's backward) or just in time (SINGLE). The figures are the ones the dict reported."""
    mgr, dev, keys = _manager(num_layers=3, allow_double_buffer=double)
    data = [[torch.randn(64)], [torch.randn(128)], [torch.randn(64)]]
    out, stats, _ = _forward_backward(mgr, keys, data)
    assert all(torch.equal(o[0], d[0]) for o, d in zip(out, data))
    jit = 0 if double else 1
    assert mgr._counters == StepCounters(
        bytes_offloaded=256, bytes_reloaded=256, layers_offloaded=1, layers_kept=1,
        prefetched_reloads=1 - jit, just_in_time_reloads=jit, just_in_time_bytes=256 * jit)
    c = mgr._counters
    assert (stats.bytes_offloaded, stats.bytes_reloaded, stats.layers_offloaded,
            stats.layers_kept, stats.prefetched_reloads, stats.just_in_time_reloads) == (
        c.bytes_offloaded, c.bytes_reloaded, c.layers_offloaded, c.layers_kept,
        c.prefetched_reloads, c.just_in_time_reloads)
    assert stats.est_exposed_copy_s == c.just_in_time_bytes / 25e9
    mgr.begin_step()
    assert mgr._counters == StepCounters()  # a step starts from zero


def test_held_back_offloads_are_issued_by_a_backward_that_starts_early():
    """Offloads held back for the window's last layer (eager_offloads) are issued, latest first,
    when a backward starts before that layer ran (a forward that stopped early), so every
    unpacked tensor is what was packed; a step that drops such a pass drops them too."""
    mgr, dev, keys = _manager(num_layers=6, eager_offloads=1)
    tensors = [[torch.full((64,), float(i))] for i in range(3)]
    mgr.begin_step()
    groups, packed = [], []
    for key, ts in zip(keys[:3], tensors):
        g = mgr.open_group(key)
        packed.append([mgr.pack(g, t) for t in ts])
        mgr.close_group(g)
        groups.append(g)
    assert [e.tag for e in dev.trace if e.op == "copy"] == ["L1"]  # L2, L3 held for L5
    for i in reversed(range(3)):
        mgr.begin_backward(groups[i])
        if i == 2:
            assert [e.tag for e in dev.trace if e.op == "copy" and e.direction == "d2h"] == [
                "L1", "L3", "L2"]
        torch.testing.assert_close(mgr.unpack(packed[i][0]), tensors[i][0], rtol=0, atol=0)
        mgr.end_backward(groups[i])
    stats = mgr.end_step()
    assert stats.layers_offloaded == stats.prefetched_reloads + stats.just_in_time_reloads == 3
    assert stats.bytes_offloaded == stats.bytes_reloaded == 3 * 256
    # a pass without backward: its held groups are dropped with it, the next step is whole
    mgr.begin_step()
    for key in keys[:3]:
        g = mgr.open_group(key)
        mgr.pack(g, torch.randn(64))
        mgr.close_group(g)
    mgr.end_step()
    out, stats, _ = _forward_backward(mgr, keys, [[torch.full((64,), float(i))] for i in range(6)])
    assert [o[0][0].item() for o in out] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert stats.layers_offloaded == 5 and stats.eager_offloads == 1


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
    double = replay_schedule(_synthetic_trace(L, True), {"bwd": g}, nbytes / c)
    single = replay_schedule(_synthetic_trace(L, False), {"bwd": g}, nbytes / c)
    assert double.hazards == () and single.hazards == ()
    # last layer kept: its backward runs while the first reload is in flight
    assert double.bwd_span == pytest.approx((L - 1) * max(c, g) + g)
    assert single.bwd_span == pytest.approx(max(g, c) + g + (L - 2) * (c + g))
    # whole-step figure: 1 - exposed copy time / all copy time
    frac, step, free = step_hidden_fraction(_synthetic_trace(L, True), {"bwd": g}, nbytes / c)
    assert free.makespan == pytest.approx(L * g) and step.copy_busy == pytest.approx((L - 1) * c)
    assert frac == pytest.approx(1.0 - (L - 1) * max(0.0, c - g) / ((L - 1) * c))
    assert single.stall > double.stall


def _issued(trace, times, launch=0.9, late_by=None):
    """Host issue times for ``trace``: the host spends ``launch`` x a compute region's device
    time issuing it (a host nearly as busy as the device), manager calls cost nothing.
    ``late_by``: each prefetch is issued only after the backward of the layer it should overlap
    was issued, ``late_by`` seconds later (a host hiccup; no device wait is added: only the
    host issue order and time move)."""
    out, host, block, held = [], 0.0, [], None
    for e in trace:
        if e.stream == "reload":
            block.append(e)
            continue
        if late_by is not None and e.op == "compute_begin" and e.phase == "bwd" and block:
            held, block = block, []
        elif block:
            out.extend(dataclasses.replace(x, host_s=host) for x in block)
            block = []
        out.append(dataclasses.replace(e, host_s=host))
        if e.op == "compute_end":
            host += launch * times[e.phase]
            if held:
                host += late_by
                out.extend(dataclasses.replace(x, host_s=host) for x in held)
                held = None
    return out


def test_late_prefetch_scores_lower():
    """A prefetch issued late on the host must show in the whole-step figure."""
    L, g, nbytes = 6, 1.0, 4000
    times = {"fwd": g / 3, "bwd": g}
    trace = manager_step_trace(L, nbytes)[1]
    bw = nbytes / (0.5 * g)  # c/g = 0.5
    on_time, tl, _ = step_hidden_fraction(_issued(trace, times), times, bw)
    assert tl.hazards == () and on_time > 0.9
    late_trace = _issued(trace, times, late_by=0.5 * g)
    late, tl_late, _ = step_hidden_fraction(late_trace, times, bw)
    assert tl_late.hazards == ()
    assert late < on_time - 0.05, (late, on_time)
    # a host-ahead replay (host times ignored) cannot see it: the old model's blind spot
    blind, _, _ = step_hidden_fraction(late_trace, times, bw, use_host_times=False)
    assert blind == pytest.approx(on_time)


def test_whole_step_replay_includes_forward_offload_backlog():
    """Offloading every layer at c/g = 1 cannot hide: the last offload ends after (L-1)*c but
    its reload is needed first; keeping the last layers on the device
    (max_offloaded_layers) hides the rest. Per-layer times, non-uniform."""
    L, nbytes = 8, 4000
    trace = manager_step_trace(L, nbytes)[1]
    times = {(ph, f"L{i}"): (1.0 if ph == "bwd" else 1 / 3) * (1 + 0.1 * i)
             for i in range(1, L + 1) for ph in ("fwd", "bwd")}
    c_bw = nbytes / 1.0
    frac_all, tl, _ = step_hidden_fraction(trace, times, c_bw)
    assert tl.hazards == () and frac_all < 0.9
    first_reload = min(iv.start for iv in tl.intervals if iv.kind == "h2d")
    last_d2h = max(iv.end for iv in tl.intervals if iv.kind == "d2h")
    assert first_reload == pytest.approx(last_d2h)  # waits for its own (last) offload only
    window = manager_step_trace(L, nbytes, max_offloaded_layers=4)[1]
    assert {e.tag for e in window if e.op == "copy"} == {"L1", "L2", "L3", "L4"}
    frac_window, tl, _ = step_hidden_fraction(window, times, c_bw)
    assert tl.hazards == () and frac_window >= 0.9 > frac_all


def test_timing_model_reports_hazards():
    bad = _trace([
        dict(op="copy", stream="reload", tag="L1", nbytes=100, direction="h2d", buffer=0),
        dict(op="compute_begin", stream="compute", tag="L1", phase="bwd", buffer=0),
        dict(op="compute_end", stream="compute", tag="L1", phase="bwd", buffer=0),
        dict(op="copy", stream="reload", tag="L0", nbytes=100, direction="h2d", buffer=0),
        dict(op="wait", stream="reload", event=99),
        dict(op="copy", stream="offload", tag="L5", nbytes=1000, direction="d2h"),
        dict(op="copy", stream="reload", tag="L5", nbytes=100, direction="h2d", buffer=1),
    ])
    tl = replay_schedule(bad, {"bwd": 1.0}, 1000.0)
    msgs = " | ".join(tl.hazards)
    assert "before its reload" in msgs  # compute did not wait for the copy
    assert "before the backward of L1" in msgs  # buffer overwritten while being read
    assert "before it is recorded" in msgs
    assert "before its offload" in msgs  # host slot read before it was written
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        replay_schedule(bad, {"bwd": 1.0}, 0.0)


def test_offload_reports_its_own_summary_line():
    """The main job's summary prints what the offload's last step stats say of themselves."""
    from megatron_fastpath.offload.config import BufferMode, OffloadStepStats

    stats = OffloadStepStats(step=3, mode=BufferMode.DOUBLE, mode_reason="fits", bytes_offloaded=2048,
                             bytes_reloaded=2048, layers_offloaded=2, layers_kept=1, prefetched_reloads=1,
                             just_in_time_reloads=1, est_exposed_copy_s=0.0015, device_buffer_bytes=4096,
                             host_pool_bytes=8192, host_pinned=True, offload_window=2,
                             window_source="planned", eager_offloads=1)
    assert stats.summary_line() == (
        "offload: mode double (fits), 2,048 B offloaded/2,048 B reloaded per step, 1 prefetched / "
        "1 just-in-time reloads (est. exposed copy 1.500 ms), device buffers 4,096 B, host pool "
        "8,192 B, window 2 layers, 1 issued in forward order (planned)")
