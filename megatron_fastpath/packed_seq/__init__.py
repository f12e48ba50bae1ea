"""Packed-sequence metadata: host construction, the static-buffer cache (its config, slots,
params and derived kinds), packing, RoPE."""

from megatron_fastpath.packed_seq.cache import CacheStats, PackedSeqCache
from megatron_fastpath.packed_seq.config import PackedSeqConfig
from megatron_fastpath.packed_seq.metadata import (
    HostPackedMetadata,
    build_host_metadata,
    lengths_from_cu_seqlens,
)
from megatron_fastpath.packed_seq.packing import first_fit_decreasing
from megatron_fastpath.packed_seq.params import CachedPackedSeqParams, PackedBatch
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
