"""The offload window planner (``max_offloaded_layers="auto"``): its step model against the
event-driven replay of the real manager's recorded schedule, its choice, and the manager's
calibrate-then-plan flow on a stand-in device with device timestamps."""

import logging
import random

import pytest
import torch

from megatron_fastpath.offload import ActivationOffloadManager, OffloadConfig, RecordingDevice
from megatron_fastpath.offload.plan import LayerTimes, model_step, plan_window
from megatron_fastpath.offload.timing import step_hidden_fraction
from offload_models import manager_step_trace, run_manager_step

NBYTES = 4000
BASE = dict(min_offload_bytes=0, headroom_margin_bytes=0)


@pytest.mark.parametrize("at_layer_start", [True, False], ids=["recompute", "saved_tensors"])
def test_model_step_equals_replay_of_the_managers_recorded_schedule(at_layer_start):
    """plan.model_step is a closed form of the DOUBLE schedule; the reference is the
    event-driven replay (timing.replay_schedule) of what the manager actually issued, with the
    host ahead of the device. Non-uniform per-layer times, every window, links faster and
    slower than compute."""
    L = 8
    rng = random.Random(0)
    f = [rng.uniform(0.2, 0.5) for _ in range(L)]
    g = [rng.uniform(0.8, 1.5) for _ in range(L)]
    checked = 0
    for window in range(L):
        keys, trace = manager_step_trace(L, NBYTES, at_layer_start, max_offloaded_layers=window)
        durations = {**{("fwd", k): f[i] for i, k in enumerate(keys)},
                     **{("bwd", k): g[i] for i, k in enumerate(keys)}}
        for c in (0.3, 0.5, 1.0, 2.0):
            frac, tl, _ = step_hidden_fraction(trace, durations, NBYTES / c,
                                               use_host_times=False)
            assert tl.hazards == ()
            m = model_step(LayerTimes(tuple(f), tuple(g), (c,) * L, (c,) * L,
                                      offload_at_layer_start=at_layer_start), window)
            assert m.window == window
            assert m.step_s == pytest.approx(tl.makespan, rel=1e-12, abs=1e-12)
            assert m.hidden_fraction == pytest.approx(frac, rel=1e-12, abs=1e-12)
            pending = sum(1 for iv in tl.intervals
                          if iv.kind == "d2h" and iv.end > tl.fwd_end + 1e-12)
            assert m.pending_at_fwd_end == pending
            checked += 1
    assert checked == L * 4


def test_plan_window_is_the_largest_window_reaching_the_target():
    L, g = 8, 1.0
    # a link faster than the forward keeps up: every layer but the last, fully hidden
    fast = plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=0.25 * g))
    assert fast.window == L - 1 and fast.chosen.hidden_fraction == pytest.approx(1.0)
    # c/g = 1 with g = 3f: all layers cannot hide (the last offload ends after (L-1)c)
    times = LayerTimes.uniform(L, f=g / 3, g=g, c=g)
    plan = plan_window(times, 0.9)
    assert model_step(times, None).hidden_fraction < 0.9
    assert 0 < plan.window < L - 1
    assert plan.chosen.hidden_fraction >= 0.9
    assert all(m.hidden_fraction < 0.9 for m in plan.candidates if m.window > plan.window)
    assert [m.window for m in plan.candidates] == list(range(L))
    # a link far slower than compute: nothing can be hidden, nothing is offloaded
    assert plan_window(LayerTimes.uniform(L, f=g / 3, g=g, c=100 * g)).window == 0
    # never below the window that frees what offloading every layer frees by the forward's end:
    # offloads finish in layer order, so window w frees min(w, peak_window) activation sets
    every = model_step(times, None)
    assert plan.peak_window == every.window - every.pending_at_fwd_end == 2
    for m in plan.candidates:
        assert m.window - m.pending_at_fwd_end == min(m.window, plan.peak_window)
    # the target moves the choice
    assert plan_window(times, 0.5).window >= plan.window
    # a fast device->host link with a slow way back: every offload finishes during the forward
    # (peak_window = L-1) but the reloads cannot hide; the plan keeps the peak savings and says
    # it misses the target rather than giving memory back
    lopsided = LayerTimes((g / 3,) * L, (g,) * L, (0.1 * g,) * L, (3 * g,) * L)
    kept = plan_window(lopsided, 0.9)
    assert kept.peak_window == L - 1 and kept.window == L - 1 and not kept.meets_target
    assert max(m.window for m in kept.candidates if m.hidden_fraction >= 0.9) < L - 1
    assert "below the target to keep the 7 activation sets" in kept.describe(L)
    assert plan.meets_target and "below the target" not in plan.describe(L)
    with pytest.raises(ValueError, match="target hidden fraction"):
        plan_window(times, 1.5)
    with pytest.raises(ValueError, match="bwd_s has 2 entries"):
        LayerTimes((1.0,), (1.0, 1.0), (1.0,), (1.0,))
    with pytest.raises(ValueError, match=">= 0 seconds"):
        LayerTimes((-1.0,), (1.0,), (1.0,), (1.0,))


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
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=1.0)
    expected = plan_window(times, 0.9).window
    assert 0 < expected < L - 1
    mgr, dev, keys = _auto_manager(L, times)
    assert mgr.config.max_offloaded_layers == "auto"  # the default
    tensors = [torch.randn(NBYTES // 4) for _ in keys]

    warm = run_manager_step(mgr, keys, tensors)  # the first step pays one-time costs: not timed
    assert (warm.window_source, warm.layers_offloaded, dev.stamps) == ("calibrating", L - 1, [])
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
    assert mgr.window_plan == plan_window(times, 0.9)
    assert f"offload window {expected} of {L - 1} layers" in caplog.text
    assert "from device timings of step 1" in caplog.text
    assert len(dev.stamps) == n_stamps  # only the calibration step was timed
    dev.clear_trace()
    s3 = run_manager_step(mgr, keys, tensors)  # the rest stay on the device: never copied
    assert s3.layers_offloaded == expected
    assert {e.tag for e in dev.trace if e.op == "copy"} == {f"L{i + 1}" for i in range(expected)}


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


@pytest.mark.parametrize("window,source,expected", [(None, "config", 5), (2, "config", 2),
                                                    (0, "config", 0)])
def test_fixed_windows_are_not_timed(window, source, expected):
    L = 6
    times = LayerTimes.uniform(L, f=1 / 3, g=1.0, c=1.0)
    mgr, dev, keys = _auto_manager(L, times, max_offloaded_layers=window)
    dev.completed = True
    for _ in range(3):
        s = run_manager_step(mgr, keys, [torch.randn(NBYTES // 4) for _ in keys])
        assert (s.window_source, s.offload_window, s.layers_offloaded) == (source, expected,
                                                                           expected)
    assert dev.stamps == [] and mgr.window_plan is None


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


@pytest.mark.parametrize("bad", ["Auto", "all", -1, True, 2.0])
def test_config_rejects_bad_windows(bad):
    with pytest.raises(ValueError, match="'auto', None or an int >= 0"):
        OffloadConfig(max_offloaded_layers=bad)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.9"])
def test_config_rejects_bad_targets(bad):
    with pytest.raises(ValueError, match="target_hidden_fraction must be a number in"):
        OffloadConfig(target_hidden_fraction=bad)

