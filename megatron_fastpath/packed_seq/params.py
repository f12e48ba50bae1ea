"""What a layer reads: :class:`CachedPackedSeqParams`, the ``packed_seq_params`` of a packed
batch, and :class:`PackedBatch`, the handle the caller passes to the model.

A slot's params is a dataclass subclass of Megatron's ``PackedSeqParams`` whose tensor fields
*are* the slot's static buffers (same ``data_ptr``, shapes and ``max_seqlen_*`` ints on every
step). Attention reads everything per batch from the params it is given, never from the cache
by identity or from a "current" batch. That is what Megatron's ``CudaGraphManager`` needs: it
rebuilds dataclass kwargs field by field (``dataclasses.replace``) into graph input buffers at
capture and copies every tensor field into them at replay, so one runner per layer serves every
microbatch whatever slot the microbatch was loaded into. It is also what activation recompute
needs: a layer re-run in backward gets the same params object its forward got.

The flex ``BlockMask`` rides in the params as its eight index tensors (``flex_*``);
:func:`block_mask_from` reassembles it without a copy.

Shape letters: T = ``max_tokens`` (T_l = T / CP with context parallelism), S = ``max_seqs``,
M = ``max_seqlen``, C = entries of cu_seqlens (S + 1 + the closed tail), D = rotary dim,
K = keys all-gathered over the CP group (T), Q / K in ``flex_*`` = flex query / key blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = [
    "CachedPackedSeqParams",
    "FLEX_BLOCK",
    "FLEX_FIELDS",
    "PackedBatch",
    "block_mask_from",
    "packed_causal_mask_mod",
]

# The flex BlockMask fields, in BlockMask's constructor order; Q / K blocks of FLEX_BLOCK tokens.
FLEX_BLOCK = 128
FLEX_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)


@dataclasses.dataclass
class CachedPackedSeqParams(PackedSeqParams):
    """Megatron ``PackedSeqParams`` (thd) carrying everything a layer derives from the batch.

    Every field is a tensor, an int, a str or None (what ``CudaGraphManager`` accepts); the
    tensors are the cache slot's static buffers. Fields a backend does not use stay None (a
    graph copies every tensor field at replay, so nothing unused is carried).

    position_ids_T: [T] int32, position inside its sequence (0 on padding).
    seq_ids_T: [T] int32, sequence index of each token, -1 on padding.
    real_token_mask_T: [T] bool, True on real tokens, False on the padding tail (for the MoE
        router and losses; static shape, no host read).
    rope_cos_T1D / rope_sin_T1D: [T, 1, D] per-token RoPE factors in the compute dtype.
    rope_freqs_T11D: [T, 1, 1, D] float32 angles for Transformer Engine's fused RoPE.
    rope_local_cos_T1D / rope_local_sin_T1D: the same factors of ``PackedSeqConfig.rope_local``.
    sdpa_mask_TT: [T, T] additive mask in the compute dtype: 0 where token i may attend j
        (same sequence, j <= i; a padding token attends itself), -inf elsewhere.
    flex_*: the ``BlockMask`` index tensors ([1, 1, Q] / [1, 1, Q, K] int32) of the same mask.
    sdpa_mask_window_TT / flex_window_*: the same masks of sliding-window layers (window W, the
        cache's :attr:`PackedSeqCache.window`): key j of query i also needs
        ``pos(i) - pos(j) < W`` (transformers' ``kv_idx > q_idx - W``).
    pad_gather_SM: [S, M] int64, the packed-to-padded view: row s holds sequence s's tokens
        (their index in [0, T)) left-aligned; cells past a sequence's end and rows past the
        batch's sequences hold 0 (every index is in [0, T): the reader gathers without
        appending a row; an empty cell sits after every real one of its row, so under
        causality no real query attends it, and its output is dropped).
    pad_scatter_T: [T] int64, back again: the flat cell s * M + position of each token, in
        [0, S * M); 0 for padding tokens (the reader zeroes them with ``real_token_mask_T``).

    With context parallelism (``PackedSeqConfig.context_parallel_size`` = CP > 1; see
    :mod:`megatron_fastpath.packed_seq.context_parallel`) the token fields above hold this rank's
    T_l = T / CP tokens (positions are global positions inside their sequence), ``cu_seqlens_q/kv``
    are the global boundaries of the sequences padded to 2 x CP, and:
    cp_token_index_T: [T_l] int64, each local token's index in the caller's packed [T] buffers;
        T (an appended pad row) for a sequence's padding and the tail.
    cp_kv_position_ids_K / cp_kv_seq_ids_K: [T] int32 of the keys all-gathered over the CP group.
    cp_cu_seqlens_local_C: [C] int32, the local boundaries (global / CP).
    The ``sdpa_mask_TT`` is then [T_l, T]: local queries against the gathered keys.

    With adapters (``PackedSeqConfig.num_adapters`` = K; built on the host with the boundaries,
    :mod:`megatron_fastpath.packed_seq.adapters`), int32:
    adapter_ids_T: [T] the adapter of each token, K on the padding tail.
    adapter_order_T / adapter_inverse_T: [T] the tokens sorted by adapter (tail last) and back.
    adapter_offsets_K: [K] group ends of the sorted tokens (the last one T).
    adapter_tokens_K: [K] real tokens of each adapter.
    """

    position_ids_T: Optional[torch.Tensor] = None
    seq_ids_T: Optional[torch.Tensor] = None
    real_token_mask_T: Optional[torch.Tensor] = None
    rope_cos_T1D: Optional[torch.Tensor] = None
    rope_sin_T1D: Optional[torch.Tensor] = None
    rope_freqs_T11D: Optional[torch.Tensor] = None
    rope_local_cos_T1D: Optional[torch.Tensor] = None
    rope_local_sin_T1D: Optional[torch.Tensor] = None
    sdpa_mask_TT: Optional[torch.Tensor] = None
    flex_kv_num_blocks: Optional[torch.Tensor] = None
    flex_kv_indices: Optional[torch.Tensor] = None
    flex_full_kv_num_blocks: Optional[torch.Tensor] = None
    flex_full_kv_indices: Optional[torch.Tensor] = None
    flex_q_num_blocks: Optional[torch.Tensor] = None
    flex_q_indices: Optional[torch.Tensor] = None
    flex_full_q_num_blocks: Optional[torch.Tensor] = None
    flex_full_q_indices: Optional[torch.Tensor] = None
    sdpa_mask_window_TT: Optional[torch.Tensor] = None
    flex_window_kv_num_blocks: Optional[torch.Tensor] = None
    flex_window_kv_indices: Optional[torch.Tensor] = None
    flex_window_full_kv_num_blocks: Optional[torch.Tensor] = None
    flex_window_full_kv_indices: Optional[torch.Tensor] = None
    flex_window_q_num_blocks: Optional[torch.Tensor] = None
    flex_window_q_indices: Optional[torch.Tensor] = None
    flex_window_full_q_num_blocks: Optional[torch.Tensor] = None
    flex_window_full_q_indices: Optional[torch.Tensor] = None
    pad_gather_SM: Optional[torch.Tensor] = None
    pad_scatter_T: Optional[torch.Tensor] = None
    cp_token_index_T: Optional[torch.Tensor] = None
    cp_kv_position_ids_K: Optional[torch.Tensor] = None
    cp_kv_seq_ids_K: Optional[torch.Tensor] = None
    cp_cu_seqlens_local_C: Optional[torch.Tensor] = None
    adapter_ids_T: Optional[torch.Tensor] = None
    adapter_order_T: Optional[torch.Tensor] = None
    adapter_inverse_T: Optional[torch.Tensor] = None
    adapter_offsets_K: Optional[torch.Tensor] = None
    adapter_tokens_K: Optional[torch.Tensor] = None

    def tensors(self) -> dict:
        """Name -> tensor of every tensor field (what a graph copies at replay)."""
        return {f.name: v for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)}


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Handle of one packed microbatch held by a cache slot (valid until released).

    packed_seq_params: the slot's :class:`CachedPackedSeqParams` -- pass it to the model.
    position_ids_1T: [1, T] per-token positions (reset per sequence) -- the model's position_ids.
    padding_mask_1T: [1, T] bool, True on the padding tail (``~params.real_token_mask_T``): the
        layout and convention of Megatron's ``GPTModel.forward(padding_mask=...)``, which hands it
        to ``MoELayer`` routing (``routing_map & ~padding_mask``); a static buffer of the slot,
        built with the batch, so a CUDA-graph replay copies it as a layer input.
    num_seqs / num_tokens / max_seqlen / lengths_N: host values of the real batch.
    adapters_N / adapter_tokens_K: with adapters, each sequence's adapter and each adapter's
        real tokens (host int64 arrays); None without.
    """

    slot: int
    version: int
    packed_seq_params: CachedPackedSeqParams
    position_ids_1T: torch.Tensor
    padding_mask_1T: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    lengths_N: np.ndarray
    adapters_N: Optional[np.ndarray] = None
    adapter_tokens_K: Optional[np.ndarray] = None


def packed_causal_mask_mod(seq_ids_T: torch.Tensor, window: Optional[int] = None):
    """flex ``mask_mod``: same sequence and causal (with ``window`` W: and fewer than W tokens
    back -- inside a sequence, index differences are position differences); a padding token
    (id -1) attends itself."""

    def mask_mod(b, h, q_idx, kv_idx):
        sq = seq_ids_T[q_idx]
        same = (sq == seq_ids_T[kv_idx]) & (sq >= 0)
        return (same & (q_idx >= kv_idx)) | (q_idx == kv_idx)

    def window_mask_mod(b, h, q_idx, kv_idx):
        sq = seq_ids_T[q_idx]
        same = (sq == seq_ids_T[kv_idx]) & (sq >= 0)
        return (same & (q_idx >= kv_idx) & (q_idx - kv_idx < window)) | (q_idx == kv_idx)

    return mask_mod if window is None else window_mask_mod


def block_mask_from(params: CachedPackedSeqParams, window: Optional[int] = None):
    """A ``BlockMask`` over the params' flex fields (no copy, no new index tensors); with
    ``window``: over the windowed ones (``flex_window_*``, built for that window)."""
    from torch.nn.attention.flex_attention import BlockMask

    t = params.seq_ids_T.shape[0]
    # One mask_mod per params object and window (kept on it, not a field): a compiled
    # flex_attention then sees the same callable at every layer instead of a new closure per call.
    key = "_flex_mask_mod" if window is None else f"_flex_mask_mod_w{window}"
    memo = params.__dict__.get(key)
    if memo is None or memo[0] is not params.seq_ids_T:
        memo = params.__dict__[key] = (
            params.seq_ids_T, packed_causal_mask_mod(params.seq_ids_T, window))
    mask_mod = memo[1]
    prefix = "flex_" if window is None else "flex_window_"
    return BlockMask(
        (t, t),
        *(getattr(params, f"{prefix}{name}") for name in FLEX_FIELDS),
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=mask_mod,
    )
