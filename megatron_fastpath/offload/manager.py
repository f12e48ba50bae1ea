"""ActivationOffloadManager: pinned host pool + two fixed-address device reload buffers.

Unit of work is a *group*: the tensors one layer keeps for its backward (its input hidden states
when the layer is recomputed, or every saved tensor above ``min_offload_bytes`` otherwise).

Forward, layer i (compute stream C, offload stream O, reload stream R)::

    C: record e_ready(i)
    O: wait e_ready(i); wait e_read(slot i) (last reload out of the slot); copy group(i) -> host
       slot(i); record e_off(i)

The device tensors are handed to the allocator with ``record_stream(O)`` so their memory is not
reused before the copy has read them. The last registered layer is never offloaded (its backward
starts right after its forward), nor are layers past the offload window
(``OffloadConfig.max_offloaded_layers``). Offload order (``OffloadConfig.eager_offloads`` = K):
the offloads of the first K offloaded layers are issued as above; the groups of the others are
held (their device tensors stay referenced) and issued when the window's last layer closes its
group, latest layer first, so the copies the backward needs back first are not queued behind
the ones it needs last. ``"auto"`` plans window and order from device timings of a calibration
step (:mod:`megatron_fastpath.offload.plan`).

Backward, when layer i's backward starts (an autograd Function at the layer boundary)::

    C: record free(b) for the buffer b of the layer whose backward finished
    C: wait e_reload(i)                       (only if group(i) was offloaded)
    R: wait free(b'); wait e_off(i-1); copy host slot(i-1) -> buffer b';
       record e_reload(i-1) (= e_read(slot i-1))                           (DOUBLE: prefetch)
    C: layer i recompute + backward

so in DOUBLE mode the reload of layer i-1 overlaps layer i's backward, and the compute stream
waits only when a reload is not finished. SINGLE mode reloads group(i) just in time into the one
buffer; OFF keeps everything on the device. The reload buffers are allocated once and keep their
addresses (they only change when a group larger than the buffers shows up, which is logged).
Offloads and reloads use separate streams (separate copy engines on a GPU, the reload stream at
high priority), so a reload waits only for its own group's offload, never behind other offloads.

Guardrails (never a crash, never different numerics): the buffer mode is decided at the first
offload of every step from :meth:`OffloadDevice.memory_info` against ``headroom_margin_bytes``
(DOUBLE -> SINGLE -> OFF); a pinned-allocation failure switches the pool to pageable memory; a
host allocation failure, a group larger than the buffers or a busy host slot keeps that group on
the device. Each reason is logged once. No call blocks the host.

Not inside a CUDA graph capture: the copies fork side streams from the compute stream and the
reload schedule (which buffer, which layer, whether at all) is decided on the host every step,
which a graph replay would freeze. A capture raises before any stream is forked.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from megatron_fastpath.offload.config import AUTO, BufferMode, OffloadConfig, OffloadStepStats
from megatron_fastpath.offload.device import OffloadDevice, default_offload_device
from megatron_fastpath.offload.plan import LayerTimes, WindowPlan, plan_window
from megatron_fastpath.compat.te_quantized import (
    is_quantized,
    never_offload,
    restore_quantized,
    split_quantized,
)

__all__ = ["ActivationOffloadManager", "OffloadGroup"]

logger = logging.getLogger(__name__)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass
class _Item:
    """One tensor of a group: where it lives in the group's flat host slot / device buffer."""

    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int
    device_tensor: Optional[torch.Tensor]  # until offloaded (or forever when kept)


@dataclasses.dataclass(frozen=True)
class _Quantized:
    """A packed TE quantized tensor: rebuild ``obj`` from its components on unpack."""

    obj: Any
    parts: tuple  # per component: _Packed | torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class _Packed:
    group: "OffloadGroup"
    index: int


#: the step "auto" times: not the first, which pays one-time costs (kernel loading, autotuning,
#: allocator growth, host pool allocation) that would make compute look slower than it is
CALIBRATION_STEP = 1


@dataclasses.dataclass
class _Calibration:
    """Device timestamps of one step, for the ``"auto"`` window: label -> device handle."""

    step: int
    stamps: dict = dataclasses.field(default_factory=dict)
    nbytes: dict = dataclasses.field(default_factory=dict)  # layer key -> group bytes


class OffloadGroup:
    """The tensors of one layer's forward, offloaded (or kept) and reloaded together."""

    def __init__(self, key: str, index: int, seq: int, stays_on_device: bool):
        self.key = key
        self.index = index  # the layer's position in forward (registration) order
        self.seq = seq
        self.stays_on_device = stays_on_device  # the last layer, or past max_offloaded_layers
        self.items: list[_Item] = []
        self.nbytes = 0
        self._dedup: dict[tuple, int] = {}
        self.closed = False
        self.offloaded = False
        self.host: Optional[torch.Tensor] = None
        self.buffer: int = -1
        self.reload_event: Any = None
        self.offload_event: Any = None  # recorded on the offload stream after the group's d2h
        self.bwd_started = False

    def __repr__(self) -> str:
        return (f"OffloadGroup({self.key}, items={len(self.items)}, nbytes={self.nbytes}, "
                f"offloaded={self.offloaded}, buffer={self.buffer})")


class ActivationOffloadManager:
    """Double-buffered activation offload for checkpointed Megatron TransformerLayers.

    Args:
        config: :class:`OffloadConfig`.
        device: an :class:`OffloadDevice`; default :func:`default_offload_device` (CUDA when
            available, else a synchronous CPU device).

    Layers call :meth:`register_layer` once at construction, then per forward
    :meth:`open_group` / :meth:`pack` / :meth:`close_group` and per backward
    :meth:`begin_backward` / :meth:`unpack` / :meth:`end_backward`. The training loop calls
    :meth:`begin_step` before the step's first forward and :meth:`end_step` after its last
    backward (which returns the step's :class:`OffloadStepStats`); a forward without
    ``begin_step`` opens a step implicitly.
    """

    def __init__(self, config: Optional[OffloadConfig] = None,
                 device: Optional[OffloadDevice] = None):
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        if device is not None and not isinstance(device, OffloadDevice):
            raise TypeError(f"device must be an OffloadDevice, got {type(device).__name__}")
        self.config = config
        self._device = device
        self._layer_keys: list[str] = []
        # host pool: one flat slot per layer key, allocated once and reused
        self._host_slots: dict[str, torch.Tensor] = {}
        self._slot_read: dict[str, Any] = {}  # key -> event after the last reload out of it
        self._host_pinned = config.pinned
        self.host_pool_reallocs = 0
        # device reload buffers (fixed addresses)
        self._buffers: list[torch.Tensor] = []
        self._buffer_bytes = 0
        self._owner: list[Optional[OffloadGroup]] = []
        self._free_event: list[Any] = []
        self.buffer_reallocs = 0
        self._max_group_bytes = 0  # largest offloadable group seen (sizes the buffers)
        # per-pass state
        self._pending: list[OffloadGroup] = []  # offloaded groups not yet reloaded
        self._held: list[OffloadGroup] = []  # offloads held back (eager_offloads), not issued
        self._seq = 0
        # per-step state
        self._step = -1
        self._in_step = False
        self._mode: Optional[BufferMode] = None
        self._mode_reason = ""
        self._last_mode: Optional[BufferMode] = None
        self._logged: set[str] = set()
        self._counters = self._zero_counters()
        self._grad_anchor: Optional[torch.Tensor] = None
        self.history: list[OffloadStepStats] = []
        # offload window and order: fixed (int / None) or "auto" (planned from a calibration
        # step; _to_plan stays True until it is planned or cannot be)
        self._to_plan = AUTO in (config.max_offloaded_layers, config.eager_offloads)
        self._window: Optional[int] = (None if config.max_offloaded_layers == AUTO
                                       else config.max_offloaded_layers)
        self._eager: Optional[int] = (None if config.eager_offloads == AUTO
                                      else config.eager_offloads)
        self._window_source = "calibrating" if self._to_plan else "config"
        self._calib: Optional[_Calibration] = None
        self.window_plan: Optional[WindowPlan] = None

    # ---------------------------------------------------------------------------------------
    # properties
    # ---------------------------------------------------------------------------------------
    @property
    def device(self) -> OffloadDevice:
        if self._device is None:
            self._device = default_offload_device()
        return self._device

    @property
    def mode(self) -> Optional[BufferMode]:
        """Buffer mode of the current step (None until its first offload decision)."""
        return self._mode

    @property
    def host_pool_bytes(self) -> int:
        return sum(t.numel() for t in self._host_slots.values())

    @property
    def device_buffer_bytes(self) -> int:
        return sum(t.numel() for t in self._buffers)

    @property
    def num_device_buffers(self) -> int:
        return len(self._buffers)

    @property
    def host_pinned(self) -> bool:
        return self._host_pinned

    def grad_anchor(self, like: torch.Tensor) -> torch.Tensor:
        """A 0-element tensor requiring grad, so a checkpointed layer's outputs require grad
        even when none of its tensor inputs do."""
        if self._grad_anchor is None or self._grad_anchor.device != like.device:
            self._grad_anchor = torch.empty(0, device=like.device, requires_grad=True)
        return self._grad_anchor

    # ---------------------------------------------------------------------------------------
    # registration and steps
    # ---------------------------------------------------------------------------------------
    def register_layer(self, layer_number: int) -> str:
        """Register a layer (in build order, which is forward order); returns its group key.
        The last registered layer is never offloaded."""
        key = f"L{int(layer_number)}"
        if key in self._layer_keys:
            raise ValueError(
                f"layer_number {layer_number} registered twice with one offload manager; use "
                "one ActivationOffloadManager per model chunk (with_activation_offload per chunk)"
            )
        self._layer_keys.append(key)
        return key

    @property
    def layer_keys(self) -> tuple[str, ...]:
        return tuple(self._layer_keys)

    def begin_step(self) -> None:
        """Start a step: drop state of a pass whose backward never ran, re-check headroom at
        the step's first offload, reset the counters."""
        self._release_all_buffers()
        self._pending.clear()
        self._held.clear()
        self._step += 1
        self._in_step = True
        self._mode = None
        self._mode_reason = ""
        self._counters = self._zero_counters()
        self._advance_window()

    def end_step(self) -> OffloadStepStats:
        """Close the step and return its telemetry (no host sync: counts kept on the host)."""
        c = self._counters
        mode = self._mode if self._mode is not None else (
            BufferMode.OFF if not self.config.enabled else (self._last_mode or BufferMode.OFF))
        reason = self._mode_reason or ("disabled" if not self.config.enabled else "no offload")
        stats = OffloadStepStats(
            step=max(self._step, 0),
            mode=mode,
            mode_reason=reason,
            bytes_offloaded=c["bytes_offloaded"],
            bytes_reloaded=c["bytes_reloaded"],
            layers_offloaded=c["layers_offloaded"],
            layers_kept=c["layers_kept"],
            prefetched_reloads=c["prefetched"],
            just_in_time_reloads=c["jit"],
            est_exposed_copy_s=c["jit_bytes"] / self.config.copy_bandwidth_bytes_per_s,
            device_buffer_bytes=self.device_buffer_bytes,
            host_pool_bytes=self.host_pool_bytes,
            host_pinned=self._host_pinned,
            offload_window=self._effective_window(),
            window_source=self._window_source,
            eager_offloads=self._effective_eager(),
        )
        self.history.append(stats)
        self._in_step = False
        return stats

    @staticmethod
    def _zero_counters() -> dict:
        return dict(bytes_offloaded=0, bytes_reloaded=0, layers_offloaded=0, layers_kept=0,
                    prefetched=0, jit=0, jit_bytes=0)

    def _log_once(self, tag: str, msg: str, level: int = logging.WARNING) -> None:
        if tag in self._logged:
            return
        self._logged.add(tag)
        logger.log(level, "activation offload: %s", msg)

    # ---------------------------------------------------------------------------------------
    # forward: groups
    # ---------------------------------------------------------------------------------------
    def open_group(self, key: str) -> OffloadGroup:
        """Start collecting the tensors of layer ``key``'s forward."""
        if key not in self._layer_keys:
            raise ValueError(f"layer key {key!r} was not registered with this manager")
        if not self._in_step:
            self.begin_step()
        if self.config.enabled:
            self._refuse_capture()
        self._seq += 1
        index = self._layer_keys.index(key)
        # the window never includes the last layer: index >= window covers it
        return OffloadGroup(key, index, self._seq, index >= self._effective_window())

    def _refuse_capture(self) -> None:
        if self.device.is_capturing():
            raise RuntimeError(
                "activation offload cannot run inside a CUDA graph capture: its copies fork "
                "side streams from the capture stream and its reload schedule is decided on the "
                "host every step, which a graph replay would freeze. Turn off per-layer CUDA "
                "graphs (TransformerConfig.cuda_graph_impl='none', fastpath.cuda_graphs=false) "
                "or activation offload (OffloadConfig.enabled=False)"
            )

    def _wants(self, group: OffloadGroup, t: torch.Tensor) -> bool:
        if group.stays_on_device or not self.config.enabled or group.closed:
            return False
        if t.device != self.device.device or never_offload(t):
            return False
        if not t.is_contiguous():
            self._log_once("noncontig", "non-contiguous saved tensors stay on the device",
                           logging.INFO)
            return False
        return t.numel() * t.element_size() >= self.config.min_offload_bytes

    def pack(self, group: OffloadGroup, t: Any) -> Any:
        """Register ``t`` with ``group``; returns what :meth:`unpack` takes back.

        Plain tensors that are not worth offloading come back unchanged. TE quantized tensors are
        split with ``prepare_for_saving`` on a detached view (the live object keeps its data)
        and their data tensors packed one by one."""
        if is_quantized(t) and not isinstance(t, torch.nn.Parameter):
            split = split_quantized(t)
            if split is None:  # no way to make a view: leave it to autograd, on the device
                self._log_once(f"qview{type(t).__name__}", f"{type(t).__name__} has neither "
                               "detach() nor get_metadata(); kept on device", logging.INFO)
                return t
            tensors, obj = split
            parts = tuple(None if x is None else self.pack(group, x) for x in tensors)
            return _Quantized(obj, parts)
        if not isinstance(t, torch.Tensor) or not self._wants(group, t):
            return t
        storage = t.untyped_storage().data_ptr()
        dkey = (storage, t.storage_offset(), tuple(t.shape), t.dtype)
        index = group._dedup.get(dkey)
        if index is None:
            nbytes = t.numel() * t.element_size()
            offset = _align(group.nbytes, self.config.alignment_bytes) if group.items else 0
            group.items.append(_Item(t.shape, t.dtype, offset, nbytes, t))
            group.nbytes = offset + nbytes
            index = len(group.items) - 1
            group._dedup[dkey] = index
        return _Packed(group, index)

    def close_group(self, group: OffloadGroup) -> None:
        """Decide offload vs keep for the whole group and issue (or hold back) its device->host
        copies; at the window's last layer, issue the held-back groups, latest layer first."""
        group.closed = True
        group._dedup.clear()
        if self._calib is not None and self._calib.step == self._step:
            self._calib.nbytes.setdefault(group.key, group.nbytes)
        last = self._effective_window() - 1
        if group.items and not self._offload_group_allowed(group):
            self._counters["layers_kept"] += 1
        elif group.items:
            self._counters["bytes_offloaded"] += group.nbytes
            self._counters["layers_offloaded"] += 1
            if self._effective_eager() <= group.index < last:
                self._held.append(group)
            else:
                self._issue_offload(group)
        if group.index >= last:
            self._issue_held()

    def _issue_held(self) -> None:
        while self._held:
            self._issue_offload(self._held.pop())

    def _issue_offload(self, group: OffloadGroup) -> None:
        dev = self.device
        compute, offload = dev.compute_stream(), dev.offload_stream()
        ready = dev.new_event()
        dev.record_event(ready, compute)
        dev.wait_event(offload, ready)
        if self._slot_read.get(group.key) is not None:  # the slot's last reload has read it
            dev.wait_event(offload, self._slot_read[group.key])
        host = group.host
        self._stamp(("d2h", "begin", group.key), offload)
        for item in group.items:
            src = item.device_tensor
            dev.copy(self._view(host, item), src, offload, tag=group.key, direction="d2h")
            dev.record_stream(src, offload)
            item.device_tensor = None
        self._stamp(("d2h", "end", group.key), offload)
        group.offload_event = dev.new_event()
        dev.record_event(group.offload_event, offload)
        group.offloaded = True
        self._pending.append(group)

    def _offload_group_allowed(self, group: OffloadGroup) -> bool:
        self._max_group_bytes = max(self._max_group_bytes, group.nbytes)
        if self._mode is None:
            self._decide_mode()
        if self._mode is BufferMode.OFF:
            return False
        if group.nbytes > self._buffer_bytes:
            self._log_once(
                f"toolarge{group.nbytes}",
                f"group {group.key} ({group.nbytes} B) is larger than the reload buffers "
                f"({self._buffer_bytes} B) this step; kept on device, buffers grow next step",
            )
            return False
        busy = [g for g in self._pending + self._held if g.key == group.key]
        if busy:
            self._log_once("busy", f"host slot of {group.key} still holds an activation that was "
                           "not reloaded (several forwards in flight); kept on device")
            return False
        host = self._host_slot(group.key, group.nbytes)
        if host is None:
            return False
        group.host = host
        return True

    # ---------------------------------------------------------------------------------------
    # guardrails: headroom, buffers, host pool
    # ---------------------------------------------------------------------------------------
    def _decide_mode(self) -> None:
        cfg = self.config
        if not cfg.enabled:
            self._set_mode(BufferMode.OFF, "disabled by OffloadConfig.enabled=False")
            return
        need = self._max_group_bytes
        info = self.device.memory_info()
        headroom = info.headroom_bytes
        held = self.device_buffer_bytes
        candidates = [BufferMode.DOUBLE, BufferMode.SINGLE] if cfg.allow_double_buffer else [
            BufferMode.SINGLE]
        for mode in candidates:
            # bytes the mode adds (negative: releasing held buffers gives memory back)
            extra = mode.num_buffers * need - held
            if headroom - extra >= cfg.headroom_margin_bytes:
                if self._resize_buffers(mode, need):
                    reason = (f"headroom {headroom} B - {extra} B new buffers >= margin "
                              f"{cfg.headroom_margin_bytes} B")
                    if not cfg.allow_double_buffer:
                        reason = "double buffering disabled (allow_double_buffer=False)"
                    elif mode is BufferMode.SINGLE:
                        reason = (f"second buffer does not fit: headroom {headroom} B - "
                                  f"{2 * need - held} B < margin {cfg.headroom_margin_bytes} B; "
                                  f"one buffer fits")
                    self._set_mode(mode, reason)
                    return
        self._resize_buffers(BufferMode.OFF, need)
        self._set_mode(
            BufferMode.OFF,
            f"no reload buffer fits: headroom {headroom} B - {need - held} B < margin "
            f"{cfg.headroom_margin_bytes} B",
        )

    def _set_mode(self, mode: BufferMode, reason: str) -> None:
        self._mode, self._mode_reason = mode, reason
        if mode is not self._last_mode and (mode is not BufferMode.DOUBLE
                                            or self._last_mode is not None):
            explicit = not self.config.enabled or not self.config.allow_double_buffer
            level = logging.INFO if mode is BufferMode.DOUBLE or explicit else logging.WARNING
            logger.log(level, "activation offload: %s buffer mode (%s)", mode.value, reason)
        self._last_mode = mode

    def _resize_buffers(self, mode: BufferMode, nbytes: int) -> bool:
        """Hold exactly ``mode.num_buffers`` buffers of ``nbytes``; False on allocation failure
        (then nothing extra is held)."""
        self._release_all_buffers()
        want = mode.num_buffers
        if self._buffers and self._buffer_bytes != nbytes:
            self.buffer_reallocs += 1
            self._log_once(f"grow{nbytes}", f"reload buffers resized {self._buffer_bytes} -> "
                           f"{nbytes} B (addresses change once)")
            self._free_buffers(0)
        self._free_buffers(want)
        try:
            while len(self._buffers) < want:
                self._buffers.append(self.device.alloc_device(
                    nbytes, tag=f"reload_buffer_{'AB'[len(self._buffers)]}"))
                self._owner.append(None)
                self._free_event.append(None)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self._log_once(f"oom{want}", f"could not allocate {want} reload buffers ({exc})")
            self._free_buffers(0)
            return want == 0
        self._buffer_bytes = nbytes if want else 0
        return True

    def _free_buffers(self, keep: int) -> None:
        while len(self._buffers) > keep:
            self.device.free_device(self._buffers.pop())
            self._owner.pop()
            self._free_event.pop()
        if not self._buffers:
            self._buffer_bytes = 0

    def _release_all_buffers(self) -> None:
        dev = None
        for b, owner in enumerate(self._owner):
            if owner is not None:
                dev = dev or self.device
                ev = dev.new_event()
                dev.record_event(ev, dev.compute_stream())
                self._free_event[b] = ev
                self._owner[b] = None

    def _host_slot(self, key: str, nbytes: int) -> Optional[torch.Tensor]:
        slot = self._host_slots.get(key)
        if slot is not None and slot.numel() >= nbytes:
            return slot
        if slot is not None:
            self.host_pool_reallocs += 1
            self._log_once(f"hostgrow{key}", f"host slot {key} grows to {nbytes} B")
        try:
            slot = self._alloc_host(nbytes)
        except (RuntimeError, MemoryError) as exc:
            self._log_once("hostfail", f"host allocation of {nbytes} B failed ({exc}); "
                           "activations stay on the device")
            return None
        self._host_slots[key] = slot
        return slot

    def _alloc_host(self, nbytes: int) -> torch.Tensor:
        if self._host_pinned:
            try:
                return self.device.alloc_host(nbytes, pinned=True)
            except (RuntimeError, MemoryError) as exc:
                self._host_pinned = False
                self._log_once("pinned", f"pinned host allocation failed ({exc}); the host pool "
                               "uses pageable memory from now on (copies are slower)")
        return self.device.alloc_host(nbytes, pinned=False)

    @staticmethod
    def _view(flat: torch.Tensor, item: _Item) -> torch.Tensor:
        return flat[item.offset:item.offset + item.nbytes].view(item.dtype).view(item.shape)

    # ---------------------------------------------------------------------------------------
    # backward
    # ---------------------------------------------------------------------------------------
    def begin_backward(self, group: OffloadGroup) -> None:
        """Layer ``group``'s backward starts: free the buffer of the layer that finished, make
        sure ``group`` is (being) reloaded and have the compute stream wait for it, then prefetch
        the previous layer's group into the spare buffer (DOUBLE)."""
        dev = self.device
        if self.config.enabled:
            self._refuse_capture()
        self._issue_held()  # (a forward that ended before the window's last layer)
        compute = dev.compute_stream()
        for b, owner in enumerate(self._owner):
            if owner is not None and owner is not group and owner.bwd_started:
                ev = dev.new_event()
                dev.record_event(ev, compute)
                self._free_event[b] = ev
                self._owner[b] = None
        if group.offloaded:
            if group.reload_event is None:
                b = self._free_buffer()
                if b < 0:  # cannot happen with one owner per buffer; keep numerics anyway
                    raise RuntimeError("activation offload: no free reload buffer")
                self._issue_reload(group, b)
                self._counters["jit"] += 1
                self._counters["jit_bytes"] += group.nbytes
            dev.wait_event(compute, group.reload_event)
        group.bwd_started = True
        if self._mode is BufferMode.DOUBLE:
            prev = self._previous_pending(group)
            if prev is not None:
                b = self._free_buffer()
                if b >= 0:
                    self._issue_reload(prev, b)
                    self._counters["prefetched"] += 1
        self.mark("compute_begin", group.key, phase="bwd", buffer=group.buffer)

    def end_backward(self, group: OffloadGroup) -> None:
        self.mark("compute_end", group.key, phase="bwd", buffer=group.buffer)

    def mark(self, kind: str, key: str, phase: str, buffer: int = -1) -> None:
        """Compute-stream marker around a layer's forward / backward compute ("compute_begin" /
        "compute_end"): the device's marker (NVTX ranges, the recording device's trace) and, in
        an ``"auto"`` calibration step, a device timestamp."""
        self.device.mark(kind, key, phase=phase, buffer=buffer)
        edge = {"compute_begin": "begin", "compute_end": "end"}.get(kind)
        if edge is not None:
            self._stamp((phase, edge, key), self.device.compute_stream())

    def _free_buffer(self) -> int:
        for b, owner in enumerate(self._owner):
            if owner is None:
                return b
        return -1

    def _previous_pending(self, group: OffloadGroup) -> Optional[OffloadGroup]:
        best = None
        for g in self._pending:
            if g.seq < group.seq and g.reload_event is None and (best is None or g.seq > best.seq):
                best = g
        return best

    def _issue_reload(self, group: OffloadGroup, b: int) -> None:
        dev = self.device
        reload = dev.reload_stream()
        self._owner[b] = group
        group.buffer = b
        if self._free_event[b] is not None:
            dev.wait_event(reload, self._free_event[b])
        dev.wait_event(reload, group.offload_event)  # its host slot is fully written
        buf = self._buffers[b]
        self._stamp(("h2d", "begin", group.key), reload)
        for item in group.items:
            dev.copy(self._view(buf, item), self._view(group.host, item), reload,
                     tag=group.key, direction="h2d", buffer=b)
        self._stamp(("h2d", "end", group.key), reload)
        ev = dev.new_event()
        dev.record_event(ev, reload)
        group.reload_event = ev
        self._slot_read[group.key] = ev
        self._pending.remove(group)
        self._counters["bytes_reloaded"] += group.nbytes

    def unpack(self, packed: Any) -> Any:
        """Inverse of :meth:`pack` (valid between ``begin_backward`` and the next layer's)."""
        if isinstance(packed, _Packed):
            group, item = packed.group, packed.group.items[packed.index]
            if item.device_tensor is not None:
                return item.device_tensor
            if group.buffer < 0 or group.reload_event is None:
                raise RuntimeError(
                    f"activation offload: {group.key} unpacked before its backward started"
                )
            return self._view(self._buffers[group.buffer], item)
        if isinstance(packed, _Quantized):
            parts = [None if p is None else self.unpack(p) for p in packed.parts]
            return restore_quantized(packed.obj, parts)
        return packed

    # ---------------------------------------------------------------------------------------
    # offload window ("auto": calibrate one step on the device, then plan)
    # ---------------------------------------------------------------------------------------
    def _effective_window(self) -> int:
        """Layers (forward order) eligible for offload; the last layer never is."""
        n = len(self._layer_keys) - 1
        return n if self._window is None else min(self._window, n)

    def _effective_eager(self) -> int:
        """Offloads issued as their layers run; the window's others are held back."""
        n = self._effective_window()
        return n if self._eager is None else min(self._eager, n)

    def _stamp(self, label: tuple, stream: Any) -> None:
        c = self._calib
        if c is None or c.step != self._step or not self._in_step or label in c.stamps:
            return  # first micro-batch of the calibration step only
        c.stamps[label] = self.device.timestamp(stream, label)

    def _advance_window(self) -> None:
        """At a step's start: open the calibration step, or plan from a finished one whose
        device timestamps have all completed (polled, never waited for)."""
        if not self._to_plan or not self.config.enabled:
            return
        if not self.device.overlaps_copies:
            self._to_plan, self._window_source = False, "synchronous device"
            return
        if self._calib is None:
            if self._step >= CALIBRATION_STEP:
                self._calib = _Calibration(step=self._step)
        elif self._calib.step < self._step:
            self._try_plan()

    def _try_plan(self) -> None:
        c, dev, cfg = self._calib, self.device, self.config
        missing = object()

        def span(kind: str, key: str):
            a, b = c.stamps.get((kind, "begin", key)), c.stamps.get((kind, "end", key))
            if a is None or b is None:
                return missing
            return dev.elapsed_s(a, b)

        keys = self._layer_keys
        spans = {kind: [span(kind, k) for k in keys] for kind in ("fwd", "bwd", "d2h", "h2d")}
        if any(v is missing for kind in ("fwd", "bwd") for v in spans[kind]):
            self._calib, self._to_plan = None, False
            self._window_source = "unplanned: no compute timings"
            self._log_once("autowindow", "offload window 'auto': the calibration step has no "
                           "forward/backward timings for every layer (layers not marked); "
                           "offloading every layer but the last. Set "
                           "OffloadConfig.max_offloaded_layers to an int to choose the window")
            return
        if any(v is None for vals in spans.values() for v in vals):
            return  # the device has not finished the calibration step yet: ask next step

        def copy_times(kind: str) -> tuple[float, ...]:
            measured = [(c.nbytes.get(k, 0), t) for k, t in zip(keys, spans[kind])
                        if t is not missing]
            secs = sum(t for _, t in measured)
            bw = (sum(n for n, _ in measured) / secs if measured and secs > 0
                  else cfg.copy_bandwidth_bytes_per_s)
            return tuple(t if t is not missing else c.nbytes.get(k, 0) / bw
                         for k, t in zip(keys, spans[kind]))

        times = LayerTimes(tuple(spans["fwd"]), tuple(spans["bwd"]), copy_times("d2h"),
                           copy_times("h2d"), offload_at_layer_start=cfg.recompute)
        plan = plan_window(times, cfg.target_hidden_fraction, eager=cfg.eager_offloads,
                           window=cfg.max_offloaded_layers)
        self.window_plan, self._window_source = plan, "planned"
        self._window, self._eager = plan.window, plan.eager
        self._calib, self._to_plan = None, False
        level = logging.INFO if plan.meets_target and plan.window > 0 else logging.WARNING
        logger.log(level, "activation offload: %s (from device timings of step %d)%s",
                   plan.describe(len(keys)), c.step,
                   "; no offload would finish before the end of the forward or stay hidden: "
                   "nothing is offloaded" if plan.window == 0 else "")
