"""Two-stream timing model for a schedule recorded by :class:`RecordingDevice`.

The trace is in host issue order; the device runs each stream in order, a ``wait`` holds its
stream until the awaited event's ``record`` time, a copy takes ``nbytes / copy_bytes_per_s`` and a
compute region (between ``compute_begin`` and ``compute_end``) takes the duration given for its
(phase, layer). Host issue cost is taken as zero (the host runs ahead; the manager never blocks).

Besides the timings the replay checks the two hazards double buffering must avoid, for any
durations: a backward compute reading reload buffer b must start after the reload into b has
finished, and a reload into b must start after the previous backward compute that read b ended.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

from megatron_fastpath.offload.device import TraceEvent

__all__ = ["Interval", "StreamTimeline", "simulate_two_streams", "hidden_fraction"]


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


def simulate_two_streams(
    trace: Sequence[TraceEvent],
    compute_s: Durations,
    copy_bytes_per_s: float,
    copy_latency_s: float = 0.0,
    prior_events_done: bool = False,
) -> StreamTimeline:
    """Replay ``trace`` on in-order compute / copy streams.

    Args:
        trace: :attr:`RecordingDevice.trace`.
        compute_s: duration of a compute region: ``{"fwd": f, "bwd": g}`` (per phase), or
            ``{("bwd", "L3"): g3, ...}``, or a callable ``(phase, tag) -> seconds``.
        copy_bytes_per_s: copy bandwidth; copy_latency_s: fixed cost per copy call.
        prior_events_done: the trace starts mid-run (e.g. a later step): a wait on an event
            recorded before it is satisfied at time 0 instead of being reported as a hazard.
    """
    if copy_bytes_per_s <= 0:
        raise ValueError(f"copy_bytes_per_s must be > 0, got {copy_bytes_per_s}")

    def duration(phase: str, tag: str) -> float:
        if callable(compute_s):
            return float(compute_s(phase, tag))
        if (phase, tag) in compute_s:
            return float(compute_s[(phase, tag)])
        return float(compute_s.get(phase, 0.0))

    now = {"compute": 0.0, "copy": 0.0}
    event_time: dict[int, float] = {}
    open_compute: Optional[tuple[str, str, int, float]] = None
    intervals: list[Interval] = []
    hazards: list[str] = []
    stall = 0.0
    last_reload_end: dict[int, tuple[str, float]] = {}  # buffer -> (tag, end)
    last_read_end: dict[int, tuple[str, float]] = {}  # buffer -> (tag, end of bwd compute)
    compute_busy = copy_busy = 0.0
    num_reloads = 0

    for ev in trace:
        if ev.op == "record":
            event_time[ev.event] = now[ev.stream]
        elif ev.op == "wait":
            if ev.event not in event_time:
                if prior_events_done:
                    continue
                hazards.append(f"{ev.stream} waits on event {ev.event} before it is recorded")
                continue
            before = now[ev.stream]
            now[ev.stream] = max(before, event_time[ev.event])
            if ev.stream == "compute":
                stall += now["compute"] - before
        elif ev.op == "copy":
            start = now[ev.stream]
            d = copy_latency_s + ev.nbytes / copy_bytes_per_s
            now[ev.stream] = start + d
            copy_busy += d
            intervals.append(Interval(ev.stream, ev.direction, ev.tag, start, start + d, ev.buffer))
            if ev.direction == "h2d" and ev.buffer >= 0:
                num_reloads += 1
                prev = last_read_end.get(ev.buffer)
                if prev is not None and start < prev[1] - 1e-15:
                    hazards.append(
                        f"reload of {ev.tag} into buffer {ev.buffer} starts at {start:.3e} before "
                        f"the backward of {prev[0]} reading it ends at {prev[1]:.3e}"
                    )
                last_reload_end[ev.buffer] = (ev.tag, start + d)
        elif ev.op == "compute_begin":
            open_compute = (ev.phase, ev.tag, ev.buffer, now["compute"])
        elif ev.op == "compute_end":
            if open_compute is None:
                hazards.append(f"compute_end of {ev.tag} without compute_begin")
                continue
            phase, tag, buf, start = open_compute
            d = duration(phase, tag)
            now["compute"] = start + d
            compute_busy += d
            intervals.append(Interval("compute", phase, tag, start, start + d, buf))
            if phase == "bwd" and buf >= 0:
                reload = last_reload_end.get(buf)
                if reload is None or reload[0] != tag:
                    hazards.append(f"backward of {tag} reads buffer {buf} holding "
                                   f"{None if reload is None else reload[0]}")
                elif start < reload[1] - 1e-15:
                    hazards.append(
                        f"backward of {tag} starts at {start:.3e} before its reload into buffer "
                        f"{buf} ends at {reload[1]:.3e}"
                    )
                last_read_end[buf] = (tag, start + d)
            open_compute = None

    fwd = [iv.end for iv in intervals if iv.kind == "fwd"]
    bwd = [iv.end for iv in intervals if iv.kind == "bwd"]
    fwd_end = max(fwd) if fwd else 0.0
    bwd_end = max(bwd) if bwd else fwd_end
    makespan = max([iv.end for iv in intervals], default=0.0)
    return StreamTimeline(
        intervals=tuple(intervals), makespan=makespan, fwd_end=fwd_end,
        bwd_span=bwd_end - fwd_end, compute_busy=compute_busy, copy_busy=copy_busy,
        stall=stall, hazards=tuple(hazards), num_reloads=num_reloads,
    )


def hidden_fraction(timeline: StreamTimeline, num_layers: int, c: float, g: float) -> float:
    """Fraction of the ideal double-buffer saving (L-1)*min(c, g) that the replayed backward
    achieves, relative to fully serialised reloads (T_serial = L*g + R*c, R = reloaded groups,
    L-1 when every layer but the last is offloaded).

    1.0: every hideable copy hid behind compute; 0.0: nothing overlapped (single buffer)."""
    reloads = _reloaded_groups(timeline)
    if reloads == 0:
        return 0.0
    t_serial = num_layers * g + reloads * c
    return (t_serial - timeline.bwd_span) / (reloads * min(c, g))


def _reloaded_groups(timeline: StreamTimeline) -> int:
    return len({iv.tag for iv in timeline.intervals if iv.kind == "h2d"})
