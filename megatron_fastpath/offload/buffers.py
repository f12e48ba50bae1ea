"""Memory the activation offload holds: the fixed-address device reload buffers, the host pool
(one flat slot per layer, pinned when it can be), and the per-step headroom check that decides
how many reload buffers a step gets.

Shape key: N = bytes (every buffer and slot is a flat uint8 tensor, ``flat_N``; a group's
tensors are views of it, :meth:`megatron_fastpath.offload.group.GroupItem.view`).

Headroom: at the first offload of every step, :meth:`ReloadBuffers.choose_mode` reads
:meth:`OffloadDevice.memory_info` and takes the first of DOUBLE -> SINGLE -> OFF whose buffers
(each as large as the largest group seen) leave ``OffloadConfig.headroom_margin_bytes`` free; a
device allocation failure falls through to the next mode. The buffers are allocated once and keep
their addresses; they are reallocated only when a larger group shows up (logged once per size).

Host pool: a slot per layer key, allocated at the layer's first offload and reused every step;
it grows (logged once per layer) when the layer's group grows. A pinned-allocation failure
switches the pool to pageable memory for good; a host allocation failure returns no slot (the
manager keeps that group on the device). Each reason is logged once, through the manager's
``log_once`` (one logger, one "already said" set for every offload decision).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from megatron_fastpath.offload.config import BufferMode, OffloadConfig
from megatron_fastpath.offload.device import OffloadDevice
from megatron_fastpath.offload.group import OffloadGroup

__all__ = ["BufferChoice", "HostPool", "HostSlot", "ReloadBuffer", "ReloadBuffers"]

#: ``log_once(tag, message[, level])``: log ``message`` the first time ``tag`` is seen
LogOnce = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class BufferChoice:
    """The headroom check's answer for one step: the buffer mode and why (with the figures)."""

    mode: BufferMode
    reason: str


@dataclasses.dataclass
class ReloadBuffer:
    """One fixed-address device reload buffer and the group reloaded into it."""

    flat_N: torch.Tensor
    owner: Optional[OffloadGroup] = None  # its group, until a later layer's backward starts
    free_event: Any = None  # compute-stream event after the last backward that read it


class ReloadBuffers:
    """The device reload buffers (A, B): as many as the step's :class:`BufferMode` needs, each
    ``buffer_bytes`` large."""

    def __init__(self, log_once: LogOnce):
        self._log_once = log_once
        self.buffers: list[ReloadBuffer] = []
        self.buffer_bytes = 0  # bytes of each buffer (0 while none is held)
        self.largest_group = 0  # bytes of the largest offloadable group seen (sizes the buffers)
        self.reallocs = 0

    @property
    def total_bytes(self) -> int:
        return sum(b.flat_N.numel() for b in self.buffers)

    def note_group(self, nbytes: int) -> None:
        self.largest_group = max(self.largest_group, nbytes)

    def choose_mode(self, dev: OffloadDevice, config: OffloadConfig) -> BufferChoice:
        """Hold the buffers of the first mode (DOUBLE, SINGLE, OFF) that fits the device's
        headroom with ``config.headroom_margin_bytes`` to spare; returns that mode and why."""
        need = self.largest_group
        headroom = dev.memory_info().headroom_bytes
        held = self.total_bytes
        margin = config.headroom_margin_bytes
        candidates = ([BufferMode.DOUBLE, BufferMode.SINGLE] if config.allow_double_buffer
                      else [BufferMode.SINGLE])
        for mode in candidates:
            # bytes the mode adds (negative: releasing held buffers gives memory back)
            extra = mode.num_buffers * need - held
            if headroom - extra >= margin and self.resize(dev, mode, need):
                reason = f"headroom {headroom} B - {extra} B new buffers >= margin {margin} B"
                if not config.allow_double_buffer:
                    reason = "double buffering disabled (allow_double_buffer=False)"
                elif mode is BufferMode.SINGLE:
                    reason = (f"second buffer does not fit: headroom {headroom} B - "
                              f"{2 * need - held} B < margin {margin} B; one buffer fits")
                return BufferChoice(mode, reason)
        self.resize(dev, BufferMode.OFF, need)
        return BufferChoice(
            BufferMode.OFF,
            f"no reload buffer fits: headroom {headroom} B - {need - held} B < margin {margin} B",
        )

    def resize(self, dev: OffloadDevice, mode: BufferMode, nbytes: int) -> bool:
        """Hold exactly ``mode.num_buffers`` buffers of ``nbytes``; False on allocation failure
        (then nothing extra is held)."""
        self.release_all(dev)
        want = mode.num_buffers
        if self.buffers and self.buffer_bytes != nbytes:
            self.reallocs += 1
            self._log_once(f"grow{nbytes}", f"reload buffers resized {self.buffer_bytes} -> "
                           f"{nbytes} B (addresses change once)")
            self._free(dev, 0)
        self._free(dev, want)
        try:
            while len(self.buffers) < want:
                self.buffers.append(ReloadBuffer(dev.alloc_device(
                    nbytes, tag=f"reload_buffer_{'AB'[len(self.buffers)]}")))
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self._log_once(f"oom{want}", f"could not allocate {want} reload buffers ({exc})")
            self._free(dev, 0)
            return want == 0
        self.buffer_bytes = nbytes if want else 0
        return True

    def _free(self, dev: OffloadDevice, keep: int) -> None:
        while len(self.buffers) > keep:
            dev.free_device(self.buffers.pop().flat_N)
        if not self.buffers:
            self.buffer_bytes = 0

    def owned(self) -> bool:
        """Some buffer still holds a group."""
        return any(b.owner is not None for b in self.buffers)

    def release_all(self, dev: OffloadDevice) -> None:
        """Every buffer is free once the compute stream reaches this point."""
        for b in self.buffers:
            if b.owner is not None:
                self._release(dev, b)

    def release_finished(self, dev: OffloadDevice, current: OffloadGroup) -> None:
        """Free the buffers of layers whose backward has run (all but ``current``'s)."""
        for b in self.buffers:
            if b.owner is not None and b.owner is not current and b.owner.bwd_started:
                self._release(dev, b)

    @staticmethod
    def _release(dev: OffloadDevice, b: ReloadBuffer) -> None:
        ev = dev.new_event()
        dev.record_event(ev, dev.compute_stream())
        b.free_event, b.owner = ev, None

    def free_index(self) -> int:
        """Index of a buffer no group holds; -1 when every buffer is held."""
        for i, b in enumerate(self.buffers):
            if b.owner is None:
                return i
        return -1


@dataclasses.dataclass
class HostSlot:
    """One layer's flat host slot and the reload that last read it."""

    flat_N: torch.Tensor
    read_event: Any = None  # reload-stream event after the last reload out of this layer's slot


class HostPool:
    """Host memory for the offloaded groups: one :class:`HostSlot` per layer key."""

    def __init__(self, pinned: bool, log_once: LogOnce):
        self._log_once = log_once
        self.slots: dict[str, HostSlot] = {}
        self.pinned = pinned  # False for good once a pinned allocation failed
        self.reallocs = 0

    @property
    def total_bytes(self) -> int:
        return sum(s.flat_N.numel() for s in self.slots.values())

    def slot(self, dev: OffloadDevice, key: str, nbytes: int) -> Optional[torch.Tensor]:
        """Layer ``key``'s slot (flat_N), at least ``nbytes`` large; None when the host
        allocation fails (the group stays on the device)."""
        slot = self.slots.get(key)
        if slot is not None and slot.flat_N.numel() >= nbytes:
            return slot.flat_N
        if slot is not None:
            self.reallocs += 1
            self._log_once(f"hostgrow{key}", f"host slot {key} grows to {nbytes} B")
        try:
            flat_N = self._alloc(dev, nbytes)
        except (RuntimeError, MemoryError) as exc:
            self._log_once("hostfail", f"host allocation of {nbytes} B failed ({exc}); "
                           "activations stay on the device")
            return None
        if slot is None:
            self.slots[key] = HostSlot(flat_N)
        else:  # a grown slot: the next offload into it still waits for the last reload out
            slot.flat_N = flat_N
        return flat_N

    def _alloc(self, dev: OffloadDevice, nbytes: int) -> torch.Tensor:
        if self.pinned:
            try:
                return dev.alloc_host(nbytes, pinned=True)
            except (RuntimeError, MemoryError) as exc:
                self.pinned = False
                self._log_once("pinned", f"pinned host allocation failed ({exc}); the host pool "
                               "uses pageable memory from now on (copies are slower)")
        return dev.alloc_host(nbytes, pinned=False)
