"""PackedSeqCache: a packed batch's boundary metadata and everything derived from it, built
once per batch into static buffers and carried to every layer in the ``packed_seq_params``.

Every transformer layer of a packed batch consumes the same B = {cu_seqlens, max_seqlen,
positions, masks, RoPE}. The cache derives the boundaries on the host (``metadata.py``), moves
them with ONE non-blocking copy from a pinned staging buffer into a slot's fixed-capacity device
buffers (``slots.py``), builds the derived tensors the layers registered there (``derived.py``:
static-shape ops, no host reads) and hands every layer one :class:`CachedPackedSeqParams`
(``params.py``) whose tensor fields *are* the slot's static buffers:

* ``cu_seqlens_q/kv``: boundaries with the padding tail closed at T (no ``*_padded``);
* ``position_ids_T``, ``seq_ids_T``, ``real_token_mask_T`` (True on real tokens);
* the fields of the registered derived kinds: RoPE, the SDPA mask or padded view, the flex
  BlockMask, their sliding-window variants (:data:`~megatron_fastpath.packed_seq.derived.DERIVED_KINDS`).

Several microbatches can be in flight (pipeline 1F1B runs forward of m+1 before backward of m):
the cache owns ``num_slots`` independent slots; a slot stays reserved from ``set_batch`` until
``release`` (or the end of the ``batch()`` context), so a batch's buffers are never overwritten
while its backward may still read them. Staleness is impossible by construction: nothing is
keyed on object identity of the caller's data -- every ``set_batch`` re-derives B from the values
it is given.

This module also re-exports the public names of its neighbours (the config, the params and
batch handle, the derived kinds), so ``megatron_fastpath.packed_seq.cache`` offers them all.

Shape letters: T = ``max_tokens``, S = ``max_seqs``, R = the flat metadata record.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import numpy as np
import torch

from megatron_fastpath.packed_seq.adapters import build_adapter_record, check_adapters
from megatron_fastpath.packed_seq.config import (
    DEFAULT_SDPA_MASK_MAX_TOKENS,
    SDPA_LAYOUTS,
    PackedSeqConfig,
    sdpa_max_tokens,
    seqlen_bound,
)
from megatron_fastpath.packed_seq.context_parallel import build_cp_host_metadata
from megatron_fastpath.packed_seq.derived import (
    DERIVED_KINDS,
    DerivedKind,
    check_sdpa_mask_size,
    derived_kind,
)
from megatron_fastpath.packed_seq.metadata import LengthsLike, build_host_metadata, resolve_lengths
from megatron_fastpath.packed_seq.params import (
    CachedPackedSeqParams,
    PackedBatch,
    block_mask_from,
    packed_causal_mask_mod,
)
from megatron_fastpath.packed_seq.slots import Slot

__all__ = [
    "CacheStats",
    "CachedPackedSeqParams",
    "DEFAULT_SDPA_MASK_MAX_TOKENS",
    "DERIVED_KINDS",
    "DerivedKind",
    "PackedBatch",
    "PackedSeqCache",
    "PackedSeqConfig",
    "SDPA_LAYOUTS",
    "block_mask_from",
    "derived_kind",
    "packed_causal_mask_mod",
    "sdpa_max_tokens",
    "seqlen_bound",
]


@dataclasses.dataclass
class CacheStats:
    """Counters since construction; ``per_kind`` maps a derived kind -> builds (one per batch,
    whatever the number of layers reading it)."""

    batches: int = 0
    builds: int = 0
    host_to_device_copies: int = 0
    bytes_copied: int = 0
    per_kind: dict = dataclasses.field(default_factory=dict)

    def snapshot(self) -> "CacheStats":
        return dataclasses.replace(self, per_kind=dict(self.per_kind))

    def add(self, other: "CacheStats") -> None:
        """Add ``other``'s counters (a captured graph's builds, re-run by each replay)."""
        self.batches += other.batches
        self.builds += other.builds
        self.host_to_device_copies += other.host_to_device_copies
        self.bytes_copied += other.bytes_copied
        for k, v in other.per_kind.items():
            self.per_kind[k] = self.per_kind.get(k, 0) + v

    def since(self, before: "CacheStats") -> "CacheStats":
        """Counters accumulated after ``before`` (a snapshot)."""
        return CacheStats(
            batches=self.batches - before.batches,
            builds=self.builds - before.builds,
            host_to_device_copies=self.host_to_device_copies - before.host_to_device_copies,
            bytes_copied=self.bytes_copied - before.bytes_copied,
            per_kind={k: v - before.per_kind.get(k, 0) for k, v in self.per_kind.items()},
        )


class PackedSeqCache:
    """Per-device cache of packed-batch metadata in static (CUDA-graph capturable) buffers.

    Usage::

        cache = PackedSeqCache(PackedSeqConfig(max_tokens=2048, max_seqs=64,
                                               rope=RopeConfig(dim=128)), device)
        with cache.batch(lengths) as pb:                 # one H2D copy, no D2H sync
            loss = model(tokens_1T, pb.position_ids_1T, None,
                         packed_seq_params=pb.packed_seq_params, labels=labels_1T)
            loss.backward()

    Attention modules built by :func:`megatron_fastpath.get_fastpath_layer_spec` register the
    derived tensors they need at construction (:meth:`register`); ``set_batch`` builds them into
    the slot's fields, and the layers read them from the ``packed_seq_params`` they are given.
    """

    def __init__(self, config: PackedSeqConfig, device: Optional[torch.device] = None):
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slots = [Slot(i, config, self.device) for i in range(config.num_slots)]
        self.stats = CacheStats()
        self._next_version = 0
        self._next_slot = 0
        self._last: Optional[Slot] = None
        self._kinds: dict[str, torch.dtype] = {}  # registered derived kind -> compute dtype
        self.window: Optional[int] = None  # the sliding window of the windowed kinds
        self._arange_T: Optional[torch.Tensor] = None
        self.inv_freq = config.rope.inv_freq(self.device) if config.rope is not None else None
        self.inv_freq_local = (config.rope_local.inv_freq(self.device)
                               if config.rope_local is not None else None)

    def arange_T(self) -> torch.Tensor:
        """The one shared [T] int32 arange the mask builders use (built on first use; no T x T
        constant is held)."""
        if self._arange_T is None:
            self._arange_T = torch.arange(self.config.max_tokens, dtype=torch.int32,
                                          device=self.device)
        return self._arange_T

    # ------------------------------------------------------------------ batch lifecycle
    def set_batch(
        self,
        lengths: Optional[LengthsLike] = None,
        *,
        cu_seqlens: Optional[LengthsLike] = None,
        adapters: Optional[LengthsLike] = None,
    ) -> PackedBatch:
        """Load a packed microbatch given host ``lengths`` (or host ``cu_seqlens``).

        Validates on the host (errors raised before any device work), fills the slot's pinned
        staging record and issues ONE non-blocking host->device copy into its static buffers,
        then builds every registered derived tensor into the slot's params. Reserves the slot
        until :meth:`release`. ``adapters``: each sequence's adapter index in [0, K), required by
        a cache with ``num_adapters=K`` and refused by one without
        (:mod:`~megatron_fastpath.packed_seq.adapters`).
        """
        slot = self._load(None, lengths, cu_seqlens, adapters=adapters)
        self._build_all(slot)
        return self._handle(slot)

    def load_slot(self, index: int, lengths: Optional[LengthsLike] = None, *,
                  cu_seqlens: Optional[LengthsLike] = None, copy_record: bool = True,
                  adapters: Optional[LengthsLike] = None) -> PackedBatch:
        """The host half of :meth:`set_batch` into slot ``index`` (which must be free): validate
        and, with ``copy_record``, stage and issue the one host->device copy of the boundary
        record; nothing derived. A full-iteration CUDA graph loads every microbatch of a step
        this way before its replay and builds the rest inside the graph (:meth:`build_slot`);
        without ``copy_record`` the graph builds the record too, from the lengths (not with
        adapters: their sort is built on the host). Reserves the slot until :meth:`release`."""
        if not copy_record and self.config.num_adapters is not None:
            raise ValueError(
                "load_slot(copy_record=False) with adapters: the adapter sort is built on the "
                "host and moves with the record; load the slot with copy_record=True")
        return self._handle(self._load(index, lengths, cu_seqlens, copy_record, adapters))

    def build_slot(self, index: int, lengths_S: Optional[torch.Tensor] = None) -> PackedBatch:
        """The device half: (given ``lengths_S``, int32 [S] device lengths padded with zeros --
        the ones :meth:`load_slot` validated -- first the slot's boundary record, as the host
        would build it) every registered derived tensor of slot ``index`` from its record.
        Static-shape device ops, no host read: capturable."""
        slot = self.slots[index]
        if not slot.busy:
            raise RuntimeError(f"build_slot({index}): the slot holds no batch; load_slot it first")
        if lengths_S is not None:
            if self.config.num_adapters is not None:
                raise ValueError(
                    "build_slot(lengths_S=...) with adapters: the adapter sort is built on the "
                    "host and moves with the record; load_slot(copy_record=True), then build_slot")
            if self.config.context_parallel_size > 1:
                raise ValueError(
                    "build_slot(lengths_S=...) builds the record without context parallelism; "
                    "the CP layout is built on the host: load_slot(copy_record=True)")
            from megatron_fastpath.packed_seq.device_record import build_record_from_lengths

            c = self.config
            build_record_from_lengths(lengths_S, slot.record_R, c.max_tokens, c.max_seqs,
                                      c.max_seqlen_bound)
        self._build_all(slot)
        return self._handle(slot)

    def _load(self, index: Optional[int], lengths, cu_seqlens, copy_record: bool = True,
              adapters=None) -> Slot:
        host = build_host_metadata(
            resolve_lengths(lengths, cu_seqlens),
            self.config.max_tokens,
            self.config.max_seqs,
            self.config.max_seqlen_bound,
        )
        record_R = host.record_R
        k = self.config.num_adapters
        adapters_N = check_adapters(adapters, host.num_seqs, k)
        if adapters_N is not None:
            section = build_adapter_record(adapters_N, host.lengths_N, self.config.max_tokens, k)
            record_R = np.concatenate([record_R, section])
            host = dataclasses.replace(
                host, adapters_N=adapters_N,
                adapter_tokens_K=np.bincount(adapters_N, weights=host.lengths_N,
                                             minlength=k).astype(np.int64))
        cp = self.config.context_parallel_size
        if cp > 1:
            record_R = build_cp_host_metadata(
                host.lengths_N, self.config.max_tokens, self.config.max_seqs,
                self.config.max_seqlen_bound, cp, self.config.context_parallel_rank).record_R
        slot = self._acquire_slot() if index is None else self._take_slot(index)
        self._next_version += 1
        slot.version = self._next_version
        slot.host = host
        self._last = slot
        self.stats.batches += 1
        if not copy_record:
            return slot
        if slot.copy_done is not None and not slot.copy_done.query():
            # The previous batch's copy out of this staging buffer is still queued (rare: a
            # whole forward+backward ran since). Waiting on that event is not a D2H transfer.
            slot.copy_done.synchronize()
        slot.staging_R.copy_(torch.from_numpy(record_R))  # host -> pinned host
        slot.record_R.copy_(slot.staging_R, non_blocking=True)
        if slot.copy_done is not None:
            slot.copy_done.record()
        self.stats.host_to_device_copies += 1
        self.stats.bytes_copied += slot.record_R.numel() * slot.record_R.element_size()
        return slot

    def release(self, batch: PackedBatch) -> None:
        """Mark the batch's slot reusable (call after its backward has been issued)."""
        slot = self.slots[batch.slot]
        if slot.version != batch.version or not slot.busy:
            raise RuntimeError(
                f"PackedBatch(slot={batch.slot}, version={batch.version}) was already released"
            )
        slot.busy = False

    @contextlib.contextmanager
    def batch(self, lengths: Optional[LengthsLike] = None, *, cu_seqlens=None,
              adapters=None) -> Iterator[PackedBatch]:
        """``set_batch`` + ``release`` around a block holding the microbatch's forward+backward."""
        pb = self.set_batch(lengths, cu_seqlens=cu_seqlens, adapters=adapters)
        try:
            yield pb
        finally:
            self.release(pb)

    def _take_slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise ValueError(f"slot {index} does not exist: the cache has {len(self.slots)} slots")
        slot = self.slots[index]
        if slot.busy:
            raise RuntimeError(f"slot {index} still holds a microbatch in flight; release it first")
        slot.busy = True
        return slot

    def _acquire_slot(self) -> Slot:
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._next_slot + k) % n]
            if not slot.busy:
                slot.busy = True
                self._next_slot = (slot.index + 1) % n
                return slot
        raise RuntimeError(
            f"all {n} PackedSeqCache slots hold microbatches still in flight; release finished "
            "batches (cache.release / the cache.batch() context) or raise "
            "PackedSeqConfig.num_slots to the number of microbatches in flight "
            "(the pipeline depth for 1F1B)"
        )

    @property
    def current(self) -> PackedBatch:
        """Host-side handle of the most recently loaded batch (for logging and tests; layers
        never read it -- they read the params they are given)."""
        if self._last is None or not self._last.busy:
            raise RuntimeError("no packed batch is loaded: call cache.set_batch(lengths) first")
        return self._handle(self._last)

    @staticmethod
    def _handle(slot: Slot) -> PackedBatch:
        h = slot.host
        return PackedBatch(
            slot=slot.index,
            version=slot.version,
            packed_seq_params=slot.params,
            position_ids_1T=slot.position_ids_1T,
            padding_mask_1T=slot.padding_mask_1T,
            num_seqs=h.num_seqs,
            num_tokens=h.num_tokens,
            max_seqlen=h.max_seqlen,
            lengths_N=h.lengths_N,
            adapters_N=h.adapters_N,
            adapter_tokens_K=h.adapter_tokens_K,
        )

    def cache_bytes(self) -> int:
        """Device bytes the cache holds: every slot's record and derived fields, plus the one
        shared [T] int32 arange the mask builder uses (no T x T constant)."""
        seen, total = set(), 0
        for slot in self.slots:
            for t in [slot.record_R, *slot.params.tensors().values()]:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
        if self._arange_T is not None:
            total += self._arange_T.untyped_storage().nbytes()
        return total

    # ------------------------------------------------------------------ derived tensors
    def register(self, kind: str, dtype: Optional[torch.dtype] = None,
                 window: Optional[int] = None) -> None:
        """Declare that a consumer needs the derived tensors ``kind`` (a key of
        :data:`DERIVED_KINDS`), computed in ``dtype`` (kinds with ``compute_dtype``:
        "rope_cos_sin", "rope_cos_sin_local", "sdpa_mask" and "sdpa_mask_window"; default
        float32; the ``"kind:dtype"`` form is accepted). The windowed kinds take the sliding ``window``
        (one per cache: every windowed layer of a checkpoint has the same).
        Allocates the field in every slot's params at once (its address never changes)
        and builds it for batches already loaded."""
        kind, _, dtype_name = kind.partition(":")
        spec = derived_kind(kind)
        if spec.windowed:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"{kind} needs a sliding window >= 1 token; got {window!r}")
            if self.window is not None and self.window != window:
                raise ValueError(
                    f"the cache builds its windowed masks for sliding_window={self.window}; a "
                    f"layer asked for {window}: one cache serves one window (give models of "
                    "another window their own PackedSeqCache)")
            self.window = window
        elif window is not None:
            raise ValueError(f"{kind} takes no window (got window={window})")
        if dtype_name:
            dtype = getattr(torch, dtype_name)
        dtype = dtype if spec.compute_dtype and dtype is not None else torch.float32
        if spec.needs_rope and self.config.rope is None:
            raise ValueError("RoPE requested but PackedSeqConfig.rope is None")
        if spec.needs_rope_local and self.config.rope_local is None:
            raise ValueError(f"{kind}: the second RoPE requested but PackedSeqConfig.rope_local "
                             "is None")
        if spec.dense_mask:
            check_sdpa_mask_size(self.config)
        if kind in self._kinds:
            if self._kinds[kind] != dtype:
                raise ValueError(
                    f"{kind} is already built in {self._kinds[kind]}; one cache serves one compute "
                    f"dtype (got {dtype}): give models of another dtype their own PackedSeqCache"
                )
            return
        self._kinds[kind] = dtype
        for slot in self.slots:
            spec.allocate(self, slot, dtype)
            if slot.busy:
                self._build(slot, kind)

    def _build_all(self, slot: Slot) -> None:
        p = slot.params
        if p.cp_token_index_T is not None:  # CP: real = not the pad row (sequence padding too)
            p.cp_token_index_T.copy_(slot.token_index_i32_T)
            torch.ne(p.cp_token_index_T, self.config.max_tokens, out=p.real_token_mask_T)
        else:
            torch.ge(p.seq_ids_T, 0, out=p.real_token_mask_T)
        torch.logical_not(p.real_token_mask_T.view(1, -1), out=slot.padding_mask_1T)
        for kind in self._kinds:
            self._build(slot, kind)

    def _build(self, slot: Slot, kind: str) -> None:
        DERIVED_KINDS[kind].build(self, slot)
        self.stats.builds += 1
        self.stats.per_kind[kind] = self.stats.per_kind.get(kind, 0) + 1
