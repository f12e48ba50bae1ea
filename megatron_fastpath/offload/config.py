"""Configuration and per-step telemetry of the activation offload manager."""

from __future__ import annotations

import dataclasses
import enum
from typing import Union

from megatron_fastpath.settings import setting

__all__ = ["AUTO", "BufferMode", "OffloadConfig", "OffloadStepStats", "StepCounters"]

AUTO = "auto"

MiB = 1 << 20
GiB = 1 << 30


class BufferMode(str, enum.Enum):
    """How many fixed-address device reload buffers a step uses.

    DOUBLE: reload of layer i-1 overlaps layer i's backward (two buffers, A/B).
    SINGLE: reload just in time into one buffer (copy and compute serialise).
    OFF: nothing is offloaded; activations stay on the device (plain checkpointing).
    """

    DOUBLE = "double"
    SINGLE = "single"
    OFF = "off"

    @property
    def num_buffers(self) -> int:
        return {"double": 2, "single": 1, "off": 0}[self.value]


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Knobs of :class:`~megatron_fastpath.offload.ActivationOffloadManager` (each field's
    one-line description is its ``help``; the longer story of three of them here).

    ``recompute`` True (default): each wrapped TransformerLayer is fully recomputed in backward
    and only its input hidden states [s, b, h] are offloaded. False: the layer is not
    recomputed; every tensor it saves for backward of at least ``min_offload_bytes``
    (parameters and do-not-offload marks excluded, TE quantized tensors split into their data
    tensors) is offloaded as one group per layer. ``enabled`` False keeps every activation on
    the device (the layers are still recomputed when ``recompute`` is True); numerics are
    identical either way.

    ``max_offloaded_layers``: when the link is slower than the forward (copy time per layer >
    forward time per layer) the offloads fall behind, and the last layers' round trips cannot
    all be hidden in any order (``megatron_fastpath.offload.plan``). ``"auto"``: on a device
    whose copies overlap compute (CUDA), the first steps offload every layer but the last and
    the second step times each layer's forward, backward and copies with device events (the
    first pays one-time costs); once those events have completed (read without blocking at a
    later step's start) the manager keeps the largest window whose modelled whole-step hidden
    fraction (in its ``eager_offloads`` order) is >= ``target_hidden_fraction`` -- never
    dropping an offload that would finish before the end of the forward (peak memory first)
    --, logs it, and reports it in each step's ``offload_window``. On a synchronous device (CPU)
    nothing overlaps: every layer but the last.

    ``eager_offloads`` K: the offloads of the first K offloaded layers are issued as their
    layers run, those of the rest are held back and issued when the window's last layer's is,
    latest layer first -- the order the backward reloads them in -- so a copy backlog delays
    the reloads needed last, not first. ``"auto"``: planned from the same calibration step
    (also for a fixed window): the K with the highest modelled whole-step hidden fraction among
    those that leave no more offloads running at the end of the forward than forward order (no
    less memory freed at the peak); forward order until then and on a synchronous device.
    """

    enabled: bool = setting(True, "offload at all (false: activations stay on the device)")
    recompute: bool = setting(
        True, "recompute each layer in backward and offload only its input (false: offload "
        "every tensor it saves of at least min_offload_bytes)")
    min_offload_bytes: int = setting(1 * MiB, "tensors (and layer inputs) smaller than this stay on the device")
    max_offloaded_layers: Union[int, str, None] = setting(
        AUTO, "which layers to offload: auto (timed on the GPU: the largest leading window hiding "
        ">= target_hidden_fraction) | null (all but the last) | N (the first N)")
    eager_offloads: Union[int, str, None] = setting(
        AUTO, "the order offloads are issued in: auto (planned with the window) | null (each as "
        "its layer runs) | K (the first K as they run, the rest latest first)")
    target_hidden_fraction: float = setting(
        0.9, "the share of the step's copy time that must stay hidden for auto to offload a layer, in [0, 1]")
    headroom_margin_bytes: int = setting(
        1 * GiB, "device memory that must stay free after the reload buffers, checked every step")
    allow_double_buffer: bool = setting(True, "false forces the single-buffer schedule")
    pinned: bool = setting(True, "page-locked host pool (pageable, with one log line, when pinning fails)")
    alignment_bytes: int = setting(512, "byte alignment of each tensor inside a group's flat buffers")
    copy_bandwidth_bytes_per_s: float = setting(
        25e9, "host <-> device bandwidth of the telemetry's exposed-copy-time estimate (no timing read back)")

    def __post_init__(self):
        for name in ("min_offload_bytes", "headroom_margin_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"OffloadConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("max_offloaded_layers", "eager_offloads"):
            n = getattr(self, name)
            if n is not None and n != AUTO and (not isinstance(n, int) or isinstance(n, bool)
                                                or n < 0):
                raise ValueError(
                    f"OffloadConfig.{name} must be {AUTO!r}, None or an int >= 0, got {n!r}")
        t = self.target_hidden_fraction
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(
                f"OffloadConfig.target_hidden_fraction must be a number in [0, 1], got {t!r}"
            )
        a = self.alignment_bytes
        if not isinstance(a, int) or a < 16 or a & (a - 1):
            raise ValueError(
                f"OffloadConfig.alignment_bytes must be a power of two >= 16, got {a!r}"
            )
        if not self.copy_bandwidth_bytes_per_s > 0:
            raise ValueError(
                "OffloadConfig.copy_bandwidth_bytes_per_s must be > 0, "
                f"got {self.copy_bandwidth_bytes_per_s!r}"
            )


@dataclasses.dataclass
class StepCounters:
    """What the manager counts during a step, on the host (no device sync); the named fields of
    :class:`OffloadStepStats` they become. just_in_time_bytes: bytes of the just-in-time
    reloads (-> ``est_exposed_copy_s``)."""

    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    layers_offloaded: int = 0
    layers_kept: int = 0
    prefetched_reloads: int = 0
    just_in_time_reloads: int = 0
    just_in_time_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class OffloadStepStats:
    """Telemetry of one step (all micro-batches between ``begin_step`` and ``end_step``).

    bytes_offloaded / bytes_reloaded: device->host / host->device bytes issued.
    mode: buffer mode of the step; mode_reason: why (headroom figures when it fell back).
    layers_offloaded: offloaded layer groups; layers_kept: groups kept on the device
        (last layer, too small, too large for the buffers, host pool failure).
    prefetched_reloads / just_in_time_reloads: reloads issued one layer ahead vs. issued when
        their own layer's backward started (the latter are exposed).
    est_exposed_copy_s: exposed reload time estimated from just-in-time bytes and
        ``copy_bandwidth_bytes_per_s`` (an estimate: no timing is read back from the device).
    device_buffer_bytes: bytes held by the reload buffers; host_pool_bytes: host pool size;
    host_pinned: False once the pool fell back to pageable memory.
    offload_window: how many leading layers were eligible for offload this step (the last
        layer never is); eager_offloads: how many of them were issued as their layers ran (the
        rest latest layer first after the window's last; == offload_window: forward order);
        window_source: how window and order were chosen: "config" (both given), "calibrating"
        (an "auto" before its device timings are in: every layer but the last, forward order),
        "planned" (with a plan), "synchronous device" ("auto" on a device whose copies do not
        overlap compute).
    """

    step: int
    mode: BufferMode
    mode_reason: str
    bytes_offloaded: int
    bytes_reloaded: int
    layers_offloaded: int
    layers_kept: int
    prefetched_reloads: int
    just_in_time_reloads: int
    est_exposed_copy_s: float
    device_buffer_bytes: int
    host_pool_bytes: int
    host_pinned: bool
    offload_window: int = 0
    window_source: str = "config"
    eager_offloads: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        return d

    def summary_line(self) -> str:
        """The main job's summary line for the offload (the last step's figures)."""
        return (
            f"offload: mode {self.mode.value} ({self.mode_reason}), "
            f"{self.bytes_offloaded:,} B offloaded/{self.bytes_reloaded:,} B reloaded per step, "
            f"{self.prefetched_reloads} prefetched / {self.just_in_time_reloads} just-in-time "
            f"reloads (est. exposed copy {self.est_exposed_copy_s * 1e3:.3f} ms), device "
            f"buffers {self.device_buffer_bytes:,} B, host pool {self.host_pool_bytes:,} B, "
            f"window {self.offload_window} layers, {self.eager_offloads} issued in forward "
            f"order ({self.window_source})"
        )
