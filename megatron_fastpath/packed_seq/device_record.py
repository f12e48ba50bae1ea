"""The boundary record of a packed batch built on the device from its lengths: what
:func:`~megatron_fastpath.packed_seq.metadata.build_host_metadata` builds on the host, entry for
entry, with static-shape device ops and no host read -- so a full-iteration CUDA graph can take
a microbatch's packed lengths as its input and build everything the layers read inside the
capture (``PackedSeqCache.build_slot(index, lengths_S)``).

The host still validates the lengths first (``PackedSeqCache.load_slot``: counts, bounds, types;
errors before any device work); this module trusts them.

Shape key: S = ``max_seqs``, T = ``max_tokens``, M = the static ``max_seqlen`` bound,
C = S + 1 + ceil(T / M) entries of cu_seqlens (the layout in ``metadata.py``).
"""

from __future__ import annotations

import torch

from megatron_fastpath.packed_seq.metadata import split_record

__all__ = ["build_record_from_lengths"]


@torch.no_grad()
def build_record_from_lengths(lengths_S: torch.Tensor, record_R: torch.Tensor, max_tokens: int,
                              max_seqs: int, max_seqlen_bound: int) -> None:
    """Write the record of the batch whose sequence lengths are ``lengths_S`` (int32 [S]: the
    N real lengths, then zeros) into ``record_R`` in place (its cu_seqlens / position / sequence
    id views, as :func:`split_record` splits it)."""
    t, s, m = max_tokens, max_seqs, max_seqlen_bound
    cu_C, pos_T, sid_T = split_record(record_R, t, s, m)
    c = cu_C.shape[0]
    dev = record_R.device
    cum_S = torch.cumsum(lengths_S.to(torch.int64), 0)  # cum_S[j] = first token after sequence j
    cum_ext = torch.cat([cum_S.new_zeros(1), cum_S])  # [S + 1]: 0, c1, ..., cS
    total_0 = cum_S[-1]
    n_0 = (lengths_S > 0).sum()
    j_C = torch.arange(c, device=dev)
    # entries 0..N: the real boundaries; then the padding tail closed every M tokens up to T,
    # then edge-padded with T (host: np.arange(total + M, T, M), then T)
    tail_C = torch.clamp(total_0 + (j_C - n_0) * m, max=t)
    cu_C.copy_(torch.where(j_C <= n_0, cum_ext[j_C.clamp(max=s)], tail_C))
    t_T = torch.arange(t, device=dev)
    seq_T = torch.searchsorted(cum_S, t_T, right=True)  # sequences ending at or before t
    real_T = t_T < total_0
    sid_T.copy_(torch.where(real_T, seq_T, -1))
    pos_T.copy_(torch.where(real_T, t_T - cum_ext[seq_T.clamp(max=s)], 0))
