"""Context parallelism (CP) of a packed batch: this rank's share of the tokens, built on the host.

With CP = ``context_parallel_size`` > 1 every sequence of the packed batch is padded to a
multiple of 2 x CP tokens (the padding is virtual: its tokens read an appended pad row, carry no
label and no loss), the padding tail of the T packed tokens is closed into pieces as without CP,
and every piece of the resulting global ``cu_seqlens`` is split into 2 x CP equal chunks: rank r
holds chunks r and 2CP-1-r of every piece, in order -- the load-balanced THD assignment of
Transformer Engine (``thd_partition_indices_kernel`` behind ``tex.thd_get_partitioned_indices``,
transformer_engine/common/fused_attn/context_parallel.cu) and of Megatron's
``get_batch_on_this_cp_rank`` for BSHD. Each rank sees T_l = T / CP tokens.

The flat int32 record (one host->device copy per batch, like the record without CP)::

    [ cu_global (C) | position_ids (T_l) | seq_ids (T_l) | token_index (T_l)
      | kv_position_ids (T) | kv_seq_ids (T) | cu_local (C) ]

* ``cu_global_C``: boundaries of the padded sequences and the closed tail (TE's THD + CP reads
  these global ``cu_seqlens``; every piece is a multiple of 2 x CP, so no ``*_padded`` differs).
* ``position_ids_T`` / ``seq_ids_T``: global position inside its sequence / sequence index of this
  rank's tokens (-1 on the tail; a sequence's virtual padding keeps its sequence id).
* ``token_index_T``: index of each local token in the caller's packed (unpadded) [T] token buffer;
  T (the appended pad row) for virtual padding and the tail.
* ``kv_position_ids_K`` / ``kv_seq_ids_K``: the same for the keys all-gathered over the CP group
  (rank 0's T_l tokens, then rank 1's, ...), which the ``sdpa`` mask reads.
* ``cu_local_C``: ``cu_global_C / CP``, the boundaries of the local tokens.

Shape letters: T = max_tokens (global), T_l = T / CP local tokens, K = T gathered keys,
C = cu_seqlens entries, N = sequences, R = the flat record.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_fastpath.packed_seq.metadata import cu_seqlens_size

__all__ = ["CPHostMetadata", "build_cp_host_metadata", "cp_padded_lengths", "cp_record_size",
           "partition_indices", "split_cp_record"]


def cp_padded_lengths(lengths_N: np.ndarray, cp: int) -> np.ndarray:
    """Each length rounded up to a multiple of 2 x CP (what the cache pads each sequence to)."""
    q = 2 * cp
    return -(-np.asarray(lengths_N, dtype=np.int64) // q) * q


def partition_indices(cu_C: np.ndarray, cp: int, rank: int) -> np.ndarray:
    """[T / CP] int64: the global token indices rank ``rank`` holds, in its local order: for each
    piece of ``cu_C`` (every length a multiple of 2 x CP; zero-length pieces skipped), chunk
    ``rank`` then chunk ``2CP-1-rank`` of the piece's 2 x CP equal chunks."""
    cu = np.asarray(cu_C, dtype=np.int64)
    starts, lens = cu[:-1], np.diff(cu)
    if np.any(lens % (2 * cp)):
        bad = int(lens[np.argmax(lens % (2 * cp) != 0)])
        raise ValueError(f"a packed piece of {bad} tokens is not a multiple of 2 x CP = {2 * cp}")
    chunk_N = lens // (2 * cp)
    out = []
    for start, c in zip(starts[lens > 0], chunk_N[lens > 0]):
        out.append(start + rank * c + np.arange(c))
        out.append(start + (2 * cp - 1 - rank) * c + np.arange(c))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def cp_record_size(max_tokens: int, max_seqs: int, bound: int, cp: int) -> int:
    c = cu_seqlens_size(max_tokens, max_seqs, bound)
    return 2 * c + 3 * (max_tokens // cp) + 2 * max_tokens


def split_cp_record(record_R, max_tokens: int, max_seqs: int, bound: int, cp: int):
    """Views (cu_global_C, position_ids_T, seq_ids_T, token_index_T, kv_position_ids_K,
    kv_seq_ids_K, cu_local_C) of a CP record (numpy array or tensor), no copies."""
    c, tl, t = cu_seqlens_size(max_tokens, max_seqs, bound), max_tokens // cp, max_tokens
    sizes = (c, tl, tl, tl, t, t, c)
    views, at = [], 0
    for n in sizes:
        views.append(record_R[at: at + n])
        at += n
    return tuple(views)


@dataclasses.dataclass(frozen=True)
class CPHostMetadata:
    """The CP layout of one packed batch on the host (``record_R`` is what is copied).

    padded_lengths_N: the sequence lengths after padding to 2 x CP.
    global_index_RT: [CP, T_l] the global padded positions each rank holds (for tests / logs).
    """

    record_R: np.ndarray
    padded_lengths_N: np.ndarray
    global_index_RT: np.ndarray


def build_cp_host_metadata(lengths_N: np.ndarray, max_tokens: int, max_seqs: int, bound: int,
                           cp: int, rank: int) -> CPHostMetadata:
    """The CP record of validated ``lengths_N`` (positive, at most ``max_seqs``) for rank
    ``rank`` of ``cp``. Raises ValueError when the padded sequences do not fit T or the bound."""
    q = 2 * cp
    if max_tokens % q or bound % q:
        raise ValueError(
            f"context parallelism {cp} splits every packed piece into 2 x CP = {q} chunks: "
            f"max_tokens={max_tokens} and the sequence bound max_seqlen={bound} must be "
            f"multiples of {q}; set data.max_tokens (and the bound) to a multiple of {q}")
    lengths_N = np.asarray(lengths_N, dtype=np.int64)
    padded_N = cp_padded_lengths(lengths_N, cp)
    total, n = int(padded_N.sum()), int(lengths_N.size)
    if total > max_tokens:
        raise ValueError(
            f"the batch's sequences padded to multiples of 2 x CP = {q} hold {total} tokens, more "
            f"than max_tokens={max_tokens}: pack with the padded lengths (the main job counts "
            "each sample padded to data.pad_multiple, a multiple of 2 x CP) or raise max_tokens")
    if int(padded_N.max()) > bound:
        raise ValueError(
            f"a sequence padded to {int(padded_N.max())} tokens (2 x CP = {q}) exceeds the static "
            f"bound max_seqlen={bound}")
    c = cu_seqlens_size(max_tokens, max_seqs, bound)
    cu_C = np.zeros(c, dtype=np.int64)
    cu_C[1: n + 1] = np.cumsum(padded_N)
    tail = np.arange(total + bound, max_tokens, bound, dtype=np.int64)
    cu_C[n + 1: n + 1 + tail.size] = tail
    cu_C[n + 1 + tail.size:] = max_tokens
    # global padded layout: sequence id, position, and index into the caller's unpadded buffer
    sid_T = np.full(max_tokens, -1, dtype=np.int64)
    pos_T = np.zeros(max_tokens, dtype=np.int64)
    src_T = np.full(max_tokens, max_tokens, dtype=np.int64)
    seq_of = np.repeat(np.arange(n, dtype=np.int64), padded_N)
    pos_in = np.arange(total, dtype=np.int64) - np.repeat(cu_C[:n], padded_N)
    sid_T[:total], pos_T[:total] = seq_of, pos_in
    real = pos_in < lengths_N[seq_of]
    unpadded_start_N = np.concatenate([[0], np.cumsum(lengths_N)[:-1]])
    src_T[:total][real] = (unpadded_start_N[seq_of] + pos_in)[real]
    index_RT = np.stack([partition_indices(cu_C, cp, r) for r in range(cp)])
    record_R = np.zeros(cp_record_size(max_tokens, max_seqs, bound, cp), dtype=np.int32)
    cu_g, pos_l, sid_l, tok_l, kv_pos, kv_sid, cu_l = split_cp_record(
        record_R, max_tokens, max_seqs, bound, cp)
    mine_T = index_RT[rank]
    cu_g[:] = cu_C
    pos_l[:], sid_l[:], tok_l[:] = pos_T[mine_T], sid_T[mine_T], src_T[mine_T]
    gathered_K = index_RT.reshape(-1)
    kv_pos[:], kv_sid[:] = pos_T[gathered_K], sid_T[gathered_K]
    cu_l[:] = cu_C // cp
    return CPHostMetadata(record_R=record_R, padded_lengths_N=padded_N, global_index_RT=index_RT)
