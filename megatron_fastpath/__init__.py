"""megatron_fastpath: remove the glue-code overhead (host syncs, per-layer rebuilds, copies)
around Megatron-Core's math kernels so per-layer CUDA graphs, FP8 and LoRA run sync-free.

Public API (lazy: importing the package does not import Megatron):
    SyncSentinel, HostSyncError          -- count / forbid host syncs in a region
    PackedSeqCache, PackedSeqConfig      -- per-batch packed-sequence metadata in static buffers
    get_fastpath_layer_spec              -- Megatron TransformerLayer ModuleSpec reading the cache
"""

from megatron_fastpath._noise import filter_import_warnings

filter_import_warnings()  # only when run as a program (python -m megatron_fastpath.<module>)

from megatron_fastpath.sync import HostSyncError, SyncEvent, SyncSentinel  # noqa: E402

__version__ = "0.1.0"

from megatron_fastpath._lazy import lazy_getattr  # noqa: E402

_LAZY = {
    "PackedSeqCache": "megatron_fastpath.packed_seq.cache",
    "PackedSeqConfig": "megatron_fastpath.packed_seq.config",
    "get_fastpath_layer_spec": "megatron_fastpath.layer_spec",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["HostSyncError", "SyncEvent", "SyncSentinel", *_LAZY]
