"""TE-aware double-buffered activation offload for checkpointed Megatron TransformerLayers.

Public API::

    OffloadConfig, BufferMode, OffloadStepStats, AUTO  -- config.py
    LayerTimes, model_step, plan_order, plan_window, WindowPlan -- plan.py
    ActivationOffloadManager                           -- manager.py
    OffloadDevice, CudaOffloadDevice, RecordingDevice,
    TraceEvent, MemoryInfo, default_offload_device     -- device.py
    OffloadedTransformerLayer, OffloadedMoETransformerLayer, offloaded_layer_class -- layer.py
    with_activation_offload, get_offload_manager       -- spec.py
    replay_schedule, step_hidden_fraction, StreamTimeline -- timing.py

Internal to the manager: group.py (a layer's tensors and their layout), buffers.py (reload
buffers, host pool, headroom check), calibration.py (device timings of the "auto" window).

Importing this package does not import Megatron-Core: config / device / manager (and the modules
above) are plain torch, and layer.py / spec.py (which import Megatron-Core) load on first use of
their names.
"""

from megatron_fastpath.offload.config import AUTO, BufferMode, OffloadConfig, OffloadStepStats
from megatron_fastpath.offload.device import (
    CudaOffloadDevice,
    MemoryInfo,
    OffloadDevice,
    RecordingDevice,
    TraceEvent,
    default_offload_device,
)
from megatron_fastpath.offload.manager import ActivationOffloadManager
from megatron_fastpath.offload.plan import (
    LayerTimes,
    WindowPlan,
    model_step,
    plan_order,
    plan_window,
)

from megatron_fastpath._lazy import lazy_getattr

_LAZY = {
    "OffloadedTransformerLayer": "megatron_fastpath.offload.layer",
    "OffloadedMoETransformerLayer": "megatron_fastpath.offload.layer",
    "offloaded_layer_class": "megatron_fastpath.offload.layer",
    "with_activation_offload": "megatron_fastpath.offload.spec",
    "get_offload_manager": "megatron_fastpath.offload.spec",
    "replay_schedule": "megatron_fastpath.offload.timing",
    "step_hidden_fraction": "megatron_fastpath.offload.timing",
    "StreamTimeline": "megatron_fastpath.offload.timing",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "AUTO",
    "ActivationOffloadManager",
    "LayerTimes",
    "WindowPlan",
    "model_step",
    "plan_order",
    "plan_window",
    "BufferMode",
    "CudaOffloadDevice",
    "MemoryInfo",
    "OffloadConfig",
    "OffloadDevice",
    "OffloadStepStats",
    "RecordingDevice",
    "TraceEvent",
    "default_offload_device",
    *_LAZY,
]
