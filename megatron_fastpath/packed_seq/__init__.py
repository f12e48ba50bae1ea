"""Packed-sequence metadata: host construction, the static-buffer cache, packing."""

from megatron_fastpath.packed_seq.cache import (
    CacheStats,
    CachedPackedSeqParams,
    PackedBatch,
    PackedSeqCache,
    PackedSeqConfig,
    RopeConfig,
)
from megatron_fastpath.packed_seq.metadata import (
    HostPackedMetadata,
    build_host_metadata,
    lengths_from_cu_seqlens,
)
from megatron_fastpath.packed_seq.packing import first_fit_decreasing

__all__ = [
    "CacheStats",
    "CachedPackedSeqParams",
    "HostPackedMetadata",
    "PackedBatch",
    "PackedSeqCache",
    "PackedSeqConfig",
    "RopeConfig",
    "build_host_metadata",
    "first_fit_decreasing",
    "lengths_from_cu_seqlens",
]
