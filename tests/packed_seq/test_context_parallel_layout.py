"""The packed cache's context-parallel layout against Transformer Engine's and Megatron's own
partitions (neither runs here: TE is not installed and its partition is a CUDA kernel), written
from their source:

* TE ``thd_partition_indices_kernel`` (``tex.thd_get_partitioned_indices``),
  transformer_engine/common/fused_attn/context_parallel.cu: every sequence of ``cu_seqlens`` is
  a multiple of 2 x world_size; local token ``token_id`` of sequence ``seq_id`` (local length
  ``seq_len`` = global / world_size) reads global index
  ``cu_seqlens[seq_id] + index + seq_len / 2 * offset`` where ``index`` is its offset inside the
  local sequence and ``offset = rank`` in the first half, ``2 * (world_size - 1) - rank`` in the
  second.
* Megatron ``get_batch_on_this_cp_rank`` (megatron/training/utils.py, BSHD): the sequence
  dimension viewed as [2 * cp, s / (2 * cp)], rows ``[cp_rank, 2 * cp - cp_rank - 1]`` kept.

Shape letters: T global tokens, T_l local tokens, N sequences, K gathered keys.
"""

import numpy as np
import pytest
import torch

from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.packed_seq.context_parallel import (
    build_cp_host_metadata,
    cp_padded_lengths,
    partition_indices,
)
from megatron_fastpath.packed_seq.rope import RopeConfig


def te_thd_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """TE's thd_partition_indices_kernel, one 'thread' per local token (see the module doc)."""
    cu_s = [c // world_size for c in cu_seqlens]
    out = []
    for token_id in range(total_tokens // world_size):
        # binary_search(token_id, cu_seqlens_s, batch + 1): the last i with cu_s[i] <= token_id
        seq_id = max(i for i in range(len(cu_s) - 1) if cu_s[i] <= token_id)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_s[seq_id] * world_size + seq_len // 2 * offset
        out.append(index)
    return np.array(out)


def megatron_bshd_cp_rank(seq_len, cp, rank):
    """Megatron's get_batch_on_this_cp_rank on one [1, s] sequence of positions."""
    val = torch.arange(seq_len).view(1, 2 * cp, seq_len // (2 * cp))
    index = torch.tensor([rank, 2 * cp - rank - 1])
    return val.index_select(1, index).view(-1).numpy()


CASES = [
    # (lengths, max_tokens, cp): ragged, shorter than 2 x CP, a padding tail
    ([5, 3, 11, 1], 32, 2),
    ([1, 2, 3], 24, 2),
    ([7, 16, 2, 9], 64, 4),
    ([40], 48, 2),
]


@pytest.mark.parametrize("lengths,max_tokens,cp", CASES)
def test_partition_matches_transformer_engine(lengths, max_tokens, cp):
    seen = []
    for rank in range(cp):
        host = build_cp_host_metadata(np.array(lengths), max_tokens, len(lengths) + 2, max_tokens, cp, rank)
        cu = host.record_R[: len(lengths) + 2 + 1 + 1]  # cu_global: S + 1 + ceil(T / M) entries
        cu = np.unique(cu)  # drop edge padding (zero-length pieces TE's kernel never lands in)
        ours = host.global_index_RT[rank]
        np.testing.assert_array_equal(ours, te_thd_partitioned_indices(cu.tolist(), max_tokens, cp, rank))
        seen.append(ours)
    allv = np.concatenate(seen)
    assert sorted(allv.tolist()) == list(range(max_tokens))  # a partition of all T tokens


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (16, 2), (24, 4), (4, 2)])
def test_single_sequence_matches_megatron_bshd(seq_len, cp):
    for rank in range(cp):
        np.testing.assert_array_equal(partition_indices(np.array([0, seq_len]), cp, rank),
                                      megatron_bshd_cp_rank(seq_len, cp, rank))


def test_padded_lengths_round_up_to_2cp():
    assert cp_padded_lengths(np.array([1, 4, 5, 8]), 2).tolist() == [4, 4, 8, 8]


def _caches(cp, t=32, rope=RopeConfig(dim=8)):
    base = PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=6, rope=rope, sdpa_layout="mask"))
    ranks = [PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=6, rope=rope, sdpa_layout="mask",
                                            context_parallel_size=cp, context_parallel_rank=r))
             for r in range(cp)]
    for c in [base, *ranks]:
        c.register("rope_cos_sin")
        c.register("sdpa_mask")
    return base, ranks


def test_cache_fields_are_the_global_tokens_of_each_rank():
    lengths = [5, 3, 11, 1]
    base, ranks = _caches(2)
    ref = base.set_batch(lengths).packed_seq_params
    t = 32
    # global padded layout of the unpadded tokens, for the reference
    padded = cp_padded_lengths(np.array(lengths), 2)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for r, cache in enumerate(ranks):
        before = cache.stats.snapshot()
        pb = cache.set_batch(lengths)
        p = pb.packed_seq_params
        assert cache.stats.since(before).host_to_device_copies == 1
        assert p.position_ids_T.shape == (t // 2,) and pb.position_ids_1T.shape == (1, t // 2)
        host = build_cp_host_metadata(np.array(lengths), t, 6, t, 2, r)
        glob = host.global_index_RT[r]
        cu = np.concatenate([[0], np.cumsum(padded)])
        for i, g in enumerate(glob):
            s = int(np.searchsorted(cu, g, side="right") - 1)
            if s < len(lengths):
                pos = g - cu[s]
                real = pos < lengths[s]
                assert p.seq_ids_T[i] == s and p.position_ids_T[i] == pos
                assert bool(p.real_token_mask_T[i]) == real and bool(pb.padding_mask_1T[0, i]) != real
                want = starts[s] + pos if real else t
                assert int(p.cp_token_index_T[i]) == want
                if real:  # RoPE of the same token as without CP
                    torch.testing.assert_close(p.rope_cos_T1D[i], ref.rope_cos_T1D[want], rtol=0, atol=0)
                    torch.testing.assert_close(p.rope_sin_T1D[i], ref.rope_sin_T1D[want], rtol=0, atol=0)
            else:  # the padding tail
                assert p.seq_ids_T[i] == -1 and int(p.cp_token_index_T[i]) == t
                assert not p.real_token_mask_T[i]
        assert torch.equal(p.cp_cu_seqlens_local_C, p.cu_seqlens_q // 2)
        assert p.cu_seqlens_q[: len(lengths) + 1].tolist() == cu.tolist()
        assert p.sdpa_mask_TT.shape == (t // 2, t)
        cache.release(pb)


def test_cp_mask_matches_the_global_mask():
    """Local query rows of the CP mask over the gathered keys equal the global packed mask of the
    padded layout (same sequence, causal by global position, tail attends itself)."""
    lengths = [5, 3, 11, 1]
    t, cp = 32, 2
    _, ranks = _caches(cp)
    host = build_cp_host_metadata(np.array(lengths), t, 6, t, cp, 0)
    gathered_K = host.global_index_RT.reshape(-1)
    padded = cp_padded_lengths(np.array(lengths), cp)
    glob = PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=6, sdpa_layout="mask"))
    glob.register("sdpa_mask")
    full_TT = glob.set_batch(padded.tolist()).packed_seq_params.sdpa_mask_TT
    for r, cache in enumerate(ranks):
        mask = cache.set_batch(lengths).packed_seq_params.sdpa_mask_TT
        want = full_TT[host.global_index_RT[r]][:, gathered_K]
        # tail tokens: globally one closed tail piece attends itself only in both masks
        assert torch.equal(mask, want)


def test_cp_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="multiples of 4"):
        PackedSeqConfig(max_tokens=30, max_seqs=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="sdpa_layout='padded'"):
        PackedSeqConfig(max_tokens=32, max_seqs=4, context_parallel_size=2, sdpa_layout="padded")
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=8, max_seqs=4, context_parallel_size=2))
    with pytest.raises(ValueError, match="padded to multiples of 2 x CP"):
        cache.set_batch([1, 1, 1])  # 3 real tokens, 12 padded
