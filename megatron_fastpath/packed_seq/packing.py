"""First-fit-decreasing packing of variable-length samples into fixed-capacity bins."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["first_fit_decreasing", "first_fit_decreasing_arrays"]


def first_fit_decreasing(
    lengths: Sequence[int], max_tokens: int, max_seqs: int, pad_multiple: int = 1
) -> list[list[int]]:
    """Pack samples (by index) into bins of at most ``max_tokens`` tokens and ``max_seqs``
    samples: samples in decreasing length, each into the first bin with room. A sample takes
    its length rounded up to ``pad_multiple`` (the main job's ``data.pad_multiple``: with
    context parallelism a multiple of 2 x CP, which the packed cache pads every sequence to,
    :mod:`megatron_fastpath.packed_seq.context_parallel`).

    Deterministic (ties keep the input order). Returns bins as lists of sample indices, each in
    placement order. Raises ValueError for a sample longer than ``max_tokens`` or non-positive.
    """
    members, starts = first_fit_decreasing_arrays(lengths, max_tokens, max_seqs, pad_multiple)
    return [b.tolist() for b in np.split(members, starts[1:-1])] if len(members) else []


def first_fit_decreasing_arrays(lengths, max_tokens: int, max_seqs: int,
                                pad_multiple: int = 1) -> tuple:
    """:func:`first_fit_decreasing` as arrays: (``members`` int64 [N], the sample indices bin
    after bin, each bin's in placement order; ``starts`` int64 [bins + 1], bin ``b`` being
    ``members[starts[b]:starts[b + 1]]``). Memory and time grow with the number of samples
    times the number of distinct (padded) lengths, not with samples x bins: the samples of one
    padded length go, in order, into the bins with room left to right -- the bins first-fit
    gives them one by one (no bin's room grows while they are placed) -- a few array passes
    over the bins per length."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n_samples = len(lengths)
    order = np.argsort(-lengths, kind="stable")  # decreasing length, ties in input order
    sizes = -(-lengths[order] // pad_multiple) * pad_multiple
    if n_samples:
        if sizes[0] > max_tokens:
            raise ValueError(f"sample {int(order[0])} has {int(sizes[0])} tokens, more than a bin "
                             f"holds ({max_tokens})")
        if lengths[order[-1]] <= 0:
            k = int(np.argmax(lengths[order] <= 0))
            raise ValueError(f"sample {int(order[k])} has non-positive length {int(lengths[order[k]])}")
    bin_of = np.empty(n_samples, dtype=np.int64)  # per sample in ``order``
    room = np.zeros(0, dtype=np.int64)
    count = np.zeros(0, dtype=np.int64)
    run_starts = np.flatnonzero(np.r_[True, sizes[1:] != sizes[:-1]]) if n_samples else []
    run_ends = list(run_starts[1:]) + [n_samples]
    for a, e in zip(run_starts, run_ends):
        n, left = int(sizes[a]), int(e - a)
        take = np.where(count < max_seqs, np.minimum(room // n, max_seqs - count), 0)
        if take.any():  # existing bins, left to right, each filled as far as it goes
            csum = np.cumsum(take)
            last = int(np.searchsorted(csum, min(left, int(csum[-1]))))  # last bin used
            take = take[: last + 1].copy()
            take[last] -= int(csum[last]) - min(left, int(csum[last]))
            used = np.flatnonzero(take)
            got = take[used]
            bin_of[a: a + int(got.sum())] = np.repeat(used, got)
            room[used] -= got * n
            count[used] += got
            a += int(got.sum())
            left -= int(got.sum())
        if left:  # new bins, each filled as far as it goes, the last with the rest
            per = min(max_tokens // n, max_seqs)
            new = -(-left // per)
            got = np.full(new, per, dtype=np.int64)
            got[-1] = left - per * (new - 1)
            bin_of[a: e] = len(room) + np.repeat(np.arange(new), got)
            room = np.concatenate([room, max_tokens - got * n])
            count = np.concatenate([count, got])
    by_bin = np.argsort(bin_of, kind="stable")  # placement order inside each bin
    members = order[by_bin].astype(np.int64)
    starts = np.zeros(len(room) + 1, dtype=np.int64)
    np.cumsum(count, out=starts[1:])
    return members, starts
