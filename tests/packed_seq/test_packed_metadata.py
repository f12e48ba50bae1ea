"""Host-side packed metadata, packing, and input validation (no device work on bad input)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_fastpath.packed_seq import Llama3RopeScaling, PackedSeqCache, PackedSeqConfig, RopeConfig
from megatron_fastpath.packed_seq.metadata import (
    build_host_metadata,
    lengths_from_cu_seqlens,
    split_record,
)
from megatron_fastpath.packed_seq.packing import first_fit_decreasing
from megatron_fastpath.sync import SyncSentinel


def reference_metadata(lengths, max_tokens, max_seqs, max_seqlen=None):
    """Per-token loop reference: cu_seqlens with the padding tail closed at T in pieces of at
    most max_seqlen (NeMo's collate closes it with one final boundary at T)."""
    bound = max_seqlen or max_tokens
    cu, pos, sid = [0], [], []
    for s, n in enumerate(lengths):
        cu.append(cu[-1] + n)
        pos += list(range(n))
        sid += [s] * n
    total = cu[-1]
    while cu[-1] < max_tokens:
        cu.append(min(cu[-1] + bound, max_tokens))
    size = max_seqs + 1 + -(-max_tokens // bound)
    cu_pad = cu + [max_tokens] * (size - len(cu))
    pos += [0] * (max_tokens - total)
    sid += [-1] * (max_tokens - total)
    return cu_pad, pos, sid


@pytest.mark.parametrize(
    "lengths", [[1], [5, 1, 7], [1] * 8, [16], [3, 3, 3, 3, 4], list(range(1, 6))]
)
@pytest.mark.parametrize("bound", [16, 5])
def test_record_matches_per_token_reference(lengths, bound):
    if max(lengths) > bound:
        pytest.skip("sequence longer than the bound")
    m = build_host_metadata(lengths, max_tokens=16, max_seqs=8, max_seqlen_bound=bound)
    got = [a.tolist() for a in split_record(m.record_R, 16, 8, bound)]
    assert got == [list(x) for x in reference_metadata(lengths, 16, 8, bound)]
    assert got[0][-1] == 16  # the tail is closed: every row lies inside a "sequence"
    assert max(b - a for a, b in zip(got[0], got[0][1:])) <= bound
    assert (m.num_seqs, m.num_tokens, m.max_seqlen) == (len(lengths), sum(lengths), max(lengths))


@pytest.mark.parametrize(
    "lengths, match",
    [
        ([[3, 4], [5]], r"flat list of integers, one per sequence; got a ragged"),
        ([2**70], r"must fit in int64.*got 1180591620717411303424"),
        ([2**62, 2**62], r"a sequence of 4611686018427387904 tokens exceeds"),
    ],
)
def test_ragged_and_huge_lengths_say_what_is_wrong(lengths, match):
    """Ragged and huge lengths are refused with a message naming the problem (not numpy's
    ragged-array message or a bare 'TypeError ... got []')."""
    with pytest.raises(ValueError, match=match):
        build_host_metadata(lengths, 16, 8, 16)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4))
    with pytest.raises(ValueError, match=match):
        cache.set_batch(lengths)


@pytest.mark.parametrize(
    "lengths",
    [[3, 4], np.array([3, 4], dtype=np.int32), torch.tensor([3, 4]), (3, 4)],
)
def test_accepts_host_lengths_in_every_collator_form(lengths):
    m = build_host_metadata(lengths, 8, 4, 8)
    assert m.lengths_N.tolist() == [3, 4]


@pytest.mark.parametrize(
    "lengths, exc, match",
    [
        ([3, 0, 2], ValueError, r"positive; lengths\[1\]=0"),
        ([3, -1], ValueError, "positive"),
        ([2.5, 3], TypeError, "integer"),
        (np.array([2.0, 3.0]), TypeError, "integer dtype"),
        (torch.tensor([2.0, 3.0]), TypeError, "integers"),
        ([True, 3], TypeError, "integers"),
        (["a", 3], TypeError, "integers"),
        ([9, 9], ValueError, "18 tokens exceed the cache capacity max_tokens=16"),
        ([1] * 9, ValueError, "9 sequences exceed the cache capacity max_seqs=8"),
        ([], ValueError, "at least one sequence"),
        ([[1, 2]], ValueError, "1-D"),
    ],
)
def test_bad_lengths_rejected_on_host(lengths, exc, match):
    with pytest.raises(exc, match=match):
        build_host_metadata(lengths, max_tokens=16, max_seqs=8, max_seqlen_bound=16)


def test_sequence_longer_than_max_seqlen_bound():
    with pytest.raises(ValueError, match="exceeds the static bound max_seqlen=8"):
        build_host_metadata([9], max_tokens=16, max_seqs=4, max_seqlen_bound=8)


@pytest.mark.parametrize(
    "cu, match",
    [
        ([0, 4, 2, 6], "non-decreasing"),
        ([1, 4, 6], "start at 0"),
        ([0, 3, 3, 6], "not strictly increasing"),
        ([0], "at least 2 entries"),
    ],
)
def test_bad_cu_seqlens_rejected(cu, match):
    with pytest.raises(ValueError, match=match):
        lengths_from_cu_seqlens(cu)


def test_cu_seqlens_with_edge_padding_accepted():
    assert lengths_from_cu_seqlens([0, 3, 4, 9, 9, 9]).tolist() == [3, 1, 5]


def test_device_tensor_lengths_refused_as_a_sync(monkeypatch):
    meta = torch.tensor([3, 4], device="meta")
    with pytest.raises(TypeError, match="must be on the host"):
        build_host_metadata(meta, 8, 4, 8)


def test_bad_input_raises_before_any_device_work():
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4, rope=RopeConfig(dim=4)))
    cache.register("sdpa_mask")
    before = cache.slots[0].record_R.clone()
    with SyncSentinel() as s:
        for bad in ([0, 2], [20], [1] * 5):
            with pytest.raises(ValueError):
                cache.set_batch(bad)
        with pytest.raises(ValueError, match="non-decreasing"):
            cache.set_batch(cu_seqlens=[0, 5, 3])
    assert s.aten_ops == 0, s.op_counts  # validation is host-only
    assert torch.equal(cache.slots[0].record_R, before)
    assert not cache.slots[0].busy and cache.stats.batches == 0


def test_config_validation():
    with pytest.raises(ValueError, match="max_seqs=9 > max_tokens=8"):
        PackedSeqConfig(max_tokens=8, max_seqs=9)
    with pytest.raises(ValueError, match="positive int"):
        PackedSeqConfig(max_tokens=0, max_seqs=1)
    with pytest.raises(ValueError, match="even"):
        RopeConfig(dim=7)


def test_first_fit_decreasing_packs_within_capacity_and_keeps_every_sample():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=200).tolist()
    bins = first_fit_decreasing(lengths, max_tokens=512, max_seqs=6)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(200))  # nothing lost, nothing duplicated
    assert all(sum(lengths[i] for i in b) <= 512 and len(b) <= 6 for b in bins)
    # FFD is within 11/9 OPT + 6/9 of the optimum; the token lower bound is sum/capacity.
    assert len(bins) <= int(np.ceil(sum(lengths) / 512 * 11 / 9)) + 1


def test_first_fit_decreasing_rejects_oversized_samples():
    with pytest.raises(ValueError, match="more than a bin holds"):
        first_fit_decreasing([10, 600], 512, 4)


@pytest.mark.gpu
def test_cuda_cache_one_pinned_copy_no_sync_static_buffers():
    """On CUDA: staging is pinned, one H2D copy per batch, strict sync-free set_batch and
    derived builds, and the buffers keep their addresses across batches."""
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=256, max_seqs=16, rope=RopeConfig(dim=32)),
                           device=torch.device("cuda"))
    cache.register("sdpa_mask", torch.bfloat16)
    cache.register("rope_cos_sin", torch.bfloat16)
    assert cache.slots[0].staging_R.is_pinned()
    ptrs = None
    for step in range(5):
        with SyncSentinel(strict=True):
            pb = cache.set_batch([10 + step, 30, 1, 100])
        slot = cache.slots[pb.slot]
        now = (slot.record_R.data_ptr(), pb.packed_seq_params.sdpa_mask_TT.data_ptr())
        ptrs = ptrs or now
        assert now == ptrs
        torch.cuda.synchronize()
        expected = reference_metadata([10 + step, 30, 1, 100], 256, 16)
        assert pb.packed_seq_params.cu_seqlens_q.tolist() == expected[0]
        assert pb.packed_seq_params.seq_ids_T.tolist() == expected[2]
        cache.release(pb)
    assert cache.stats.host_to_device_copies == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[5, 1, 7], [16], [1] * 8, [3, 9]])
def test_sdpa_mask_is_additive_block_diagonal_causal_with_padding_on_the_diagonal(lengths, dtype):
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=8))
    cache.register("sdpa_mask", dtype)
    with cache.batch(lengths) as pb:
        mask = pb.packed_seq_params.sdpa_mask_TT
    sid = torch.tensor(reference_metadata(lengths, 16, 8)[2])
    i = torch.arange(16)
    expected = ((sid[:, None] == sid[None, :]) & (i[None, :] <= i[:, None])) | torch.eye(16, dtype=torch.bool)
    expected &= ~((sid[:, None] == -1) & ~torch.eye(16, dtype=torch.bool))  # pads: self only
    assert mask.dtype == dtype
    assert torch.equal(mask, torch.zeros(16, 16, dtype=dtype).masked_fill(~expected, float("-inf")))
    # the SDPA result with our additive mask equals the one with torch's own bool handling
    q, k, v = torch.randn(3, 1, 2, 16, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=expected))


def test_cache_holds_no_causal_constant_and_derived_fields_are_static():
    """No T x T constant beside the per-slot mask; every field keeps its address."""
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=256, max_seqs=8, num_slots=2,
                                           rope=RopeConfig(dim=4)))
    for kind in ("sdpa_mask", "rope_cos_sin", "flex_block_mask"):
        cache.register(kind)
    t = 256
    # per slot: record, [T] bool, [T,T] fp32 mask, 2 x [T,1,D] fp32 and the flex indices
    per_slot = (cache.slots[0].record_R.numel() * 4 + t + t * t * 4 + 2 * t * 4 * 4
                + 4 * (2 * 4 + 2 * 2 * 4))
    ptrs = {}
    for step, lengths in enumerate([[200, 56], [1, 2, 3], [128, 1, 127], [256]]):
        with cache.batch(lengths) as pb:
            now = {k: v.data_ptr() for k, v in pb.packed_seq_params.tensors().items()}
            assert now == ptrs.setdefault(pb.slot, now), f"fields moved at step {step}"
            ref = torch.nn.attention.flex_attention.create_block_mask(
                lambda b, h, q, kv: pb.packed_seq_params.sdpa_mask_TT[q, kv] == 0,
                None, None, t, t, device="cpu")
            for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
                assert torch.equal(getattr(pb.packed_seq_params, f"flex_{name}"), getattr(ref, name))
    assert cache.cache_bytes() == 2 * per_slot + t * 4  # + the int32 arange
    assert cache.stats.per_kind == {"sdpa_mask": 4, "rope_cos_sin": 4, "flex_block_mask": 4}


def test_real_token_mask_and_megatron_padding_mask_layout():
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4))
    with cache.batch([5, 6]) as pb:
        real = pb.packed_seq_params.real_token_mask_T
        assert real.tolist() == [True] * 11 + [False] * 5
        # Megatron's GPTModel(padding_mask=[b, s]) is True on padding (router.py:
        # routing_map & ~padding_mask): the complement, in its own static buffer
        assert pb.padding_mask_1T.tolist() == [[False] * 11 + [True] * 5]
        ptr = pb.padding_mask_1T.data_ptr()
    with cache.batch([16]) as pb:
        assert pb.padding_mask_1T.data_ptr() == ptr and not pb.padding_mask_1T.any()


@pytest.mark.parametrize("factor", [None, 8.0, 32.0])
def test_rope_inv_freq_matches_megatron_rotary_embedding(factor):
    """Including Llama 3.1's frequency scaling (Megatron's rope_scaling / _apply_scaling)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    kw = dict(rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0)
    ref = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000,
                          use_cpu_initialization=True, **kw).inv_freq
    ours = RopeConfig(dim=128, base=500000.0,
                      llama3=Llama3RopeScaling(factor) if factor is not None else None).inv_freq()
    assert torch.equal(ours, ref)
    if factor is not None:
        assert not torch.equal(ours, RopeConfig(dim=128, base=500000.0).inv_freq())
