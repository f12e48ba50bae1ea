"""Calibration step of the ``"auto"`` offload window: device timestamps of one step, read back
into per-layer :class:`~megatron_fastpath.offload.plan.LayerTimes` without blocking the host.

The manager opens a :class:`Calibration` at step :data:`CALIBRATION_STEP` (not the first, which
pays one-time costs: kernel loading, autotuning, allocator growth, host pool allocation, that
would make compute look slower than it is). During that step's first micro-batch every layer's
forward and backward compute, and every offload (d2h) and reload (h2d) copy, gets a begin and an
end timestamp on its own stream (:meth:`OffloadDevice.timestamp`). At the start of each later
step the manager asks :meth:`Calibration.layer_times`: None while the device has not finished the
calibration step (events are polled, never waited for), else the times to plan from
(:func:`~megatron_fastpath.offload.plan.plan_window`). A layer that was never copied (the last
one, or one kept on the device) gets its copy times from its group's bytes over the bandwidth
measured on the others.

Labels: ``(kind, edge, key)`` with kind "fwd" | "bwd" | "d2h" | "h2d", edge "begin" | "end",
key the layer's group key ("L3").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_fastpath.offload.config import OffloadConfig
from megatron_fastpath.offload.device import OffloadDevice
from megatron_fastpath.offload.plan import LayerTimes

__all__ = ["CALIBRATION_STEP", "Calibration"]

#: the step "auto" times: not the first, which pays one-time costs (kernel loading, autotuning,
#: allocator growth, host pool allocation) that would make compute look slower than it is
CALIBRATION_STEP = 1

_COMPUTE = ("fwd", "bwd")
_KINDS = ("fwd", "bwd", "d2h", "h2d")
_MISSING = object()  # a span never stamped (a layer never copied), unlike None: still pending


@dataclasses.dataclass
class Calibration:
    """Device timestamps of one step, for the ``"auto"`` window: label -> device handle."""

    step: int
    stamps: dict = dataclasses.field(default_factory=dict)
    nbytes: dict = dataclasses.field(default_factory=dict)  # layer key -> group bytes

    def stamp(self, dev: OffloadDevice, step: int, label: tuple, stream: Any) -> None:
        """Timestamp ``label`` on ``stream`` during the calibration step, once (its first
        micro-batch)."""
        if step == self.step and label not in self.stamps:
            self.stamps[label] = dev.timestamp(stream, label)

    def note_group(self, step: int, key: str, nbytes: int) -> None:
        """Bytes of layer ``key``'s group in the calibration step (its first micro-batch)."""
        if step == self.step:
            self.nbytes.setdefault(key, nbytes)

    def marked_every_layer(self, keys) -> bool:
        """Every layer's forward and backward compute was timestamped (the layers call
        ``mark``); False: there is nothing to plan from, now or later."""
        return all(self.stamps.get((kind, edge, k)) is not None
                   for kind in _COMPUTE for edge in ("begin", "end") for k in keys)

    def layer_times(self, dev: OffloadDevice, keys, config: OffloadConfig
                    ) -> Optional[LayerTimes]:
        """Per-layer device times of the calibration step (``keys`` in forward order); None
        while some of its timestamps have not completed on the device."""
        spans = {kind: [self._span(dev, kind, k) for k in keys] for kind in _KINDS}
        if any(v is None for vals in spans.values() for v in vals):
            return None  # the device has not finished the calibration step yet: ask next step

        def copy_times(kind: str) -> tuple[float, ...]:
            measured = [(self.nbytes.get(k, 0), t) for k, t in zip(keys, spans[kind])
                        if t is not _MISSING]
            secs = sum(t for _, t in measured)
            bw = (sum(n for n, _ in measured) / secs if measured and secs > 0
                  else config.copy_bandwidth_bytes_per_s)
            return tuple(t if t is not _MISSING else self.nbytes.get(k, 0) / bw
                         for k, t in zip(keys, spans[kind]))

        return LayerTimes(tuple(spans["fwd"]), tuple(spans["bwd"]), copy_times("d2h"),
                          copy_times("h2d"), offload_at_layer_start=config.recompute)

    def _span(self, dev: OffloadDevice, kind: str, key: str) -> Any:
        """Seconds from ``key``'s ``kind`` begin to end; _MISSING when it was not stamped (a
        layer never copied), None while pending on the device."""
        a, b = self.stamps.get((kind, "begin", key)), self.stamps.get((kind, "end", key))
        if a is None or b is None:
            return _MISSING
        return dev.elapsed_s(a, b)
