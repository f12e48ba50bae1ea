"""Offload window planning: how many layers to offload so the copies stay hidden.

Key: L layers in forward order (index i), f_i / g_i forward / backward (recompute + backward)
device time of layer i, d_i / h_i the offload (device->host) / reload (host->device) copy time of
its group, ``window`` = N: layers 0..N-1 are offloaded (the last layer never is).

Why a window: offloads run back to back on one copy stream in forward order. When a copy takes
longer than a forward (d > f: with recompute, g ~ 3f, so already at c/g ~ 1/3) the offloads fall
behind the forward, and the LAST offloaded layer -- whose reload the backward needs FIRST -- is
copied out last: the backward stalls until the whole backlog has drained. Offloads still running
when the forward ends save no peak memory either (those activations are still on the device at
the peak). Keeping the last layers on the device removes the stall at no peak-memory cost.

:func:`model_step` is the closed-form replay of the manager's DOUBLE schedule (the same rules as
:func:`megatron_fastpath.offload.timing.replay_schedule` applied to the manager's recorded
trace, with the host ahead of the device); :func:`plan_window` returns the largest window whose
whole-step hidden fraction reaches the target, but never one that keeps an activation set on the
device at the peak that offloading every layer would have freed. ``ActivationOffloadManager``
calls it with device
times it measured in a calibration step (``OffloadConfig.max_offloaded_layers="auto"``);
``benchmarks/offload.py`` calls it with the per-layer times it measured on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["LayerTimes", "StepModel", "WindowPlan", "model_step", "plan_window"]


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Per-layer device times in seconds, forward order (index i = the i-th registered layer).

    fwd_s / bwd_s: forward / backward compute of the layer (backward includes the recompute);
    offload_s / reload_s: device->host / host->device copy of the layer's group;
    offload_at_layer_start: the group is the layer's input (recompute mode) and its copy may
        start when the layer's forward starts; False: it is issued after the forward (the tensors
        the forward saved).
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    offload_s: tuple[float, ...]
    reload_s: tuple[float, ...]
    offload_at_layer_start: bool = True

    def __post_init__(self):
        n = len(self.fwd_s)
        for name in ("bwd_s", "offload_s", "reload_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"LayerTimes.{name} has {len(getattr(self, name))} entries, "
                                 f"fwd_s has {n}: give one time per layer")
        for name in ("fwd_s", "bwd_s", "offload_s", "reload_s"):
            bad = [t for t in getattr(self, name) if not t >= 0]
            if bad:
                raise ValueError(f"LayerTimes.{name} must be >= 0 seconds, got {bad[0]!r}")

    @property
    def num_layers(self) -> int:
        return len(self.fwd_s)

    @classmethod
    def uniform(cls, layers: int, f: float, g: float, c: float, **kw) -> "LayerTimes":
        return cls((f,) * layers, (g,) * layers, (c,) * layers, (c,) * layers, **kw)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """One modelled step (seconds). hidden_fraction = 1 - (step_s - free_step_s) / copy_s
    (1.0 without copies); pending_at_fwd_end: offloads still running when the forward ends."""

    window: int
    step_s: float
    free_step_s: float
    copy_s: float
    hidden_fraction: float
    pending_at_fwd_end: int


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The chosen window and the model of every candidate (window 0 .. L-1).

    peak_window: the smallest window that frees, by the end of the forward, as many activation
    sets as offloading every layer does (offloads finish in layer order, so window w frees
    min(w, peak_window) of them): the chosen window is never below it."""

    window: int
    target: float
    chosen: StepModel
    candidates: tuple[StepModel, ...]
    peak_window: int = 0

    @property
    def meets_target(self) -> bool:
        return self.chosen.hidden_fraction >= self.target - 1e-12

    def describe(self, layers: int) -> str:
        m = self.chosen
        why = "" if self.meets_target else (
            f"; below the target to keep the {self.peak_window} activation sets that offloading "
            "every layer frees by the end of the forward")
        return (f"offload window {self.window} of {layers - 1} layers: modelled whole-step hidden "
                f"fraction {m.hidden_fraction:.3f} (target {self.target}), "
                f"{m.pending_at_fwd_end} offloads still running at the end of the forward{why}")


def model_step(times: LayerTimes, window: Optional[int]) -> StepModel:
    """The manager's DOUBLE schedule for one step (one micro-batch in flight, host ahead).

    Forward: the offload of layer i < window starts when its data is ready and the offload stream
    is free. Backward (layers L-1 .. 0), at layer i's start: the buffer of the layer that finished
    is freed; layer i's group, if it was not prefetched, is reloaded now (just in time); compute
    waits for it; the nearest earlier offloaded group is prefetched into the free buffer once the
    reload stream, the buffer and its own offload are done."""
    L = times.num_layers
    n = L - 1 if window is None else max(0, min(int(window), L - 1))
    off_end: dict[int, float] = {}
    t = off_free = 0.0
    for i in range(L):
        start, t = t, t + times.fwd_s[i]
        if i < n:
            ready = start if times.offload_at_layer_start else t
            off_free = off_end[i] = max(off_free, ready) + times.offload_s[i]
    fwd_end = t
    reload_end: dict[int, float] = {}
    owner: list[Optional[int]] = [None, None]
    free_at = [0.0, 0.0]
    started: set[int] = set()
    r = 0.0  # reload stream clock

    def reload(j: int, b: int) -> None:
        nonlocal r
        owner[b] = j
        r = reload_end[j] = max(r, free_at[b], off_end[j]) + times.reload_s[j]

    for i in reversed(range(L)):
        for b, o in enumerate(owner):
            if o is not None and o != i and o in started:
                owner[b], free_at[b] = None, t
        if i < n:
            if i not in reload_end:
                reload(i, owner.index(None))
            t = max(t, reload_end[i])
        started.add(i)
        pending = [j for j in range(min(i, n)) if j not in reload_end]
        if pending and None in owner:
            reload(pending[-1], owner.index(None))
        t += times.bwd_s[i]
    free = sum(times.fwd_s) + sum(times.bwd_s)
    copy = sum(times.offload_s[i] + times.reload_s[i] for i in range(n))
    hidden = 1.0 if copy == 0 else 1.0 - (t - free) / copy
    return StepModel(window=n, step_s=t, free_step_s=free, copy_s=copy, hidden_fraction=hidden,
                     pending_at_fwd_end=sum(1 for e in off_end.values() if e > fwd_end + 1e-15))


def plan_window(times: LayerTimes, target: float = 0.9) -> WindowPlan:
    """The largest window (0 .. L-1) whose modelled whole-step hidden fraction is >= ``target``
    (window 0 -- nothing offloaded -- always qualifies), raised to ``peak_window`` if it is
    smaller: offloading exists to lower the peak, so the plan drops only copies that would not
    have finished by the end of the forward (those save no peak memory), never one that would."""
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target hidden fraction must be in [0, 1], got {target!r}")
    models = tuple(model_step(times, w) for w in range(times.num_layers))
    every = model_step(times, None)
    peak_window = every.window - every.pending_at_fwd_end
    ok = [m.window for m in models if m.window == 0 or m.hidden_fraction >= target - 1e-12]
    window = max(max(ok), peak_window)
    return WindowPlan(window=window, target=target, chosen=models[window], candidates=models,
                      peak_window=peak_window)
