"""ActivationOffloadManager: the per-step state machine that moves each layer's activations to a
pinned host pool and back into fixed-address device reload buffers.

Unit of work is a *group* (:mod:`megatron_fastpath.offload.group`): the tensors one layer keeps
for its backward (its input hidden states when the layer is recomputed, or every saved tensor
above ``min_offload_bytes`` otherwise). The memory it moves them through -- reload buffers, host
pool, the per-step headroom check -- is :mod:`megatron_fastpath.offload.buffers`; the device
timings ``"auto"`` plans from are :mod:`megatron_fastpath.offload.calibration`. This module
decides, per step, what is offloaded, when each copy is issued and on which stream.

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
(DOUBLE -> SINGLE -> OFF, :meth:`~megatron_fastpath.offload.buffers.ReloadBuffers.choose_mode`);
a pinned-allocation failure switches the pool to pageable memory; a host allocation failure, a
group larger than the buffers or a busy host slot keeps that group on the device. Each reason is
logged once. No call blocks the host.

Not inside a CUDA graph capture: the copies fork side streams from the compute stream and the
reload schedule (which buffer, which layer, whether at all) is decided on the host every step,
which a graph replay would freeze. A capture raises before any stream is forked.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_fastpath.offload.buffers import HostPool, ReloadBuffers
from megatron_fastpath.offload.calibration import CALIBRATION_STEP, Calibration
from megatron_fastpath.offload.config import (
    AUTO,
    BufferMode,
    OffloadConfig,
    OffloadStepStats,
    StepCounters,
)
from megatron_fastpath.offload.device import OffloadDevice, default_offload_device
from megatron_fastpath.offload.group import OffloadGroup, Packed, PackedQuantized
from megatron_fastpath.offload.plan import WindowPlan, plan_window
from megatron_fastpath.compat.te_quantized import (
    is_quantized,
    never_offload,
    restore_quantized,
    split_quantized,
)

__all__ = ["ActivationOffloadManager", "OffloadGroup"]

logger = logging.getLogger(__name__)


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
        self._logged: set[str] = set()
        # host pool: one flat slot per layer key, allocated once and reused
        self._pool = HostPool(config.pinned, self._log_once)
        # device reload buffers (fixed addresses)
        self._buffers = ReloadBuffers(self._log_once)
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
        self._counters = StepCounters()
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
        self._calib: Optional[Calibration] = None
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
        return self._pool.total_bytes

    @property
    def device_buffer_bytes(self) -> int:
        return self._buffers.total_bytes

    @property
    def num_device_buffers(self) -> int:
        return len(self._buffers.buffers)

    @property
    def host_pinned(self) -> bool:
        return self._pool.pinned

    @property
    def host_pool_reallocs(self) -> int:
        """Times a layer's host slot grew (a larger group than before)."""
        return self._pool.reallocs

    @property
    def buffer_reallocs(self) -> int:
        """Times the reload buffers were reallocated (a larger group than before)."""
        return self._buffers.reallocs

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
        if self._buffers.owned():
            self._buffers.release_all(self.device)
        self._pending.clear()
        self._held.clear()
        self._step += 1
        self._in_step = True
        self._mode = None
        self._mode_reason = ""
        self._counters = StepCounters()
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
            bytes_offloaded=c.bytes_offloaded,
            bytes_reloaded=c.bytes_reloaded,
            layers_offloaded=c.layers_offloaded,
            layers_kept=c.layers_kept,
            prefetched_reloads=c.prefetched_reloads,
            just_in_time_reloads=c.just_in_time_reloads,
            est_exposed_copy_s=c.just_in_time_bytes / self.config.copy_bandwidth_bytes_per_s,
            device_buffer_bytes=self.device_buffer_bytes,
            host_pool_bytes=self.host_pool_bytes,
            host_pinned=self.host_pinned,
            offload_window=self._effective_window(),
            window_source=self._window_source,
            eager_offloads=self._effective_eager(),
        )
        self.history.append(stats)
        self._in_step = False
        return stats

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
            return PackedQuantized(obj, parts)
        if not isinstance(t, torch.Tensor) or not self._wants(group, t):
            return t
        return Packed(group, group.add(t, self.config.alignment_bytes))

    def close_group(self, group: OffloadGroup) -> None:
        """Decide offload vs keep for the whole group and issue (or hold back) its device->host
        copies; at the window's last layer, issue the held-back groups, latest layer first."""
        group.close()
        if self._calib is not None:
            self._calib.note_group(self._step, group.key, group.nbytes)
        last = self._effective_window() - 1
        if group.items and not self._offload_group_allowed(group):
            self._counters.layers_kept += 1
        elif group.items:
            self._counters.bytes_offloaded += group.nbytes
            self._counters.layers_offloaded += 1
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
        read = self._pool.slots[group.key].read_event
        if read is not None:  # the slot's last reload has read it
            dev.wait_event(offload, read)
        host = group.host
        self._stamp(("d2h", "begin", group.key), offload)
        for item in group.items:
            src = item.device_tensor
            dev.copy(item.view(host), src, offload, tag=group.key, direction="d2h")
            dev.record_stream(src, offload)
            item.device_tensor = None
        self._stamp(("d2h", "end", group.key), offload)
        group.offload_event = dev.new_event()
        dev.record_event(group.offload_event, offload)
        group.offloaded = True
        self._pending.append(group)

    def _offload_group_allowed(self, group: OffloadGroup) -> bool:
        self._buffers.note_group(group.nbytes)
        if self._mode is None:
            self._decide_mode()
        if self._mode is BufferMode.OFF:
            return False
        if group.nbytes > self._buffers.buffer_bytes:
            self._log_once(
                f"toolarge{group.nbytes}",
                f"group {group.key} ({group.nbytes} B) is larger than the reload buffers "
                f"({self._buffers.buffer_bytes} B) this step; kept on device, buffers grow next "
                "step",
            )
            return False
        busy = [g for g in self._pending + self._held if g.key == group.key]
        if busy:
            self._log_once("busy", f"host slot of {group.key} still holds an activation that was "
                           "not reloaded (several forwards in flight); kept on device")
            return False
        host = self._pool.slot(self.device, group.key, group.nbytes)
        if host is None:
            return False
        group.host = host
        return True

    # ---------------------------------------------------------------------------------------
    # buffer mode (the headroom check is ReloadBuffers.choose_mode)
    # ---------------------------------------------------------------------------------------
    def _decide_mode(self) -> None:
        if not self.config.enabled:
            self._set_mode(BufferMode.OFF, "disabled by OffloadConfig.enabled=False")
            return
        choice = self._buffers.choose_mode(self.device, self.config)
        self._set_mode(choice.mode, choice.reason)

    def _set_mode(self, mode: BufferMode, reason: str) -> None:
        self._mode, self._mode_reason = mode, reason
        if mode is not self._last_mode and (mode is not BufferMode.DOUBLE
                                            or self._last_mode is not None):
            explicit = not self.config.enabled or not self.config.allow_double_buffer
            level = logging.INFO if mode is BufferMode.DOUBLE or explicit else logging.WARNING
            logger.log(level, "activation offload: %s buffer mode (%s)", mode.value, reason)
        self._last_mode = mode

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
        self._buffers.release_finished(dev, group)
        if group.offloaded:
            if group.reload_event is None:
                b = self._buffers.free_index()
                if b < 0:  # cannot happen with one owner per buffer; keep numerics anyway
                    raise RuntimeError("activation offload: no free reload buffer")
                self._issue_reload(group, b)
                self._counters.just_in_time_reloads += 1
                self._counters.just_in_time_bytes += group.nbytes
            dev.wait_event(compute, group.reload_event)
        group.bwd_started = True
        if self._mode is BufferMode.DOUBLE:
            prev = self._previous_pending(group)
            if prev is not None:
                b = self._buffers.free_index()
                if b >= 0:
                    self._issue_reload(prev, b)
                    self._counters.prefetched_reloads += 1
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

    def _previous_pending(self, group: OffloadGroup) -> Optional[OffloadGroup]:
        best = None
        for g in self._pending:
            if g.seq < group.seq and g.reload_event is None and (best is None or g.seq > best.seq):
                best = g
        return best

    def _issue_reload(self, group: OffloadGroup, b: int) -> None:
        dev = self.device
        reload = dev.reload_stream()
        buf = self._buffers.buffers[b]
        buf.owner = group
        group.buffer = b
        if buf.free_event is not None:
            dev.wait_event(reload, buf.free_event)
        dev.wait_event(reload, group.offload_event)  # its host slot is fully written
        self._stamp(("h2d", "begin", group.key), reload)
        for item in group.items:
            dev.copy(item.view(buf.flat_N), item.view(group.host), reload,
                     tag=group.key, direction="h2d", buffer=b)
        self._stamp(("h2d", "end", group.key), reload)
        ev = dev.new_event()
        dev.record_event(ev, reload)
        group.reload_event = ev
        self._pool.slots[group.key].read_event = ev
        self._pending.remove(group)
        self._counters.bytes_reloaded += group.nbytes

    def unpack(self, packed: Any) -> Any:
        """Inverse of :meth:`pack` (valid between ``begin_backward`` and the next layer's)."""
        if isinstance(packed, Packed):
            group, item = packed.group, packed.group.items[packed.index]
            if item.device_tensor is not None:
                return item.device_tensor
            if group.buffer < 0 or group.reload_event is None:
                raise RuntimeError(
                    f"activation offload: {group.key} unpacked before its backward started"
                )
            return item.view(self._buffers.buffers[group.buffer].flat_N)
        if isinstance(packed, PackedQuantized):
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
        if self._calib is not None and self._in_step:
            self._calib.stamp(self.device, self._step, label, stream)

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
                self._calib = Calibration(step=self._step)
        elif self._calib.step < self._step:
            self._try_plan()

    def _try_plan(self) -> None:
        c, cfg, keys = self._calib, self.config, self._layer_keys
        if not c.marked_every_layer(keys):
            self._calib, self._to_plan = None, False
            self._window_source = "unplanned: no compute timings"
            self._log_once("autowindow", "offload window 'auto': the calibration step has no "
                           "forward/backward timings for every layer (layers not marked); "
                           "offloading every layer but the last. Set "
                           "OffloadConfig.max_offloaded_layers to an int to choose the window")
            return
        times = c.layer_times(self.device, keys, cfg)
        if times is None:
            return  # the device has not finished the calibration step yet: ask next step
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
