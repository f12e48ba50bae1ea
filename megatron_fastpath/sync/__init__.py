"""Host-sync detection: :class:`SyncSentinel`."""

from megatron_fastpath.sync.sentinel import (
    DATA_DEPENDENT_OPS,
    HOST_READ_METHODS,
    HostSyncError,
    SyncEvent,
    SyncSentinel,
)

__all__ = ["DATA_DEPENDENT_OPS", "HOST_READ_METHODS", "HostSyncError", "SyncEvent", "SyncSentinel"]
