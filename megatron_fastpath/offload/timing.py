"""Timing model of one recorded training step: the host and the device streams.

The trace (:attr:`RecordingDevice.trace`) is in host issue order. Every call carries the host time
it was issued at (``TraceEvent.host_s``: measured, the host's own issue cost with the device work
removed), and no device operation starts before the host issued it. The device runs each stream
(compute, offload, reload) in order; a ``wait`` holds its stream until the awaited event's
``record`` time; a copy takes ``copy_latency_s + nbytes / copy_bytes_per_s``; a compute region
(``compute_begin`` .. ``compute_end``) takes the duration given for its (phase, layer) -- measured
and per layer in the benchmark. A prefetch issued late on the host therefore starts late.

:func:`step_hidden_fraction` replays the WHOLE step (forward offloads and backward reloads): the
fraction of all copy time that did not lengthen the step, against the same step replayed with
free copies.

Besides the timings the replay checks the hazards the schedule must avoid, for any durations: a
backward compute reading reload buffer b must start after the reload into b finished, a reload
into b must start after the previous backward compute that read b ended, and a reload out of a
host slot must start after the offload into it finished.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Optional, Sequence, Union

from megatron_fastpath.offload.device import TraceEvent

__all__ = ["Interval", "StreamTimeline", "replay_schedule", "step_hidden_fraction"]


@dataclasses.dataclass(frozen=True)
class Interval:
    stream: str
    kind: str  # "fwd" / "bwd" / "d2h" / "h2d"
    tag: str
    start: float
    end: float
    buffer: int = -1


@dataclasses.dataclass(frozen=True)
class StreamTimeline:
    """Replay result (seconds).

    makespan: end of the last operation. fwd_end: end of the last forward compute.
    bwd_span: from ``fwd_end`` to the end of the last backward compute.
    compute_busy: sum of compute durations; copy_busy: sum of copy durations.
    stall: time the compute stream sat waiting on copies (exposed copy time).
    hazards: human-readable violations of the buffer ordering (empty when correct).
    """

    intervals: tuple[Interval, ...]
    makespan: float
    fwd_end: float
    bwd_span: float
    compute_busy: float
    copy_busy: float
    stall: float
    hazards: tuple[str, ...]
    num_reloads: int


Durations = Union[dict, Callable[[str, str], float]]


def _duration_fn(compute_s: Durations) -> Callable[[str, str], float]:
    def duration(phase: str, tag: str) -> float:
        if callable(compute_s):
            return float(compute_s(phase, tag))
        if (phase, tag) in compute_s:
            return float(compute_s[(phase, tag)])
        return float(compute_s.get(phase, 0.0))

    return duration


class _Replay:
    """State of one replay; :meth:`run` walks the trace once."""

    def __init__(self, compute_s, copy_bytes_per_s, copy_latency_s, prior_events_done, use_host):
        self.duration = _duration_fn(compute_s)
        self.copy_s = (lambda n: 0.0) if copy_bytes_per_s == float("inf") else (
            lambda n: copy_latency_s + n / copy_bytes_per_s)
        self.prior_done, self.use_host = prior_events_done, use_host
        self.now: dict[str, float] = defaultdict(float)
        self.event_time: dict[int, float] = {}
        self.open: Optional[tuple] = None
        self.intervals: list[Interval] = []
        self.hazards: list[str] = []
        self.stall = self.compute_busy = self.copy_busy = 0.0
        self.num_reloads = 0
        self.reload_end: dict[int, tuple[str, float]] = {}  # buffer -> (tag, end)
        self.read_end: dict[int, tuple[str, float]] = {}  # buffer -> (tag, bwd compute end)
        self.d2h_end: dict[str, float] = {}  # tag -> end of its last offload

    def issue(self, ev: TraceEvent, stream: str) -> float:
        """Earliest start on ``stream``: in order after its previous work, after host issue."""
        return max(self.now[stream], ev.host_s if self.use_host else 0.0)

    def run(self, trace: Sequence[TraceEvent]) -> None:
        for ev in trace:
            getattr(self, f"_{ev.op}", lambda ev: None)(ev)

    def _record(self, ev):
        self.event_time[ev.event] = self.issue(ev, ev.stream)

    def _wait(self, ev):
        if ev.event not in self.event_time:
            if not self.prior_done:
                self.hazards.append(f"{ev.stream} waits on event {ev.event} before it is recorded")
            return
        before = self.issue(ev, ev.stream)
        self.now[ev.stream] = max(before, self.event_time[ev.event])
        if ev.stream == "compute":
            self.stall += self.now["compute"] - before

    def _copy(self, ev):
        start = self.issue(ev, ev.stream)
        end = start + self.copy_s(ev.nbytes)
        self.now[ev.stream] = end
        self.copy_busy += end - start
        self.intervals.append(Interval(ev.stream, ev.direction, ev.tag, start, end, ev.buffer))
        if ev.direction == "d2h":
            self.d2h_end[ev.tag] = end
            return
        if ev.tag in self.d2h_end and start < self.d2h_end[ev.tag] - 1e-15:
            self.hazards.append(f"reload of {ev.tag} starts at {start:.3e} before its offload "
                                f"into the host slot ends at {self.d2h_end[ev.tag]:.3e}")
        if ev.buffer >= 0:
            self.num_reloads += 1
            prev = self.read_end.get(ev.buffer)
            if prev is not None and start < prev[1] - 1e-15:
                self.hazards.append(
                    f"reload of {ev.tag} into buffer {ev.buffer} starts at {start:.3e} before "
                    f"the backward of {prev[0]} reading it ends at {prev[1]:.3e}")
            self.reload_end[ev.buffer] = (ev.tag, end)

    def _compute_begin(self, ev):
        self.open = (ev.phase, ev.tag, ev.buffer, self.issue(ev, "compute"))

    def _compute_end(self, ev):
        if self.open is None:
            self.hazards.append(f"compute_end of {ev.tag} without compute_begin")
            return
        phase, tag, buf, start = self.open
        end = start + self.duration(phase, tag)
        self.now["compute"] = end
        self.compute_busy += end - start
        self.intervals.append(Interval("compute", phase, tag, start, end, buf))
        if phase == "bwd" and buf >= 0:
            reload = self.reload_end.get(buf)
            if reload is None or reload[0] != tag:
                self.hazards.append(f"backward of {tag} reads buffer {buf} holding "
                                    f"{None if reload is None else reload[0]}")
            elif start < reload[1] - 1e-15:
                self.hazards.append(f"backward of {tag} starts at {start:.3e} before its reload "
                                    f"into buffer {buf} ends at {reload[1]:.3e}")
            self.read_end[buf] = (tag, end)
        self.open = None

    def timeline(self) -> StreamTimeline:
        ends = lambda kind: [iv.end for iv in self.intervals if iv.kind == kind]  # noqa: E731
        fwd_end = max(ends("fwd"), default=0.0)
        bwd_end = max(ends("bwd"), default=fwd_end)
        return StreamTimeline(
            intervals=tuple(self.intervals),
            makespan=max([iv.end for iv in self.intervals], default=0.0), fwd_end=fwd_end,
            bwd_span=bwd_end - fwd_end, compute_busy=self.compute_busy,
            copy_busy=self.copy_busy, stall=self.stall, hazards=tuple(self.hazards),
            num_reloads=self.num_reloads)


def replay_schedule(
    trace: Sequence[TraceEvent],
    compute_s: Durations,
    copy_bytes_per_s: float,
    copy_latency_s: float = 0.0,
    prior_events_done: bool = False,
    use_host_times: bool = True,
) -> StreamTimeline:
    """Replay ``trace`` on the host and in-order device streams.

    Args:
        trace: :attr:`RecordingDevice.trace` (or a slice of it).
        compute_s: duration of a compute region: ``{"fwd": f, "bwd": g}`` (per phase), or
            ``{("bwd", "L3"): g3, ...}`` (per layer), or a callable ``(phase, tag) -> seconds``.
        copy_bytes_per_s: copy bandwidth (``float("inf")``: free copies);
            copy_latency_s: fixed cost per copy call.
        prior_events_done: the trace starts mid-run (e.g. a later step): a wait on an event
            recorded before it is satisfied at time 0 instead of being reported as a hazard.
        use_host_times: no device operation starts before ``TraceEvent.host_s`` (False: the
            host is infinitely far ahead).
    """
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s must be > 0, got {copy_bytes_per_s}")
    r = _Replay(compute_s, copy_bytes_per_s, copy_latency_s, prior_events_done, use_host_times)
    r.run(trace)
    return r.timeline()


def step_hidden_fraction(
    trace: Sequence[TraceEvent],
    compute_s: Durations,
    copy_bytes_per_s: float,
    **kw,
) -> tuple[float, StreamTimeline, StreamTimeline]:
    """Whole-step hidden fraction: 1 - (T_step - T_free) / copy time, where T_step is the replayed
    makespan of the step, T_free the same step with free copies, copy time the sum of every
    offload and reload. 1.0: no copy lengthened the step; 0.0: as slow as fully serial copies.

    Returns (fraction, timeline, timeline with free copies); fraction is 1.0 without copies."""
    step = replay_schedule(trace, compute_s, copy_bytes_per_s, **kw)
    free = replay_schedule(trace, compute_s, float("inf"), **kw)
    if step.copy_busy == 0:
        return 1.0, step, free
    return 1.0 - (step.makespan - free.makespan) / step.copy_busy, step, free
