"""Host-side construction of a packed batch's boundary metadata B.

B = {lengths, cu_seqlens, max_seqlen, positions, sequence ids} is derived here, on the host,
from what a packing collator already holds (per-sample lengths, or host cu_seqlens). Nothing in
this module touches a device: every validation error is raised before any device work.

Layout of the flat int32 record (one contiguous buffer so the host->device move is ONE copy)::

    [ cu_seqlens (C) | position_ids (T) | seq_ids (T) ]

with S = ``max_seqs``, T = ``max_tokens`` (the static capacities), M = the static
``max_seqlen`` bound and C = S + 1 + ceil(T / M):

* ``cu_seqlens_C``: 0, c1, ..., cN, then the padding tail closed at T: boundaries every M tokens
  from cN up to a final one at T (one boundary when M = T, as NeMo's collate closes the tail),
  then edge-padded with T up to C entries (zero-length sequences, which varlen kernels skip).
  Every row of the [T, ...] activations is inside a "sequence", so flash-attn / TE write every
  row of their outputs and of dq / dk / dv (FA2's varlen backward leaves rows after the last
  boundary uninitialised), and no separate ``cu_seqlens_padded`` is needed (TE decides
  ``pad_between_seqs`` with a host-syncing ``torch.equal`` when one is passed).
* ``position_ids_T``: position inside its own sequence (resets to 0 at each boundary); 0 on
  padding tokens.
* ``seq_ids_T``: index of the sequence each token belongs to; -1 on padding tokens
  (tokens ``cN .. T-1``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Sequence, Union

import numpy as np
import torch

__all__ = [
    "HostPackedMetadata",
    "build_host_metadata",
    "lengths_from_cu_seqlens",
    "record_size",
    "resolve_lengths",
    "split_record",
]

LengthsLike = Union[Sequence[int], np.ndarray, torch.Tensor]


def cu_seqlens_size(max_tokens: int, max_seqs: int, max_seqlen_bound: Optional[int] = None) -> int:
    """C: entries of the static cu_seqlens (S real boundaries + the closed padding tail)."""
    bound = max_seqlen_bound or max_tokens
    return max_seqs + 1 + -(-max_tokens // bound)


def record_size(max_tokens: int, max_seqs: int, max_seqlen_bound: Optional[int] = None) -> int:
    """Number of int32 entries in the flat metadata record."""
    return cu_seqlens_size(max_tokens, max_seqs, max_seqlen_bound) + 2 * max_tokens


def split_record(record_R, max_tokens: int, max_seqs: int, max_seqlen_bound: Optional[int] = None):
    """Views (cu_seqlens_C, position_ids_T, seq_ids_T) of a flat record (numpy array or
    tensor): no copies, so device views keep the record's storage."""
    c = cu_seqlens_size(max_tokens, max_seqs, max_seqlen_bound)
    return record_R[:c], record_R[c : c + max_tokens], record_R[c + max_tokens : c + 2 * max_tokens]


@dataclasses.dataclass(frozen=True)
class HostPackedMetadata:
    """B for one packed batch, on the host.

    record_R: the flat int32 record (R = record_size(max_tokens, max_seqs)).
    lengths_N: per-sequence lengths (N = num_seqs), int64.
    num_seqs / num_tokens / max_seqlen: host ints of the *real* batch.
    adapters_N / adapter_tokens_K: each sequence's adapter and each adapter's real tokens, when
        the cache carries adapters (:mod:`~megatron_fastpath.packed_seq.adapters`); else None.
    """

    record_R: np.ndarray
    lengths_N: np.ndarray
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    adapters_N: Optional[np.ndarray] = None
    adapter_tokens_K: Optional[np.ndarray] = None


def _as_host_int_array(values: LengthsLike, what: str) -> np.ndarray:
    """Lengths/cu_seqlens as a 1-D int64 numpy array, refusing anything that is not on the host
    or not integral (a device tensor here would mean a device->host sync)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise TypeError(
                f"{what} must be on the host (list, numpy array or CPU tensor); got a tensor on "
                f"{values.device}. Reading it would be a device-to-host sync: pass the values "
                "your collator built on the host."
            )
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{what} must be integers; got a tensor of dtype {values.dtype}")
        arr = values.detach().numpy()
    else:
        if isinstance(values, (list, tuple)) and any(
            isinstance(v, (bool, np.bool_)) for v in values
        ):
            raise TypeError(f"{what} must be integers; got booleans in {list(values)[:8]!r}")
        arr = _flat_array(values, what)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype == object:
            bad = [v for v in arr.ravel() if not isinstance(v, numbers.Integral)]
            if not bad:  # Python ints numpy could not hold: beyond int64
                big = next(v for v in arr.ravel() if not -(2**63) <= v < 2**63)
                raise ValueError(
                    f"{what} must fit in int64 (a packed batch holds at most max_tokens tokens); "
                    f"got {big}"
                )
            raise TypeError(f"{what} must be integers; got {bad[:3]!r}")
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise TypeError(f"{what} must be integers; got non-integer values {arr[:8]!r}")
            raise TypeError(f"{what} must have an integer dtype; got {arr.dtype} (values {arr[:8]!r})")
        if arr.dtype.kind not in "iu":  # bool ('b'), strings, ...
            raise TypeError(f"{what} must be integers; got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D; got shape {tuple(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def _flat_array(values, what: str) -> np.ndarray:
    """np.asarray, with numpy's ragged-sequence error replaced by one that says what is wrong."""
    try:
        return np.asarray(values)
    except ValueError as exc:  # inhomogeneous nesting, e.g. [[3, 4], [5]]
        raise ValueError(
            f"{what} must be a flat list of integers, one per sequence; got a ragged nested "
            f"sequence {list(values)[:4]!r} (pack one microbatch per call)"
        ) from exc


def lengths_from_cu_seqlens(cu_seqlens: LengthsLike) -> np.ndarray:
    """Per-sequence lengths from host cu_seqlens, validating that it starts at 0 and is strictly
    increasing (trailing repeats of the last value -- the padded form used by NeMo's
    ``pad_cu_seqlens`` -- are accepted and dropped)."""
    cu = _as_host_int_array(cu_seqlens, "cu_seqlens")
    if cu.size < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (0 and the total); got {cu.tolist()}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0]={int(cu[0])}")
    diffs = np.diff(cu)
    if np.any(diffs < 0):
        i = int(np.argmax(diffs < 0))
        raise ValueError(
            f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}]={int(cu[i + 1])} < "
            f"cu_seqlens[{i}]={int(cu[i])}"
        )
    # Drop edge padding (repeats of the final total); any other zero-length sequence is an error.
    last = int(np.max(np.nonzero(diffs)[0])) + 1 if np.any(diffs > 0) else 0
    body = diffs[:last]
    if np.any(body == 0):
        i = int(np.argmax(body == 0))
        raise ValueError(
            f"cu_seqlens is not strictly increasing: cu_seqlens[{i}] == cu_seqlens[{i + 1}] == "
            f"{int(cu[i])} (a zero-length sequence before the end)"
        )
    return body


def build_host_metadata(
    lengths: LengthsLike,
    max_tokens: int,
    max_seqs: int,
    max_seqlen_bound: int,
) -> HostPackedMetadata:
    """Validate per-sequence ``lengths`` and build the flat int32 record for the static buffers.

    Raises:
        TypeError: lengths are not host integers.
        ValueError: a length <= 0, more than ``max_seqs`` sequences, more than ``max_tokens``
            tokens, or a sequence longer than ``max_seqlen_bound``.
    """
    lengths_N = _as_host_int_array(lengths, "lengths")
    n = int(lengths_N.size)
    if n > max_seqs:  # before the sum: a huge list must not be summed first
        raise ValueError(
            f"{n} sequences exceed the cache capacity max_seqs={max_seqs}; raise "
            "PackedSeqConfig.max_seqs or pack fewer samples per batch"
        )
    if n == 0:
        raise ValueError("a packed batch needs at least one sequence; got no lengths")
    if np.any(lengths_N <= 0):
        i = int(np.argmax(lengths_N <= 0))
        raise ValueError(f"sequence lengths must be positive; lengths[{i}]={int(lengths_N[i])}")
    longest = int(lengths_N.max())  # before the sum, which could overflow int64
    if longest > max_seqlen_bound:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the static bound max_seqlen={max_seqlen_bound}"
            " (PackedSeqConfig.max_seqlen)"
        )
    total = int(lengths_N.sum())
    if total > max_tokens:
        raise ValueError(
            f"{total} tokens exceed the cache capacity max_tokens={max_tokens}; raise "
            "PackedSeqConfig.max_tokens or pack fewer tokens per batch"
        )

    record_R = np.zeros(record_size(max_tokens, max_seqs, max_seqlen_bound), dtype=np.int32)
    cu_C, pos_T, sid_T = split_record(record_R, max_tokens, max_seqs, max_seqlen_bound)

    cu_C[1 : n + 1] = np.cumsum(lengths_N)
    # close the padding tail: boundaries every max_seqlen_bound tokens, the last one at T
    tail = np.arange(total + max_seqlen_bound, max_tokens, max_seqlen_bound, dtype=np.int64)
    cu_C[n + 1 : n + 1 + tail.size] = tail
    cu_C[n + 1 + tail.size :] = max_tokens  # final boundary at T, then edge padding
    seq_of_token = np.repeat(np.arange(n, dtype=np.int64), lengths_N)
    sid_T[:total] = seq_of_token
    sid_T[total:] = -1
    pos_T[:total] = np.arange(total, dtype=np.int64) - np.repeat(cu_C[:n].astype(np.int64), lengths_N)
    return HostPackedMetadata(
        record_R=record_R, lengths_N=lengths_N.copy(), num_seqs=n, num_tokens=total, max_seqlen=longest
    )


def resolve_lengths(
    lengths: Optional[LengthsLike] = None, cu_seqlens: Optional[LengthsLike] = None
) -> LengthsLike:
    """Exactly one of ``lengths`` / ``cu_seqlens`` (host) -> lengths."""
    if (lengths is None) == (cu_seqlens is None):
        raise ValueError("pass exactly one of lengths= or cu_seqlens=")
    return lengths if lengths is not None else lengths_from_cu_seqlens(cu_seqlens)
