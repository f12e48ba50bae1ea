"""The offload window and order planner (``max_offloaded_layers`` / ``eager_offloads`` =
``"auto"``): its step model against the event-driven replay of the real manager's recorded
schedule, its choice, and the manager's calibrate-then-plan flow on a stand-in device with device
timestamps."""

import logging
import random

import pytest
import torch

from megatron_fastpath.offload import ActivationOffloadManager, OffloadConfig, RecordingDevice
from megatron_fastpath.offload.plan import LayerTimes, model_step, plan_order, plan_window
from megatron_fastpath.offload.timing import step_hidden_fraction
from tests.offload.offload_models import manager_step_trace, run_manager_step

NBYTES = 4000
BASE = dict(min_offload_bytes=0, headroom_margin_bytes=0)


@pytest.mark.parametrize("at_layer_start", [True, False], ids=["recompute", "saved_tensors"])
def test_model_step_equals_replay_of_the_managers_recorded_schedule(at_layer_start):
    """plan.model_step is a closed form of the DOUBLE schedule; the reference is the
    event-driven replay (timing.replay_schedule) of what the manager actually issued, with the
    host ahead of the device. Non-uniform per-layer times, every window in every order (eager
    offloads 0 .. window, and None), links faster and slower than compute."""
    L = 8
    rng = random.Random(0)
    f = [rng.uniform(0.2, 0.5) for _ in range(L)]
    g = [rng.uniform(0.8, 1.5) for _ in range(L)]
    checked = 0
    for window in range(L):
        for eager in [None, *range(window + 1)]:
            keys, trace = manager_step_trace(L, NBYTES, at_layer_start,
                                             max_offloaded_layers=window, eager_offloads=eager)
            k = window if eager is None else eager
            # the manager's issue order: eager ones as their layers run, then latest first
            assert [e.tag for e in trace if e.op == "copy" and e.direction == "d2h"] == [
                keys[i] for i in [*range(k), *reversed(range(k, window))]]
            durations = {**{("fwd", key): f[i] for i, key in enumerate(keys)},
                         **{("bwd", key): g[i] for i, key in enumerate(keys)}}
            for c in (0.3, 0.5, 1.0, 2.0):
                frac, tl, _ = step_hidden_fraction(trace, durations, NBYTES / c,
                                                   use_host_times=False)
                assert tl.hazards == ()
                m = model_step(LayerTimes(tuple(f), tuple(g), (c,) * L, (c,) * L,
                                          offload_at_layer_start=at_layer_start), window, eager)
                assert (m.window, m.eager) == (window, k)
                assert m.step_s == pytest.approx(tl.makespan, rel=1e-12, abs=1e-12)
                assert m.hidden_fraction == pytest.approx(frac, rel=1e-12, abs=1e-12)
                pending = sum(1 for iv in tl.intervals
                              if iv.kind == "d2h" and iv.end > tl.fwd_end + 1e-12)
                assert m.pending_at_fwd_end == pending
                checked += 1
    assert checked == 4 * sum(w + 2 for w in range(L))


def test_plan_window_is_the_largest_window_reaching_the_target():
    """In forward order (eager=None): the window alone."""
    L, g = 8, 1.0
    # a link faster than the forward keeps up: every layer but the last, fully hidden
    fast = plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=0.25 * g), eager=None)
    assert fast.window == L - 1 and fast.chosen.hidden_fraction == pytest.approx(1.0)
    # c/g = 1 with g = 3f: all layers cannot hide (the last offload ends after (L-1)c)
    times = LayerTimes.uniform(L, f=g / 3, g=g, c=g)
    plan = plan_window(times, 0.9, eager=None)
    assert model_step(times, None).hidden_fraction < 0.9
    assert 0 < plan.window < L - 1
    assert plan.chosen.hidden_fraction >= 0.9
    assert all(m.hidden_fraction < 0.9 for m in plan.candidates if m.window > plan.window)
    assert [m.window for m in plan.candidates] == list(range(L))
    # a link far slower than compute: nothing can be hidden, nothing is offloaded
    assert plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=100 * g), eager=None).window == 0
    # never below the window that frees what offloading every layer frees by the forward's end:
    # offloads finish in layer order, so window w frees min(w, peak_window) activation sets
    every = model_step(times, None)
    assert plan.peak_window == every.window - every.pending_at_fwd_end == 2
    for m in plan.candidates:
        assert m.window - m.pending_at_fwd_end == min(m.window, plan.peak_window)
    # the target moves the choice
    assert plan_window(times, 0.5, eager=None).window >= plan.window
    assert all(m.eager == m.window for m in plan.candidates)
    # a fast device->host link with a slow way back: every offload finishes during the forward
    # (peak_window = L-1) but the reloads cannot hide; the plan keeps the peak savings and says
    # it misses the target rather than giving memory back
    lopsided = LayerTimes((g / 3,) * L, (g,) * L, (0.1 * g,) * L, (3 * g,) * L)
    kept = plan_window(lopsided, 0.9, eager=None)
    assert kept.peak_window == L - 1 and kept.window == L - 1 and not kept.meets_target
    assert max(m.window for m in kept.candidates if m.hidden_fraction >= 0.9) < L - 1
    assert "below the target to keep the 7 activation sets" in kept.describe(L)
    assert "in forward order" in kept.describe(L)
    assert plan.meets_target and "below the target" not in plan.describe(L)
    with pytest.raises(ValueError, match="target hidden fraction"):
        plan_window(times, 1.5)
    with pytest.raises(ValueError, match="bwd_s has 2 entries"):
        LayerTimes((1.0,), (1.0, 1.0), (1.0,), (1.0,))
    with pytest.raises(ValueError, match=">= 0 seconds"):
        LayerTimes((-1.0,), (1.0,), (1.0,), (1.0,))


def test_plan_order_puts_the_backlog_in_reload_order_without_freeing_less_at_the_peak():
    """At c/g = 1 (g = 3f) forward order leaves 5 of 7 offloads running when the forward ends,
    and the last one -- reloaded first -- finishes last. Holding back all but the first 2 and
    issuing them latest first hides >= 0.9 with the same 5 running at the forward's end."""
    L, g = 8, 1.0
    times = LayerTimes.uniform(L, f=g / 3, g=g, c=g)
    fifo = model_step(times, None)
    assert fifo.hidden_fraction < 0.75 and fifo.pending_at_fwd_end == 5
    best = plan_order(times, None)
    assert (best.window, best.eager) == (L - 1, 2)
    assert best.hidden_fraction >= 0.97 and best.pending_at_fwd_end == fifo.pending_at_fwd_end
    # the brute-force reference: every order, the best one freeing no less at the peak, ties to
    # the most eager
    orders = [model_step(times, None, k) for k in range(L)]
    allowed = [m for m in orders if m.pending_at_fwd_end <= fifo.pending_at_fwd_end]
    top = max(m.hidden_fraction for m in allowed)
    assert best.eager == max(m.eager for m in allowed if m.hidden_fraction >= top - 1e-12)
    # an order that hides more but frees less at the peak is not taken: at c/g = 0.5 holding
    # back everything hides all, but leaves 6 offloads running at the forward's end, not 2
    half = LayerTimes.uniform(L, f=g / 3, g=g, c=0.5 * g)
    held_all = model_step(half, None, 0)
    assert held_all.hidden_fraction == pytest.approx(1.0) and held_all.pending_at_fwd_end == 6
    chosen = plan_order(half, None)
    assert chosen.pending_at_fwd_end == model_step(half, None).pending_at_fwd_end == 2
    assert chosen.hidden_fraction == pytest.approx(1.0) and chosen.eager == 5
    # nothing to reorder
    assert plan_order(LayerTimes.uniform(L, f=g, g=g, c=0.1 * g), None).eager == L - 1
    assert plan_order(times, 0).eager == 0 and plan_order(times, 1).eager == 1

    # plan_window in the best orders (the default): every layer at c/g = 1, and a window that
    # must be trimmed at c/g = 1.5, in its own order
    plan = plan_window(times, 0.9)
    assert (plan.window, plan.eager) == (L - 1, 2) and plan.meets_target
    assert "the first 2 in forward order, the last 5 latest layer first" in plan.describe(L)
    slow = plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=1.5 * g), 0.9)
    assert (slow.window, slow.eager) == (5, 1) and slow.meets_target
    assert plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=1.5 * g), 0.9,
                       eager=None).window == 3
    # a fixed window: only its order is planned; a miss says the window was fixed
    fixed = plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=2 * g), 0.9, window=None)
    assert fixed.window_fixed and (fixed.window, fixed.eager) == (L - 1, 1)
    assert not fixed.meets_target and "the window is fixed" in fixed.describe(L)
    assert plan_window(times, 0.9, window=4).window == 4


class TimedDevice(RecordingDevice):
    """Stand-in for a GPU's timing events: overlaps copies; a timestamp is its label and a span
    is the duration ``times`` gives it, once ``completed`` (before that: pending, None)."""

    overlaps_copies = True

    def __init__(self, times: LayerTimes, keys):
        super().__init__()
        self.times, self.keys, self.completed, self.stamps = times, keys, False, []

    def timestamp(self, stream, label):
        self.stamps.append((stream, label))
        return label

    def elapsed_s(self, start, end):
        assert start[0] == end[0] and start[2] == end[2] and (start[1], end[1]) == (
            "begin", "end")
        if not self.completed:
            return None
        i = self.keys.index(start[2])
        t = self.times
        return {"fwd": t.fwd_s, "bwd": t.bwd_s, "d2h": t.offload_s, "h2d": t.reload_s}[
            start[0]][i]


def _auto_manager(L, times=None, **cfg):
    keys = [f"L{i + 1}" for i in range(L)]
    dev = TimedDevice(times, keys) if times is not None else RecordingDevice()
    mgr = ActivationOffloadManager(OffloadConfig(**{**BASE, **cfg}), device=dev)
    assert [mgr.register_layer(i + 1) for i in range(L)] == keys
    return mgr, dev, keys


def test_auto_window_calibrates_one_step_then_plans_without_waiting(caplog):
    L = 8
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=1.5)
    expected, eager = plan_window(times, 0.9).window, plan_window(times, 0.9).eager
    assert 0 < eager < expected - 1 < L - 2  # a trimmed window, with offloads held back
    mgr, dev, keys = _auto_manager(L, times)
    assert mgr.config.max_offloaded_layers == mgr.config.eager_offloads == "auto"  # defaults
    tensors = [torch.randn(NBYTES // 4) for _ in keys]

    warm = run_manager_step(mgr, keys, tensors)  # the first step pays one-time costs: not timed
    assert (warm.window_source, warm.layers_offloaded, dev.stamps) == ("calibrating", L - 1, [])
    assert warm.eager_offloads == L - 1  # forward order until planned
    dev.completed = True  # (even with every event complete, nothing to plan from yet)
    s0 = run_manager_step(mgr, keys, tensors)  # calibration: every layer but the last, timed
    assert (s0.window_source, s0.offload_window, s0.layers_offloaded) == ("calibrating", L - 1,
                                                                          L - 1)
    assert mgr.window_plan is None
    dev.completed = False
    labels = {label for _, label in dev.stamps}
    assert len(dev.stamps) == len(labels) == 2 * L + 2 * L + 2 * (L - 1) + 2 * (L - 1)
    assert {stream for stream, (kind, _, _) in dev.stamps if kind == "d2h"} == {"offload"}
    assert {stream for stream, (kind, _, _) in dev.stamps if kind == "h2d"} == {"reload"}
    assert {stream for stream, (kind, _, _) in dev.stamps if kind in ("fwd", "bwd")} == {
        "compute"}

    s1 = run_manager_step(mgr, keys, tensors)  # the device has not finished step 0: keep going
    assert (s1.window_source, s1.offload_window, s1.layers_offloaded) == ("calibrating", L - 1,
                                                                          L - 1)
    assert mgr.window_plan is None
    n_stamps = len(dev.stamps)

    dev.completed = True
    with caplog.at_level(logging.INFO, logger="megatron_fastpath.offload.manager"):
        s2 = run_manager_step(mgr, keys, tensors)
    assert (s2.window_source, s2.offload_window, s2.layers_offloaded) == ("planned", expected,
                                                                          expected)
    assert s2.eager_offloads == eager
    assert mgr.window_plan == plan_window(times, 0.9)
    assert f"offload window {expected} of {L - 1} layers, the first {eager} in" in caplog.text
    assert "from device timings of step 1" in caplog.text
    assert len(dev.stamps) == n_stamps  # only the calibration step was timed
    dev.clear_trace()
    s3 = run_manager_step(mgr, keys, tensors)  # the rest stay on the device: never copied
    assert s3.layers_offloaded == expected
    assert {e.tag for e in dev.trace if e.op == "copy"} == {f"L{i + 1}" for i in range(expected)}
    # in the planned order: the first `eager` as their layers run, the others latest first
    assert [e.tag for e in dev.trace if e.op == "copy" and e.direction == "d2h"] == [
        keys[i] for i in [*range(eager), *reversed(range(eager, expected))]]


def test_auto_window_estimates_copies_it_did_not_time_from_the_measured_bandwidth():
    """The last layer is never copied, so the calibration step has no copy timing for it: its
    copy time is its bytes over the bandwidth measured on the other groups."""
    L = 6
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=0.5)
    mgr, dev, keys = _auto_manager(L, times)
    tensors = [torch.randn(NBYTES // 4) for _ in keys]
    run_manager_step(mgr, keys, tensors)  # warm-up
    run_manager_step(mgr, keys, tensors)  # timed
    dev.completed = True
    assert mgr.window_plan is None
    run_manager_step(mgr, keys, tensors)
    # measured: NBYTES per 0.5 s, so the last layer's estimate is 0.5 s: the same plan as from
    # the full times
    assert mgr.window_plan == plan_window(times, 0.9)


@pytest.mark.parametrize("window,eager,expected", [(None, None, 5), (2, None, 2), (0, None, 0),
                                                  (None, 1, 5)])
def test_fixed_window_and_order_are_not_timed(window, eager, expected):
    L = 6
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=1.0)
    mgr, dev, keys = _auto_manager(L, times, max_offloaded_layers=window, eager_offloads=eager)
    dev.completed = True
    for _ in range(3):
        s = run_manager_step(mgr, keys, [torch.randn(NBYTES // 4) for _ in keys])
        assert (s.window_source, s.offload_window, s.layers_offloaded) == ("config", expected,
                                                                           expected)
        assert s.eager_offloads == (expected if eager is None else eager)
    assert dev.stamps == [] and mgr.window_plan is None


def test_fixed_window_gets_a_planned_order(caplog):
    """max_offloaded_layers=None (every layer but the last) with eager_offloads="auto" (the
    default): the calibration step plans the order only."""
    L = 8
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=1.0)
    mgr, dev, keys = _auto_manager(L, times, max_offloaded_layers=None)
    tensors = [torch.randn(NBYTES // 4) for _ in keys]
    for _ in range(2):  # warm-up, calibration
        s = run_manager_step(mgr, keys, tensors)
        assert (s.window_source, s.offload_window, s.eager_offloads) == ("calibrating", 7, 7)
    dev.completed = True
    with caplog.at_level(logging.INFO, logger="megatron_fastpath.offload.manager"):
        s = run_manager_step(mgr, keys, tensors)
    assert (s.window_source, s.offload_window, s.eager_offloads) == ("planned", 7, 2)
    assert mgr.window_plan == plan_window(times, 0.9, window=None)
    assert "offload window 7 of 7 layers, the first 2 in forward order" in caplog.text
    dev.clear_trace()
    run_manager_step(mgr, keys, tensors)
    assert [e.tag for e in dev.trace if e.op == "copy" and e.direction == "d2h"] == [
        "L1", "L2", "L7", "L6", "L5", "L4", "L3"]


def test_auto_on_a_synchronous_device_offloads_every_layer_but_the_last():
    mgr, dev, keys = _auto_manager(5)
    for _ in range(3):
        s = run_manager_step(mgr, keys, [torch.randn(NBYTES // 4) for _ in keys])
        assert (s.window_source, s.offload_window, s.layers_offloaded) == (
            "synchronous device", 4, 4)
    assert mgr.window_plan is None


def test_auto_without_compute_markers_says_so_and_keeps_every_layer(caplog):
    L = 5
    mgr, dev, keys = _auto_manager(L, LayerTimes.uniform(L, 1.0, 1.0, 1.0))
    dev.completed = True
    tensors = [torch.randn(NBYTES // 4) for _ in keys]
    with caplog.at_level(logging.WARNING, logger="megatron_fastpath.offload.manager"):
        for _ in range(3):
            s = run_manager_step(mgr, keys, tensors, marks=False)
    assert s.window_source == "unplanned: no compute timings" and s.layers_offloaded == L - 1
    assert caplog.text.count("no forward/backward timings") == 1
    assert "max_offloaded_layers to an int" in caplog.text


@pytest.mark.parametrize("field", ["max_offloaded_layers", "eager_offloads"])
@pytest.mark.parametrize("bad", ["Auto", "all", -1, True, 2.0])
def test_config_rejects_bad_windows(field, bad):
    with pytest.raises(ValueError, match=f"{field} must be 'auto', None or an int >= 0"):
        OffloadConfig(**{field: bad})


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.9"])
def test_config_rejects_bad_targets(bad):
    with pytest.raises(ValueError, match="target_hidden_fraction must be a number in"):
        OffloadConfig(target_hidden_fraction=bad)

