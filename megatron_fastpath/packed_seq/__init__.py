"""Packed-sequence metadata: host construction, the static-buffer cache, packing, RoPE."""

from megatron_fastpath.packed_seq.cache import (
    CacheStats,
    CachedPackedSeqParams,
    PackedBatch,
    PackedSeqCache,
    PackedSeqConfig,
)
from megatron_fastpath.packed_seq.metadata import (
    HostPackedMetadata,
    build_host_metadata,
    lengths_from_cu_seqlens,
)
from megatron_fastpath.packed_seq.packing import first_fit_decreasing
from megatron_fastpath.packed_seq.rope import Llama3RopeScaling, RopeConfig, YarnRopeScaling

__all__ = [
    "CacheStats",
    "CachedPackedSeqParams",
    "HostPackedMetadata",
    "Llama3RopeScaling",
    "PackedBatch",
    "PackedSeqCache",
    "PackedSeqConfig",
    "RopeConfig",
    "YarnRopeScaling",
    "build_host_metadata",
    "first_fit_decreasing",
    "lengths_from_cu_seqlens",
]
