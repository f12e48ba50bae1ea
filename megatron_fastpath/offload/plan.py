"""Offload planning: how many layers to offload, and in which order, so the copies stay hidden.

Key: L layers in forward order (index i), f_i / g_i forward / backward (recompute + backward)
device time of layer i, d_i / h_i the offload (device->host) / reload (host->device) copy time of
its group, ``window`` = n: layers 0..n-1 are offloaded (the last layer never is), ``eager`` = k:
the offloads of layers 0..k-1 are issued as their layers run; those of layers k..n-1 are held
back and issued when layer n-1's is, latest layer first (k = n: every offload in forward order).

Why an order: offloads run back to back on one copy stream in the order they are issued. When a
copy takes longer than a forward (d > f: with recompute, g ~ 3f, so already at c/g ~ 1/3) the
offloads fall behind the forward, and in forward order the LAST offloaded layer -- whose reload
the backward needs FIRST -- is copied out last: the backward stalls until the whole backlog has
drained. Issuing the held-back offloads latest layer first puts the copies in the order the
backward needs them back. Offloads still running when the forward ends save no peak memory
(those activations are still on the device at the peak), so an order is only taken when it
leaves no more of them running than forward order does.

Why a window: some copies cannot be hidden in any order (the last offloaded layer's round trip,
d + h, must fit between its forward and its backward). Keeping the last layers on the device
removes them; the planner only does so for offloads that would not have finished by the end of
the forward anyway.

:func:`model_step` is the closed-form replay of the manager's DOUBLE schedule (the same rules as
:func:`megatron_fastpath.offload.timing.replay_schedule` applied to the manager's recorded
trace, with the host ahead of the device); :func:`plan_order` returns a window's best order;
:func:`plan_window` the largest window whose whole-step hidden fraction (in its best order)
reaches the target, but never one that keeps an activation set on the device at the peak that a
larger window would have freed. ``ActivationOffloadManager`` calls it with device times it
measured in a calibration step (``OffloadConfig.max_offloaded_layers`` / ``eager_offloads`` =
``"auto"``); ``benchmarks/offload.py`` calls it with the per-layer times it measured on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from megatron_fastpath.offload.config import AUTO

__all__ = ["LayerTimes", "StepModel", "WindowPlan", "model_step", "plan_order", "plan_window"]


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
    (1.0 without copies); pending_at_fwd_end: offloads still running when the forward ends;
    eager: offloads issued in forward order (== window: no offload held back)."""

    window: int
    eager: int
    step_s: float
    free_step_s: float
    copy_s: float
    hidden_fraction: float
    pending_at_fwd_end: int


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The chosen window and order, and the model of every candidate window (0 .. L-1, each in
    the order :func:`plan_window` was asked for).

    peak_window: the smallest window that frees, by the end of the forward, as many activation
    sets as any window does: the chosen window is never below it (unless it was fixed).
    window_fixed: the window was given (``max_offloaded_layers`` an int or None), only the order
    was planned."""

    window: int
    target: float
    chosen: StepModel
    candidates: tuple[StepModel, ...]
    peak_window: int = 0
    window_fixed: bool = False

    @property
    def eager(self) -> int:
        return self.chosen.eager

    @property
    def meets_target(self) -> bool:
        return self.chosen.hidden_fraction >= self.target - 1e-12

    def describe(self, layers: int) -> str:
        m = self.chosen
        held = m.window - m.eager
        order = ("in forward order" if held <= 1 else
                 f"the first {m.eager} in forward order, the last {held} latest layer first")
        why = ""
        if not self.meets_target:
            why = ("; the window is fixed (max_offloaded_layers)" if self.window_fixed else
                   f"; below the target to keep the {self.peak_window} activation sets that "
                   "the largest window frees by the end of the forward")
        return (f"offload window {self.window} of {layers - 1} layers, {order}: modelled "
                f"whole-step hidden fraction {m.hidden_fraction:.3f} (target {self.target}), "
                f"{m.pending_at_fwd_end} offloads still running at the end of the forward{why}")


def model_step(times: LayerTimes, window: Optional[int], eager: Optional[int] = None
               ) -> StepModel:
    """The manager's DOUBLE schedule for one step (one micro-batch in flight, host ahead).

    Forward: the offload of layer i < eager starts when its data is ready and the offload stream
    is free; those of layers eager..window-1 are issued when layer window-1's data is ready,
    latest layer first (``eager`` None or >= window: forward order). Backward (layers L-1 .. 0),
    at layer i's start: the buffer of the layer that finished is freed; layer i's group, if it
    was not prefetched, is reloaded now (just in time); compute waits for it; the nearest
    earlier offloaded group is prefetched into the free buffer once the reload stream, the
    buffer and its own offload are done."""
    L = times.num_layers
    n = L - 1 if window is None else max(0, min(int(window), L - 1))
    k = n if eager is None else max(0, min(int(eager), n))
    ready: list[float] = []
    t = 0.0
    for i in range(L):
        ready.append(t if times.offload_at_layer_start else t + times.fwd_s[i])
        t += times.fwd_s[i]
    fwd_end = t
    off_end: dict[int, float] = {}
    off_free = 0.0
    for i in [*range(k), *reversed(range(k, n))]:
        at = ready[i] if i < k else ready[n - 1]
        off_free = off_end[i] = max(off_free, at) + times.offload_s[i]
    reload_end: dict[int, float] = {}
    owner: list[Optional[int]] = [None, None]
    free_at = [0.0, 0.0]
    r = 0.0  # reload stream clock
    nxt = n - 1  # reloads are issued in descending layer order: the highest one not issued

    def reload(j: int, b: int) -> None:
        nonlocal r, nxt
        owner[b], nxt = j, j - 1
        r = reload_end[j] = max(r, free_at[b], off_end[j]) + times.reload_s[j]

    for i in reversed(range(L)):
        for b, o in enumerate(owner):
            if o is not None and o > i:  # its backward (which started before i's) finished
                owner[b], free_at[b] = None, t
        if i < n:
            if i not in reload_end:
                reload(i, owner.index(None))
            t = max(t, reload_end[i])
        if 0 <= nxt < i and None in owner:
            reload(nxt, owner.index(None))
        t += times.bwd_s[i]
    free = sum(times.fwd_s) + sum(times.bwd_s)
    copy = sum(times.offload_s[i] + times.reload_s[i] for i in range(n))
    hidden = 1.0 if copy == 0 else 1.0 - (t - free) / copy
    return StepModel(window=n, eager=k, step_s=t, free_step_s=free, copy_s=copy,
                     hidden_fraction=hidden,
                     pending_at_fwd_end=sum(1 for e in off_end.values() if e > fwd_end + 1e-15))


def plan_order(times: LayerTimes, window: Optional[int]) -> StepModel:
    """``window`` in its best order: the ``eager`` count (0 .. window) with the highest modelled
    hidden fraction among those that leave no more offloads running at the end of the forward
    than forward order does (no less memory freed at the peak); ties go to the most eager
    (copies start earliest). Forward order when nothing beats it."""
    best = fifo = model_step(times, window)
    for k in reversed(range(max(fifo.window - 1, 0))):  # eager = window - 1 is forward order
        m = model_step(times, window, k)
        if (m.pending_at_fwd_end <= fifo.pending_at_fwd_end
                and m.hidden_fraction > best.hidden_fraction + 1e-12):
            best = m
    return best


def plan_window(times: LayerTimes, target: float = 0.9, eager: Union[int, str, None] = AUTO,
                window: Union[int, str, None] = AUTO) -> WindowPlan:
    """The largest window (0 .. L-1) whose modelled whole-step hidden fraction is >= ``target``
    (window 0 -- nothing offloaded -- always qualifies), raised to ``peak_window`` if it is
    smaller: offloading exists to lower the peak, so the plan drops only copies that would not
    have finished by the end of the forward (those save no peak memory), never one that would.

    eager: ``"auto"`` -- each window in its best order (:func:`plan_order`); None or an int --
    that order for every window. window: ``"auto"`` -- planned as above; None (every layer but
    the last) or an int -- fixed, only its order is planned."""
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target hidden fraction must be in [0, 1], got {target!r}")
    models = tuple(plan_order(times, w) if eager == AUTO else model_step(times, w, eager)
                   for w in range(times.num_layers))
    freed = [m.window - m.pending_at_fwd_end for m in models]
    peak_window = freed.index(max(freed))
    if window != AUTO:
        n = models[-1].window if window is None else max(0, min(int(window), len(models) - 1))
        return WindowPlan(window=n, target=target, chosen=models[n], candidates=models,
                          peak_window=peak_window, window_fixed=True)
    ok = [m.window for m in models if m.window == 0 or m.hidden_fraction >= target - 1e-12]
    chosen = max(max(ok), peak_window)
    return WindowPlan(window=chosen, target=target, chosen=models[chosen], candidates=models,
                      peak_window=peak_window)
