"""The adapter of every token of a packed batch, built on the host: what a multi-adapter LoRA
linear (:class:`~megatron_fastpath.lora.multi.MultiLoRALinear`) needs to run all K adapters in
one grouped pass over static shapes.

The caller gives each sequence's adapter index (``cache.set_batch(lengths, adapters=[...])``,
a cache built with ``PackedSeqConfig(num_adapters=K)``). The lengths are known here, so the sort
of the tokens by adapter and the per-adapter counts are computed on the host too, and ride in
the same flat int32 record as the boundaries (ONE host->device copy per batch, no device->host
read anywhere). The adapter section of the record::

    [ adapter_ids_T (T) | adapter_order_T (T) | adapter_inverse_T (T) | adapter_offsets_K (K) |
      adapter_tokens_K (K) ]

* ``adapter_ids_T``: the adapter of each token; K (no adapter) on the padding tail;
* ``adapter_order_T``: the tokens sorted by adapter (stable: packed order inside an adapter),
  the padding tail last -- the gather index of the grouped buffer (row i holds token
  ``order[i]``);
* ``adapter_inverse_T``: its inverse (token t sits in row ``inverse[t]``) -- the gather index
  back to packed order;
* ``adapter_offsets_K``: the group ends of ``torch._grouped_mm(offs=...)``: cumulative token
  counts, the last one T (the padding tail is the slack of the last group: every row of the
  buffer is in a group, so no row is left uninitialised; the layer zeroes those rows' input,
  so they add nothing and take no gradient);
* ``adapter_tokens_K``: the real tokens of each adapter (the padding tail not counted).

Shape letters: T = ``max_tokens``, K = ``num_adapters``, N = sequences of the batch.
"""

from __future__ import annotations

import numpy as np

from megatron_fastpath.packed_seq.metadata import _as_host_int_array

__all__ = ["adapter_record_size", "build_adapter_record", "check_adapters", "split_adapter_record"]


def adapter_record_size(max_tokens: int, num_adapters: int) -> int:
    """int32 entries of the adapter section: three [T] and two [K] fields."""
    return 3 * max_tokens + 2 * num_adapters


def split_adapter_record(section, max_tokens: int, num_adapters: int) -> tuple:
    """Views (ids_T, order_T, inverse_T, offsets_K, tokens_K) of an adapter section (numpy
    array or tensor): no copies, so device views keep the record's storage."""
    t, k = max_tokens, num_adapters
    return (section[:t], section[t : 2 * t], section[2 * t : 3 * t],
            section[3 * t : 3 * t + k], section[3 * t + k : 3 * t + 2 * k])


def check_adapters(adapters, num_seqs: int, num_adapters) -> np.ndarray:
    """Each sequence's adapter index as an int64 [N] host array, refused (one line, before any
    device work) when it is not host integers, not one per sequence, or outside [0, K);
    ``adapters`` given to a cache without adapters, or missing for one with them, is refused."""
    if num_adapters is None:
        if adapters is not None:
            raise ValueError(
                "adapters= given, but this cache carries no adapter indices: build it with "
                "PackedSeqConfig(num_adapters=K) to train K adapters in one batch")
        return None
    if adapters is None:
        raise ValueError(
            f"this cache carries adapter indices (num_adapters={num_adapters}): give each "
            "sequence's adapter, set_batch(lengths, adapters=[a_0, ..., a_N-1]) with each a_i "
            f"in [0, {num_adapters})")
    a_N = _as_host_int_array(adapters, "adapters")
    if a_N.size != num_seqs:
        raise ValueError(
            f"adapters has {a_N.size} entries for {num_seqs} sequences: give one adapter index "
            "per sequence, in the order of the lengths")
    bad = (a_N < 0) | (a_N >= num_adapters)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"adapter index out of range: adapters[{i}]={int(a_N[i])}, but the cache has "
            f"num_adapters={num_adapters} (indices 0..{num_adapters - 1})")
    return a_N


def build_adapter_record(adapters_N: np.ndarray, lengths_N: np.ndarray, max_tokens: int,
                         num_adapters: int) -> np.ndarray:
    """The adapter section (int32, :func:`adapter_record_size` entries) of a batch whose
    sequences (``lengths_N``, validated) train ``adapters_N`` (validated by
    :func:`check_adapters`)."""
    t, k = max_tokens, num_adapters
    section = np.zeros(adapter_record_size(t, k), dtype=np.int32)
    ids_T, order_T, inverse_T, offsets_K, tokens_K = split_adapter_record(section, t, k)
    total = int(lengths_N.sum())
    ids_T[:total] = np.repeat(adapters_N, lengths_N)
    ids_T[total:] = k  # the padding tail: no adapter, sorted last
    order = np.argsort(ids_T, kind="stable")
    order_T[:] = order
    inverse_T[order] = np.arange(t, dtype=np.int32)
    tokens_K[:] = np.bincount(ids_T[:total], minlength=k)[:k]
    offsets_K[:] = np.cumsum(tokens_K)
    offsets_K[-1] = t  # the tail is the last group's slack: the groups end at T
    return section
