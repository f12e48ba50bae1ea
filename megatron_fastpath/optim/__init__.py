"""Optimizer steps without host syncs: :class:`SyncFreeOptimizer` around Megatron's optimizer."""

from megatron_fastpath.optim.device_lr import DeviceLRSchedule
from megatron_fastpath.optim.sync_free import SyncFreeOptimizer, SyncFreeStepResult

__all__ = ["DeviceLRSchedule", "SyncFreeOptimizer", "SyncFreeStepResult"]
