"""The packed cache's part of the main job's summary (a ``SummaryReport``, see
:mod:`megatron_fastpath.train.report`): the host-to-device copies it made, appended to the
summary line's ``cache builds N`` (the builds are counted per step by the job)."""

from __future__ import annotations

__all__ = ["PackedCacheReport"]


class PackedCacheReport:
    """Reads ``cache.stats`` (:class:`~megatron_fastpath.packed_seq.cache.CacheStats`) when asked:
    counters of this process, since the cache was built."""

    def __init__(self, cache):
        self.cache = cache

    def summary_fields(self) -> dict:
        return {}

    def summary_suffix(self) -> str:
        stats = self.cache.stats
        return f" ({stats.host_to_device_copies} H2D copies, {stats.bytes_copied} bytes)"

    def summary_lines(self) -> list[str]:
        return []
