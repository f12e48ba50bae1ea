"""The derived kinds: the tensors a consumer registers with the cache (:data:`DERIVED_KINDS`,
the one list) and how each is allocated into a slot's params and built for its batch.

A kind is data: an ``allocate`` (create its static fields in a slot's params, once, at
register) and a ``build`` (write them for the slot's current batch, once per batch, on the
device: static-shape ops, no host read) plus what it needs of the config. What a kind reads of
the cache is :class:`CacheView`. The kinds:

* ``real_mask``: ``real_token_mask_T`` (every slot has it; registering it counts its builds);
* ``rope_cos_sin`` / ``rope_cos_sin_local``: per-token RoPE ``rope_cos_T1D`` / ``rope_sin_T1D``
  (of ``PackedSeqConfig.rope`` / ``rope_local``) in the compute dtype; ``rope_freqs``: TE's
  ``rope_freqs_T11D`` angles (settings and math in :mod:`megatron_fastpath.packed_seq.rope`);
* ``sdpa_mask``: ONE additive mask ``sdpa_mask_TT`` (0 / -inf) in the compute dtype, shared by
  all layers (SDPA saves it once per step and converts nothing);
* ``sdpa_padded``: the packed-to-padded view's index pair ``pad_gather_SM`` / ``pad_scatter_T``;
* ``flex_block_mask``: the ``flex_attention`` BlockMask as eight index tensors ``flex_*``;
* ``sdpa_mask_window`` / ``flex_block_mask_window``: for sliding-window layers (one window per
  cache, :attr:`CacheView.window`) the same two masks restricted to the last W keys of each
  query, ``sdpa_mask_window_TT`` and ``flex_window_*``; built once per batch whatever the number
  of windowed layers.

Shape letters: T = ``max_tokens`` (T_l = T / CP with context parallelism), S = ``max_seqs``,
M = ``max_seqlen``, D = rotary dim, K = keys all-gathered over the CP group (T).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol

import torch

from megatron_fastpath.packed_seq.config import PackedSeqConfig
from megatron_fastpath.packed_seq.params import FLEX_BLOCK, FLEX_FIELDS, packed_causal_mask_mod
from megatron_fastpath.packed_seq.slots import Slot

__all__ = ["CacheView", "DERIVED_KINDS", "DerivedKind", "check_sdpa_mask_size", "derived_kind"]


class CacheView(Protocol):
    """What a kind's ``allocate`` / ``build`` reads of the cache (a :class:`PackedSeqCache`)."""

    config: PackedSeqConfig
    device: torch.device
    window: Optional[int]  # the sliding window of the windowed kinds (None: none registered)
    inv_freq: Optional[torch.Tensor]  # [F] of config.rope (F = D / 2 rotary frequencies)
    inv_freq_local: Optional[torch.Tensor]  # [F] of config.rope_local

    def arange_T(self) -> torch.Tensor:
        """The one shared [T] int32 arange the mask builders use (built on first use)."""


# real_mask: real_token_mask_T is a field of every slot, built for every batch by
# the cache for every batch (MoE routers read it too); registering it only counts its builds.
def _allocate_real_mask(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    pass


def _build_real_mask(cache: CacheView, slot: Slot) -> None:
    pass


def _zeros_T1D(cache: CacheView, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((cache.config.local_tokens, 1, dim), dtype=dtype, device=cache.device)


def _fill_cos_sin(rope, inv_freq, position_ids_T, cos_T1D, sin_T1D) -> None:
    """cos / sin of ``rope``'s angles at the packed positions into the static buffers."""
    emb_TD = rope.angles_TD(position_ids_T, inv_freq)
    cos_T1D.copy_(torch.cos(emb_TD).unsqueeze(1))
    sin_T1D.copy_(torch.sin(emb_TD).unsqueeze(1))


def _allocate_rope_cos_sin(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    slot.params.rope_cos_T1D = _zeros_T1D(cache, cache.config.rope.dim, dtype)
    slot.params.rope_sin_T1D = _zeros_T1D(cache, cache.config.rope.dim, dtype)


def _build_rope_cos_sin(cache: CacheView, slot: Slot) -> None:
    p = slot.params
    _fill_cos_sin(cache.config.rope, cache.inv_freq, p.position_ids_T, p.rope_cos_T1D, p.rope_sin_T1D)


def _allocate_rope_cos_sin_local(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    slot.params.rope_local_cos_T1D = _zeros_T1D(cache, cache.config.rope_local.dim, dtype)
    slot.params.rope_local_sin_T1D = _zeros_T1D(cache, cache.config.rope_local.dim, dtype)


def _build_rope_cos_sin_local(cache: CacheView, slot: Slot) -> None:
    p = slot.params
    _fill_cos_sin(cache.config.rope_local, cache.inv_freq_local, p.position_ids_T,
                  p.rope_local_cos_T1D, p.rope_local_sin_T1D)


def _allocate_rope_freqs(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    t, d = cache.config.local_tokens, cache.config.rope.dim
    slot.params.rope_freqs_T11D = torch.zeros((t, 1, 1, d), device=cache.device)


def _build_rope_freqs(cache: CacheView, slot: Slot) -> None:
    """[T, 1, 1, D] float32 angles: the ``freqs`` of TE's fused RoPE in ``sbhd`` layout
    (one "sequence position" per packed token, so no cu_seqlens are needed)."""
    emb_TD = cache.config.rope.angles_TD(slot.params.position_ids_T, cache.inv_freq)
    slot.params.rope_freqs_T11D.copy_(emb_TD[:, None, None, :])


def check_sdpa_mask_size(config: PackedSeqConfig) -> None:
    """Refuse a dense [T, T] mask above ``sdpa_mask_max_tokens``, naming the alternatives."""
    t, c = config.max_tokens, config
    if t > c.sdpa_mask_max_tokens:
        padded = ("context parallelism attends through it" if c.context_parallel_size > 1
                  else "sdpa_layout='padded' or 'auto' (the packed-to-padded view, no mask)")
        raise ValueError(
            f"the SDPA backend's mask layout needs a {t}x{t} mask ({t * t / 2**20:.0f} Mi "
            f"elements) per slot, above the limit sdpa_mask_max_tokens={c.sdpa_mask_max_tokens};"
            f" use the 'flex', 'flash' or 'te' backend (no dense mask), {padded}, or raise the limit"
        )


def _allocate_sdpa_mask(cache: CacheView, slot: Slot, dtype: torch.dtype,
                        field: str = "sdpa_mask_TT") -> None:
    t = cache.config.max_tokens
    setattr(slot.params, field, torch.zeros((cache.config.local_tokens, t), dtype=dtype,
                                            device=cache.device))


def _allocate_sdpa_mask_window(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    _allocate_sdpa_mask(cache, slot, dtype, "sdpa_mask_window_TT")


def _build_sdpa_mask(cache: CacheView, slot: Slot, window: Optional[int] = None) -> None:
    """mask[i, j] = 0 if start(i) <= j <= i else -inf, with start(i) = i - position(i) the
    first token of i's sequence. Sequences are contiguous, so this is "same sequence and
    causal"; a padding token has position 0, so its row is the diagonal alone (no fully
    masked row). Written in place into the slot's [T, T] buffer in the compute dtype: no
    causal constant is held, and SDPA gets a mask it uses as is (no per-layer conversion).
    With ``window`` W (into ``sdpa_mask_window_TT``) also j > i - W: inside a sequence the
    position difference is the index difference, so this is transformers' window."""
    p = slot.params
    arange_T = cache.arange_T()
    out_TT = p.sdpa_mask_TT if window is None else p.sdpa_mask_window_TT
    if p.cp_kv_seq_ids_K is not None:
        return _build_sdpa_mask_cp(cache, slot, out_TT, window)
    j_1T, i_T1 = arange_T.unsqueeze(0), arange_T.unsqueeze(1)
    outside_TT = torch.lt(j_1T, i_T1 - p.position_ids_T.unsqueeze(1))  # before its sequence
    outside_TT.logical_or_(torch.gt(j_1T, i_T1))  # after the query: causal
    if window is not None:  # W or more tokens back: outside the window
        outside_TT.logical_or_(torch.le(j_1T, i_T1 - window))
    out_TT.zero_().masked_fill_(outside_TT, float("-inf"))


def _build_sdpa_mask_window(cache: CacheView, slot: Slot) -> None:
    _build_sdpa_mask(cache, slot, cache.window)


def _build_sdpa_mask_cp(cache: CacheView, slot: Slot, out_TK: torch.Tensor,
                        window: Optional[int]) -> None:
    """CP: local query i (gathered index rank * T_l + i) may attend gathered key j when both
    are in the same sequence and j's global position is <= i's (and, with ``window`` W,
    > i's - W); a tail token attends itself."""
    p, tl = slot.params, cache.config.local_tokens
    sid_T1, pos_T1 = p.seq_ids_T.unsqueeze(1), p.position_ids_T.unsqueeze(1)
    kv_pos_1K = p.cp_kv_position_ids_K.unsqueeze(0)
    allowed_TK = torch.eq(sid_T1, p.cp_kv_seq_ids_K.unsqueeze(0))
    allowed_TK.logical_and_(torch.ge(sid_T1, 0))
    allowed_TK.logical_and_(torch.le(kv_pos_1K, pos_T1))
    if window is not None:
        allowed_TK.logical_and_(torch.gt(kv_pos_1K, pos_T1 - window))
    arange_T = cache.arange_T()
    own_T1 = arange_T[:tl].unsqueeze(1) + cache.config.context_parallel_rank * tl
    allowed_TK.logical_or_(torch.eq(arange_T.unsqueeze(0), own_T1))
    out_TK.zero_().masked_fill_(allowed_TK.logical_not_(), float("-inf"))


def _allocate_sdpa_padded(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    t, rows, m = cache.config.max_tokens, cache.config.max_seqs, cache.config.max_seqlen_bound
    slot.pad_gather_ext = torch.zeros((rows * m + 1,), dtype=torch.int64, device=cache.device)
    slot.params.pad_gather_SM = slot.pad_gather_ext[: rows * m].view(rows, m)
    slot.params.pad_scatter_T = torch.zeros((t,), dtype=torch.int64, device=cache.device)


def _build_sdpa_padded(cache: CacheView, slot: Slot) -> None:
    """The packed-to-padded index pair, from the slot's sequence ids and positions on the
    device (no host read): token t of sequence s at position i sits in cell s * M + i;
    every other cell gathers token 0, every padding token scatters from cell 0 -- indices
    that never point past the tensors they index, so the reader appends no zero row (the
    gather buffer's extra last cell only absorbs the padding tokens' writes here)."""
    p = slot.params
    s_rows, m = p.pad_gather_SM.shape
    seq_T = p.seq_ids_T.to(torch.int64)
    real_T = seq_T >= 0
    cell_T = torch.where(real_T, seq_T * m + p.position_ids_T.to(torch.int64), s_rows * m)
    slot.pad_gather_ext.zero_().scatter_(0, cell_T, cache.arange_T().to(torch.int64))
    p.pad_scatter_T.copy_(cell_T).masked_fill_(real_T.logical_not_(), 0)


def _allocate_flex_block_mask(cache: CacheView, slot: Slot, dtype: torch.dtype,
                              prefix: str = "flex_") -> None:
    nb = -(-cache.config.max_tokens // FLEX_BLOCK)
    for name in FLEX_FIELDS:
        shape = (1, 1, nb) if name.endswith("num_blocks") else (1, 1, nb, nb)
        setattr(slot.params, f"{prefix}{name}", torch.zeros(shape, dtype=torch.int32, device=cache.device))


def _build_flex_block_mask(cache: CacheView, slot: Slot,
                           window: Optional[int] = None) -> None:
    """The BlockMask of the same mask, copied into the slot's static index tensors
    (``create_block_mask`` allocates fresh ones; a graph replay needs fixed addresses)."""
    from torch.nn.attention.flex_attention import create_block_mask

    t = cache.config.max_tokens
    fresh = create_block_mask(packed_causal_mask_mod(slot.params.seq_ids_T, window), None, None,
                              t, t, device=cache.device, BLOCK_SIZE=FLEX_BLOCK)
    prefix = "flex_" if window is None else "flex_window_"
    for name in FLEX_FIELDS:
        getattr(slot.params, f"{prefix}{name}").copy_(getattr(fresh, name))


def _allocate_flex_block_mask_window(cache: CacheView, slot: Slot, dtype: torch.dtype) -> None:
    _allocate_flex_block_mask(cache, slot, dtype, "flex_window_")


def _build_flex_block_mask_window(cache: CacheView, slot: Slot) -> None:
    _build_flex_block_mask(cache, slot, cache.window)


@dataclasses.dataclass(frozen=True)
class DerivedKind:
    """One kind of derived tensors a consumer can :meth:`PackedSeqCache.register`.

    allocate(cache, slot, dtype): create the kind's static fields in a slot's params (once).
    build(cache, slot): write them for the slot's current batch (once per batch).
    compute_dtype: built in the consumer's dtype (else float32).
    needs_rope: needs ``PackedSeqConfig.rope``.
    needs_rope_local: needs ``PackedSeqConfig.rope_local`` (the second RoPE).
    dense_mask: a [T, T] mask per slot (refused above ``sdpa_mask_max_tokens``).
    windowed: built for the cache's sliding :attr:`CacheView.window` (given at register).
    """

    allocate: Callable[[CacheView, Slot, torch.dtype], None]
    build: Callable[[CacheView, Slot], None]
    compute_dtype: bool = False
    needs_rope: bool = False
    needs_rope_local: bool = False
    dense_mask: bool = False
    windowed: bool = False


# Every derived kind of the cache: the one list a consumer registers from.
DERIVED_KINDS: dict[str, DerivedKind] = {
    "real_mask": DerivedKind(_allocate_real_mask, _build_real_mask),
    "rope_cos_sin": DerivedKind(_allocate_rope_cos_sin, _build_rope_cos_sin, compute_dtype=True,
                                needs_rope=True),
    "rope_freqs": DerivedKind(_allocate_rope_freqs, _build_rope_freqs, needs_rope=True),
    "rope_cos_sin_local": DerivedKind(_allocate_rope_cos_sin_local, _build_rope_cos_sin_local,
                                      compute_dtype=True, needs_rope=True, needs_rope_local=True),
    "sdpa_mask": DerivedKind(_allocate_sdpa_mask, _build_sdpa_mask, compute_dtype=True,
                             dense_mask=True),
    "sdpa_padded": DerivedKind(_allocate_sdpa_padded, _build_sdpa_padded),
    "flex_block_mask": DerivedKind(_allocate_flex_block_mask, _build_flex_block_mask),
    "sdpa_mask_window": DerivedKind(_allocate_sdpa_mask_window, _build_sdpa_mask_window,
                                    compute_dtype=True, dense_mask=True, windowed=True),
    "flex_block_mask_window": DerivedKind(_allocate_flex_block_mask_window,
                                          _build_flex_block_mask_window, windowed=True),
}


def derived_kind(kind: str) -> DerivedKind:
    """The registry entry of ``kind``; an unknown kind is refused with the known ones."""
    spec = DERIVED_KINDS.get(kind)
    if spec is None:
        raise ValueError(
            f"unknown derived kind {kind!r}: the cache builds only its registered kinds; "
            f"register one of the known kinds {list(DERIVED_KINDS)}")
    return spec
