"""First-fit-decreasing packing of variable-length samples into fixed-capacity bins."""

from __future__ import annotations

from typing import Sequence

__all__ = ["first_fit_decreasing"]


def first_fit_decreasing(
    lengths: Sequence[int], max_tokens: int, max_seqs: int, pad_multiple: int = 1
) -> list[list[int]]:
    """Pack samples (by index) into bins of at most ``max_tokens`` tokens and ``max_seqs``
    samples: samples in decreasing length, each into the first bin with room. A sample takes
    its length rounded up to ``pad_multiple`` (2 x CP with context parallelism: the packed
    cache pads every sequence to it, :mod:`megatron_fastpath.packed_seq.context_parallel`).

    Deterministic (ties keep the input order). Returns bins as lists of sample indices, each in
    placement order. Raises ValueError for a sample longer than ``max_tokens`` or non-positive.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n <= 0:
            raise ValueError(f"sample {i} has non-positive length {n}")
        n = -(-n // pad_multiple) * pad_multiple
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than a bin holds ({max_tokens})")
        for b, free in enumerate(room):
            if free >= n and len(bins[b]) < max_seqs:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins
