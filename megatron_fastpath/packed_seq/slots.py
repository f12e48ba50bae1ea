"""A cache slot: the static device buffers of one in-flight microbatch.

A slot holds the flat boundary record (``record_R``, filled by ONE non-blocking copy from its
pinned staging twin ``staging_R``), the views of that record its params expose (cu_seqlens,
positions, sequence ids; with context parallelism the CP layout's fields too; with adapters the
adapter section's, after the boundaries) and the params
object every layer of the slot's batch reads. The derived kinds
(:mod:`megatron_fastpath.packed_seq.derived`) add their fields to ``params`` when registered.
A slot stays ``busy`` from the batch's load until its release, so a batch's buffers are never
overwritten while its backward may still read them.

Shape letters: T = ``max_tokens`` (T_l = T / CP with context parallelism), S = ``max_seqs``,
C = entries of cu_seqlens, K = keys all-gathered over the CP group (T), R = the flat record.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fastpath.compat.graphs import separate_graph_inputs
from megatron_fastpath.packed_seq.adapters import adapter_record_size, split_adapter_record
from megatron_fastpath.packed_seq.config import PackedSeqConfig
from megatron_fastpath.packed_seq.context_parallel import cp_record_size, split_cp_record
from megatron_fastpath.packed_seq.metadata import HostPackedMetadata, record_size, split_record
from megatron_fastpath.packed_seq.params import CachedPackedSeqParams

__all__ = ["ADAPTER_FIELDS", "Slot"]

# The params fields of the record's adapter section, in its order (packed_seq/adapters.py).
ADAPTER_FIELDS = ("adapter_ids_T", "adapter_order_T", "adapter_inverse_T", "adapter_offsets_K",
                  "adapter_tokens_K")


class Slot:
    """Static device buffers of one in-flight microbatch."""

    def __init__(self, index: int, cfg: PackedSeqConfig, device: torch.device):
        self.index = index
        self.busy = False
        self.version = -1
        bound, cp = cfg.max_seqlen_bound, cfg.context_parallel_size
        n = (record_size(cfg.max_tokens, cfg.max_seqs, bound) if cp == 1
             else cp_record_size(cfg.max_tokens, cfg.max_seqs, bound, cp))
        k = cfg.num_adapters
        n_adapters = 0 if k is None else adapter_record_size(cfg.max_tokens, k)
        self.record_R = torch.zeros(n + n_adapters, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.staging_R = torch.zeros(n + n_adapters, dtype=torch.int32, pin_memory=pin)
        self.copy_done = torch.cuda.Event() if device.type == "cuda" else None
        fields = {}
        if k is not None:  # the adapter section after the boundaries (CP 1 only: the config)
            fields = dict(zip(ADAPTER_FIELDS, separate_graph_inputs(
                split_adapter_record(self.record_R[n:], cfg.max_tokens, k))))
        if cp == 1:
            cu_C, pos_T, sid_T = separate_graph_inputs(
                split_record(self.record_R[:n], cfg.max_tokens, cfg.max_seqs, bound))
        else:
            cu_C, pos_T, sid_T, tok_T, kv_pos_K, kv_sid_K, cu_local_C = separate_graph_inputs(
                split_cp_record(self.record_R, cfg.max_tokens, cfg.max_seqs, bound, cp))
            fields = dict(
                cp_token_index_T=torch.zeros(cfg.local_tokens, dtype=torch.int64, device=device),
                cp_kv_position_ids_K=kv_pos_K, cp_kv_seq_ids_K=kv_sid_K,
                cp_cu_seqlens_local_C=cu_local_C)
            self.token_index_i32_T = tok_T
        self.position_ids_1T = pos_T.view(1, -1)
        # cu_seqlens_*_padded stay None: the tail is closed at T, so they would equal
        # cu_seqlens, and TE compares the two with a host-syncing torch.equal when given.
        self.params = CachedPackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_C,
            cu_seqlens_kv=cu_C,
            max_seqlen_q=bound,
            max_seqlen_kv=bound,
            cp_group=None,
            position_ids_T=pos_T,
            seq_ids_T=sid_T,
            real_token_mask_T=torch.zeros(cfg.local_tokens, dtype=torch.bool, device=device),
            **fields,
        )
        self.padding_mask_1T = torch.zeros((1, cfg.local_tokens), dtype=torch.bool, device=device)
        self.pad_gather_ext: Optional[torch.Tensor] = None  # [S * M + 1]: the padded view's gather
        self.host: Optional[HostPackedMetadata] = None

