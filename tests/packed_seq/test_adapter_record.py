"""The cache's adapter section: each token's adapter, its sort and the per-adapter counts, built
on the host and moved with the boundaries in the one copy; refusals before any device work."""

import numpy as np
import pytest
import torch

from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.sync import SyncSentinel

T, S, K = 16, 4, 3


def _cache(**kw):
    return PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=S, num_adapters=K, **kw))


def _expected(lengths, adapters):
    """Plain Python: token t's adapter, then tokens sorted by (adapter, packed index)."""
    ids = [a for n, a in zip(lengths, adapters) for _ in range(n)]
    ids += [K] * (T - len(ids))
    order = sorted(range(T), key=lambda t: (ids[t], t))
    inverse = [order.index(t) for t in range(T)]
    counts = [ids.count(k) for k in range(K)]
    offsets = [sum(counts[: k + 1]) for k in range(K)]
    offsets[-1] = T
    return ids, order, inverse, offsets, counts


@pytest.mark.parametrize("lengths, adapters", [
    ([3, 5, 2], [2, 0, 2]),  # adapter 1 absent, a padding tail
    ([4, 4, 4, 4], [1, 0, 1, 0]),  # no tail
    ([7], [0]),
])
def test_adapter_fields_are_the_sort_by_adapter(lengths, adapters):
    cache = _cache()
    with SyncSentinel(strict=True):  # host built: no device->host read
        pb = cache.set_batch(lengths, adapters=adapters)
    p = pb.packed_seq_params
    ids, order, inverse, offsets, counts = _expected(lengths, adapters)
    assert p.adapter_ids_T.tolist() == ids
    assert p.adapter_order_T.tolist() == order
    assert p.adapter_inverse_T.tolist() == inverse
    assert p.adapter_offsets_K.tolist() == offsets
    assert p.adapter_tokens_K.tolist() == counts
    assert pb.adapters_N.tolist() == adapters and pb.adapter_tokens_K.tolist() == counts
    assert cache.stats.host_to_device_copies == 1  # one copy: the adapters ride in the record
    assert p.adapter_order_T.dtype == torch.int32


def test_fields_are_static_across_batches_and_slots():
    cache = _cache(num_slots=2)

    def ptrs(pb):
        p = pb.packed_seq_params
        return [t.data_ptr() for t in (p.adapter_order_T, p.adapter_offsets_K)]

    a = cache.set_batch([3, 5], adapters=[0, 1])
    first = ptrs(a)
    cache.release(a)
    b = cache.set_batch([2, 2, 2], adapters=[2, 2, 1])  # the other slot
    c = cache.set_batch([8], adapters=[1])  # a's slot again
    assert (a.slot, b.slot, c.slot) == (0, 1, 0)
    assert ptrs(c) == first and ptrs(b) != first
    assert b.packed_seq_params.adapter_tokens_K.tolist() == [0, 2, 4]  # b untouched by c
    assert c.packed_seq_params.adapter_tokens_K.tolist() == [0, 8, 0]


def test_without_adapters_nothing_changes():
    plain = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=S))
    pb = plain.set_batch([3, 5])
    assert pb.adapters_N is None and pb.packed_seq_params.adapter_order_T is None
    assert plain.slots[0].record_R.numel() == (S + 2) + 2 * T  # C = S + 1 + T / M, then 2 T
    with pytest.raises(ValueError, match="carries no adapter indices"):
        plain.set_batch([3], adapters=[0])


@pytest.mark.parametrize("adapters, match", [
    ([0, 3], r"adapter index out of range: adapters\[1\]=3, but the cache has num_adapters=3"),
    ([-1, 0], r"adapters\[0\]=-1"),
    ([0], "adapters has 1 entries for 2 sequences"),
    (None, r"num_adapters=3\): give each sequence's adapter"),
    ([0.5, 1.0], "must be integers"),
    (torch.tensor([0, 1], device="meta"), "must be on the host"),
])
def test_bad_adapters_refused_before_device_work(adapters, match):
    cache = _cache()
    with SyncSentinel() as s, pytest.raises((ValueError, TypeError), match=match):
        cache.set_batch([3, 5], adapters=adapters)
    assert s.aten_ops == 0 and s.num_syncs == 0
    assert not cache.slots[0].busy and cache.stats.host_to_device_copies == 0


@pytest.mark.parametrize("kw, match", [
    (dict(num_adapters=0), "num_adapters must be an int >= 1"),
    (dict(num_adapters=True), "num_adapters must be an int >= 1"),
    (dict(num_adapters=2, context_parallel_size=2, max_tokens=16, max_seqlen=16),
     "use CP 1"),
])
def test_bad_num_adapters_refused(kw, match):
    kw = {"max_tokens": T, "max_seqs": S, **kw}
    with pytest.raises(ValueError, match=match):
        PackedSeqConfig(**kw)


def test_device_built_record_refused_with_adapters():
    cache = _cache()
    with pytest.raises(ValueError, match="copy_record=True"):
        cache.load_slot(0, [3, 5], adapters=[0, 1], copy_record=False)
    cache.load_slot(0, [3, 5], adapters=[0, 1])
    with pytest.raises(ValueError, match="built on the host"):
        cache.build_slot(0, lengths_S=torch.tensor([3, 5, 0, 0], dtype=torch.int32))
    assert np.array_equal(cache.build_slot(0).packed_seq_params.adapter_tokens_K.numpy(), [3, 5, 0])


@pytest.mark.parametrize("release", ["step", "backward"])
def test_in_flight_batches_pass_the_adapters_on(release):
    from megatron_fastpath.packed_seq.inflight import InFlightBatches

    cache = _cache(num_slots=2)
    inflight = InFlightBatches(cache, release=release)
    a = inflight.acquire([3, 5], adapters=[2, 2])
    b = inflight.acquire([4], adapters=[1])
    assert a.packed_seq_params.adapter_tokens_K.tolist() == [0, 0, 8]
    assert b.packed_seq_params.adapter_tokens_K.tolist() == [0, 4, 0]
    assert b.adapters_N.tolist() == [1]
