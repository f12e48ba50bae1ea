"""The small device interface the offload manager talks to.

Everything the manager does to a device goes through :class:`OffloadDevice`: the compute stream,
two copy streams (``offload_stream`` for device->host, ``reload_stream`` for host->device, so a
reload never queues behind the forward's offloads), events (record / wait), device and host
allocation, asynchronous copies, and the allocator statistics used for the per-step headroom
check. Two implementations:

* :class:`CudaOffloadDevice` -- real ``torch.cuda`` streams (the reload stream at high priority)
  and events, ``non_blocking`` copies, pinned host memory, ``torch.cuda.mem_get_info`` /
  ``memory_stats``. No call here blocks the host (no ``synchronize``, no ``event.synchronize``,
  no ``.item()``).
* :class:`RecordingDevice` -- a CPU fake: copies run synchronously on CPU tensors, and every call
  is appended to :attr:`RecordingDevice.trace` in host issue order (copy issued, event recorded /
  waited, compute begin / end per layer, device buffer alloc / free), with the host time it was
  issued at (wall clock minus the device work the fake ran inline) and the measured wall time of
  each copy and compute region. Failure injection for tests: ``free_bytes`` (simulated
  headroom), ``fail_pinned`` (pinned allocation raises), ``fail_host`` (every host allocation
  raises).

:mod:`megatron_fastpath.offload.timing` replays a recorded trace on a host + multi-stream model.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import time
from typing import Any, Optional

import torch

__all__ = [
    "MemoryInfo",
    "OffloadDevice",
    "CudaOffloadDevice",
    "RecordingDevice",
    "TraceEvent",
    "default_offload_device",
]


@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """Allocator statistics of the device (bytes).

    free_bytes: free memory reported by the driver (not held by the caching allocator).
    reserved_bytes / allocated_bytes: held by the caching allocator / in live tensors.
    peak_allocated_bytes: peak of allocated_bytes since the allocator's peak was last reset.
    """

    free_bytes: int
    total_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    peak_allocated_bytes: int

    @property
    def headroom_bytes(self) -> int:
        """Bytes that were still allocatable at the peak: what the driver has free plus what the
        caching allocator holds beyond the peak of live tensors."""
        return self.free_bytes + self.reserved_bytes - self.peak_allocated_bytes


class OffloadDevice(abc.ABC):
    """Streams, events, allocation and copies for :class:`ActivationOffloadManager`."""

    device: torch.device

    @abc.abstractmethod
    def compute_stream(self) -> Any:
        """The stream autograd runs the layers on (the current stream)."""

    @abc.abstractmethod
    def offload_stream(self) -> Any:
        """The side stream device->host offload copies are issued on (created once)."""

    @abc.abstractmethod
    def reload_stream(self) -> Any:
        """The side stream host->device reloads are issued on (created once; separate from the
        offload stream so a backward reload never waits behind forward offloads)."""

    def is_capturing(self) -> bool:
        """True while the compute stream is being captured into a CUDA graph."""
        return False

    @abc.abstractmethod
    def new_event(self) -> Any: ...

    @abc.abstractmethod
    def record_event(self, event: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, not the host) for ``event``."""

    @abc.abstractmethod
    def alloc_device(self, nbytes: int, tag: str = "") -> torch.Tensor:
        """A flat uint8 device tensor of ``nbytes`` (raises on out-of-memory)."""

    @abc.abstractmethod
    def free_device(self, buf: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A flat uint8 host tensor; raises RuntimeError/MemoryError when it cannot."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, *, tag: str,
             direction: str, buffer: int = -1) -> None:
        """Issue ``dst.copy_(src)`` on ``stream`` without blocking the host.

        direction: "d2h" (offload) or "h2d" (reload); tag: the layer group it belongs to;
        buffer: index of the device reload buffer written by a reload (-1 otherwise)."""

    @abc.abstractmethod
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``tensor`` is in use on ``stream`` (no reuse before it finishes)."""

    @abc.abstractmethod
    def memory_info(self) -> MemoryInfo: ...

    def mark(self, kind: str, tag: str, **info: Any) -> None:
        """Compute-stream marker: kind is "compute_begin" / "compute_end"."""

    #: copies on the side streams run concurrently with compute (False: a synchronous device,
    #: on which an offload window has nothing to hide and is not planned).
    overlaps_copies: bool = False

    def timestamp(self, stream: Any, label: tuple) -> Any:
        """Record a timing point on ``stream`` (device time, no host wait); ``label`` names it
        (("fwd"|"bwd"|"d2h"|"h2d", "begin"|"end", layer key)). None: this device has no timer."""
        return None

    def elapsed_s(self, start: Any, end: Any) -> Optional[float]:
        """Seconds between two timestamps once both have completed on the device; None while
        either is still pending (never blocks the host)."""
        return None


# --------------------------------------------------------------------------------------------
# Real CUDA
# --------------------------------------------------------------------------------------------
class CudaOffloadDevice(OffloadDevice):
    """``torch.cuda`` implementation: offload and reload side streams, events, pinned host memory.

    The reload stream has the highest stream priority (backward waits on it); the offload stream
    the default one. ``mark`` opens / closes NVTX ranges so the schedule is visible in Nsight
    Systems."""

    def __init__(self, device: Optional[torch.device] = None, nvtx: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaOffloadDevice needs CUDA; on a CPU machine use RecordingDevice "
                "(megatron_fastpath.offload.default_offload_device() picks one for you)."
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self._offload_stream: Optional[torch.cuda.Stream] = None
        self._reload_stream: Optional[torch.cuda.Stream] = None
        self._nvtx = nvtx

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def offload_stream(self):
        if self._offload_stream is None:
            self._offload_stream = torch.cuda.Stream(device=self.device)
        return self._offload_stream

    def reload_stream(self):
        if self._reload_stream is None:
            # lower is higher; torch maps -1 to the device's highest priority when out of range
            self._reload_stream = torch.cuda.Stream(device=self.device, priority=-1)
        return self._reload_stream

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def new_event(self):
        return torch.cuda.Event()

    def record_event(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def alloc_device(self, nbytes: int, tag: str = "") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def free_device(self, buf: torch.Tensor) -> None:
        # The caching allocator frees once the last reference is dropped by the caller; any
        # pending copy-stream use was registered with record_stream.
        del buf

    def alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)

    def copy(self, dst, src, stream, *, tag: str, direction: str, buffer: int = -1) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        return MemoryInfo(
            free_bytes=int(free),
            total_bytes=int(total),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
            peak_allocated_bytes=int(stats.get("allocated_bytes.all.peak", 0)),
        )

    def mark(self, kind: str, tag: str, **info: Any) -> None:
        if not self._nvtx:
            return
        if kind == "compute_begin":
            torch.cuda.nvtx.range_push(f"offload/{info.get('phase', '')}/{tag}")
        elif kind == "compute_end":
            torch.cuda.nvtx.range_pop()

    overlaps_copies = True

    def timestamp(self, stream, label: tuple):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def elapsed_s(self, start, end) -> Optional[float]:
        # query() polls without blocking; elapsed_time on two completed events does not wait
        if start is None or end is None or not (start.query() and end.query()):
            return None
        return start.elapsed_time(end) / 1e3


# --------------------------------------------------------------------------------------------
# CPU recording fake
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One call recorded by :class:`RecordingDevice`, in host issue order.

    op: "compute_begin" | "compute_end" | "copy" | "record" | "wait" | "alloc_device" |
        "free_device" | "alloc_host".
    stream: "compute" | "offload" | "reload" | "" (allocations).
    tag: layer group ("L3"), or the buffer name for allocations.
    event: event id for record / wait (-1 otherwise).
    nbytes: bytes copied / allocated.
    direction: "d2h" / "h2d" for copies.
    phase: "fwd" / "bwd" for compute markers.
    buffer: device reload buffer index a copy writes / a backward compute reads (-1: none).
    host_s: host time the call was issued at, seconds since the trace was cleared, without the
        device work the CPU fake ran inline (copies, compute regions): the host's own issue cost.
    wall_s: measured wall time of a copy or, on ``compute_end``, of the compute region.
    """

    op: str
    stream: str = ""
    tag: str = ""
    event: int = -1
    nbytes: int = 0
    direction: str = ""
    phase: str = ""
    buffer: int = -1
    host_s: float = 0.0
    wall_s: float = 0.0


class _FakeEvent:
    _ids = itertools.count()

    def __init__(self):
        self.id = next(self._ids)
        self.recorded = False


class RecordingDevice(OffloadDevice):
    """CPU stand-in for a GPU that records the exact schedule.

    Args:
        free_bytes: simulated driver-free device memory (the headroom the manager sees); device
            buffer allocations subtract from it, frees add back. Change it between steps to
            simulate a shrinking budget.
        total_bytes: simulated device size.
        fail_pinned: pinned host allocations raise RuntimeError (simulated cudaHostAlloc
            failure); pageable ones succeed.
        fail_host: every host allocation raises (the manager must keep activations on device).
        record: append to :attr:`trace` (False: behave as a plain synchronous CPU device).
    """

    def __init__(self, free_bytes: int = 1 << 40, total_bytes: int = 1 << 40,
                 fail_pinned: bool = False, fail_host: bool = False, record: bool = True):
        self.device = torch.device("cpu")
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.fail_pinned = fail_pinned
        self.fail_host = fail_host
        self.record = record
        self.trace: list[TraceEvent] = []
        self.live_device_buffers = 0
        self.max_live_device_buffers = 0
        self.live_device_bytes = 0
        self.peak_device_bytes = 0
        self.host_allocations = 0
        self._t0 = time.perf_counter()
        self._inline_s = 0.0  # device work run inline on the host since _t0
        self._compute_t0: Optional[float] = None

    # -- helpers for tests ---------------------------------------------------------------
    def clear_trace(self) -> None:
        self.trace.clear()
        self._t0, self._inline_s = time.perf_counter(), 0.0

    def _log(self, **kw) -> None:
        if self.record:
            host = time.perf_counter() - self._t0 - self._inline_s
            self.trace.append(TraceEvent(host_s=host, **kw))

    # -- streams / events ------------------------------------------------------------------
    def compute_stream(self):
        return "compute"

    def offload_stream(self):
        return "offload"

    def reload_stream(self):
        return "reload"

    def new_event(self):
        return _FakeEvent()

    def record_event(self, event, stream) -> None:
        event.recorded = True
        self._log(op="record", stream=stream, event=event.id)

    def wait_event(self, stream, event) -> None:
        if not event.recorded:
            raise RuntimeError(f"stream {stream} waits on event {event.id} never recorded")
        self._log(op="wait", stream=stream, event=event.id)

    # -- memory ----------------------------------------------------------------------------
    def alloc_device(self, nbytes: int, tag: str = "") -> torch.Tensor:
        if nbytes > self.free_bytes:
            raise torch.OutOfMemoryError(
                f"RecordingDevice: simulated OOM allocating {nbytes} B ({self.free_bytes} free)"
            )
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.free_bytes -= nbytes
        self.live_device_buffers += 1
        self.max_live_device_buffers = max(self.max_live_device_buffers, self.live_device_buffers)
        self.live_device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.live_device_bytes)
        self._log(op="alloc_device", tag=tag, nbytes=nbytes)
        return buf

    def free_device(self, buf: torch.Tensor) -> None:
        self.free_bytes += buf.numel()
        self.live_device_buffers -= 1
        self.live_device_bytes -= buf.numel()
        self._log(op="free_device", nbytes=buf.numel())

    def alloc_host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self.fail_host:
            raise MemoryError(f"RecordingDevice: simulated host allocation failure ({nbytes} B)")
        if pinned and self.fail_pinned:
            raise RuntimeError(
                f"RecordingDevice: simulated cudaHostAlloc failure ({nbytes} B pinned)"
            )
        self.host_allocations += 1
        self._log(op="alloc_host", nbytes=nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst, src, stream, *, tag: str, direction: str, buffer: int = -1) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            dst.copy_(src)
        wall = time.perf_counter() - t0
        self._inline_s += wall  # ran inline: host_s below is the time it was issued at
        self._log(op="copy", stream=stream, tag=tag, nbytes=src.numel() * src.element_size(),
                  direction=direction, buffer=buffer, wall_s=wall)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass

    def memory_info(self) -> MemoryInfo:
        used = self.total_bytes - self.free_bytes
        return MemoryInfo(free_bytes=self.free_bytes, total_bytes=self.total_bytes,
                          reserved_bytes=used, allocated_bytes=used, peak_allocated_bytes=used)

    def mark(self, kind: str, tag: str, **info: Any) -> None:
        now, wall = time.perf_counter(), 0.0
        if kind == "compute_begin":
            self._compute_t0 = now
        elif kind == "compute_end" and self._compute_t0 is not None:
            wall, self._compute_t0 = now - self._compute_t0, None
            self._inline_s += wall  # the region ran inline: not host issue time
        self._log(op=kind, stream="compute", tag=tag, phase=info.get("phase", ""),
                  buffer=info.get("buffer", -1), wall_s=wall)


def default_offload_device() -> OffloadDevice:
    """CudaOffloadDevice on a CUDA machine, else a non-recording RecordingDevice (CPU runs:
    the offload is a synchronous host copy, numerics are unchanged)."""
    if torch.cuda.is_available():
        return CudaOffloadDevice()
    return RecordingDevice(record=False)

