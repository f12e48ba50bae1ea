"""PackedSeqCache: a packed batch's boundary metadata and everything derived from it, built
once per batch into static buffers and carried to every layer in the ``packed_seq_params``.

Every transformer layer of a packed batch consumes the same B = {cu_seqlens, max_seqlen,
positions, masks, RoPE}. The cache derives the boundaries on the host (``metadata.py``), moves
them with ONE non-blocking copy from a pinned staging buffer into fixed-capacity device buffers,
builds the derived tensors there (static-shape ops, no host reads) and hands every layer one
:class:`CachedPackedSeqParams` -- a dataclass subclass of Megatron's ``PackedSeqParams`` whose
tensor fields *are* the slot's static buffers (same ``data_ptr``, shapes and ``max_seqlen_*``
ints on every step):

* ``cu_seqlens_q/kv``: boundaries with the padding tail closed at T (no ``*_padded``);
* ``position_ids_T``, ``seq_ids_T``, ``real_token_mask_T`` (True on real tokens);
* per-token RoPE ``rope_cos_T1D`` / ``rope_sin_T1D`` (or TE's ``rope_freqs_T11D``; settings and
  math in :mod:`megatron_fastpath.packed_seq.rope`);
* the SDPA mask ``sdpa_mask_TT``: ONE additive mask (0 / -inf) in the compute dtype, shared by
  all layers (SDPA saves it once per step and converts nothing);
* the ``flex_attention`` BlockMask as eight index tensors ``flex_*``;
* for sliding-window layers (``PackedCoreAttention(sliding_window=W)``; one window per cache)
  the same two masks restricted to the last W keys of each query: ``sdpa_mask_window_TT`` and
  ``flex_window_*`` (kinds ``sdpa_mask_window`` / ``flex_block_mask_window``, built only when a
  layer registers them, once per batch whatever the number of windowed layers).

Attention reads all of it from the params it is given, never from the cache by identity or from
a "current" batch. That is what Megatron's ``CudaGraphManager`` needs: it rebuilds dataclass
kwargs field by field (``dataclasses.replace``) into graph input buffers at capture and copies
every tensor field into them at replay, so one runner per layer serves every microbatch whatever
slot the microbatch was loaded into. It is also what activation recompute needs: a layer re-run
in backward gets the same params object its forward got.

Several microbatches can be in flight (pipeline 1F1B runs forward of m+1 before backward of m):
the cache owns ``num_slots`` independent slots; a slot stays reserved from ``set_batch`` until
``release`` (or the end of the ``batch()`` context), so a batch's buffers are never overwritten
while its backward may still read them. Staleness is impossible by construction: nothing is
keyed on object identity of the caller's data -- every ``set_batch`` re-derives B from the values
it is given.

Shape letters: T = ``max_tokens``, S = ``max_seqs``, C = entries of cu_seqlens (S + 1 + the
closed tail), D = rotary dim, F = D / 2 rotary frequencies, Q / K = flex query / key blocks,
R = the flat metadata record.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_fastpath.compat.graphs import separate_graph_inputs
from megatron_fastpath.packed_seq.context_parallel import (
    build_cp_host_metadata,
    cp_record_size,
    split_cp_record,
)
from megatron_fastpath.packed_seq.metadata import (
    HostPackedMetadata,
    LengthsLike,
    build_host_metadata,
    record_size,
    resolve_lengths,
    split_record,
)
from megatron_fastpath.packed_seq.rope import RopeConfig

__all__ = [
    "CacheStats",
    "CachedPackedSeqParams",
    "DERIVED_KINDS",
    "DerivedKind",
    "PackedBatch",
    "PackedSeqCache",
    "PackedSeqConfig",
    "sdpa_max_tokens",
    "seqlen_bound",
]

# The SDPA mask costs T^2 x (2 or 4) bytes per slot; above this many tokens it is refused (the
# sdpa backend then attends through the padded view, which has no mask: sdpa_max_tokens).
DEFAULT_SDPA_MASK_MAX_TOKENS = 16384
SDPA_LAYOUTS = ("auto", "mask", "padded")
# sdpa_layout=auto takes the padded view when it computes this many times fewer scores than the
# [T, T] mask: its gathers and scatter cost more than the saved scores below that. Measured on
# CPU: one layer fwd+bwd (benchmarks/results/attention_layout.json) 2.7x fewer scores (T 512,
# 6 sequences) -> the mask 1.9x faster, 21x fewer (T 4096, 48) -> the padded view 7.9x faster;
# a whole training step (benchmarks/results/end_to_end*.json, long-tail lengths): 1.0x and 1.14x
# fewer (T 512 / 2048) -> the mask faster (48.5 vs 60.8 ms, 256 vs 343 ms); 3.5x and 3.8x fewer
# (T 8192 / 16384) -> the padded view, ahead of every peer by 1.6x / 2.2x. 3 separates them.
PADDED_VIEW_MIN_SAVING = 3
SEQLEN_BUCKET = 64  # a data-derived max_seqlen is the longest sequence rounded up to this


def sdpa_max_tokens(sdpa_layout: str = "auto", mask_max_tokens: int = DEFAULT_SDPA_MASK_MAX_TOKENS,
                    context_parallel_size: int = 1) -> Optional[int]:
    """The most packed tokens the ``sdpa`` backend serves in ``sdpa_layout``; None = no limit.

    The one home of the rule (``resolve_backend``'s ``auto`` reads it through the parse, the
    layer spec and the attention): only the [T, T] mask has a size limit. It binds when the
    backend must attend through the mask -- ``sdpa_layout="mask"``, or any layout with context
    parallelism (the padded view is not built for CP). ``"padded"`` has no mask, and ``"auto"``
    takes the padded view whenever the mask would be over its limit
    (:attr:`PackedSeqConfig.sdpa_padded`), so neither has a limit."""
    if sdpa_layout == "mask" or context_parallel_size > 1:
        return mask_max_tokens
    return None


def seqlen_bound(longest: int, max_tokens: int) -> int:
    """The static ``max_seqlen`` for data whose longest sequence is ``longest`` tokens: rounded
    up to a multiple of :data:`SEQLEN_BUCKET`, at most ``max_tokens``. It sizes the sdpa
    backend's padded view (rows of this many tokens) and is the ``max_seqlen`` flash / TE get
    (their grids scale with it) instead of T."""
    if longest < 1:
        raise ValueError(f"the longest sequence must be >= 1 token; got {longest}")
    return min(max_tokens, -(-longest // SEQLEN_BUCKET) * SEQLEN_BUCKET)


@dataclasses.dataclass(frozen=True)
class PackedSeqConfig:
    """Static capacities of the cache.

    max_tokens: T, tokens per packed microbatch (the token dimension the model sees).
    max_seqs: S, sequences per packed microbatch.
    max_seqlen: constant bound reported as ``max_seqlen_q/kv`` (default T) -- constant so
        CUDA-graph argument matching holds across batches.
    num_slots: microbatches that may be in flight at once (>= pipeline stages for 1F1B). A slot
        only keeps an in-flight batch from being overwritten; which slot a microbatch gets does
        not matter to attention (it reads the params it is given; a CUDA-graph replay copies
        them into the graph's inputs).
    rope: rotary settings; None disables the RoPE structures.
    rope_local: a second RoPE of the layers that rotate with another base (Gemma 3's sliding
        layers: ``rope_local_base_freq``), the ``rope_cos_sin_local`` kind; None: none.
    sdpa_mask_max_tokens: refuse to build a T x T SDPA mask above this T.
    sdpa_layout: how the ``sdpa`` backend attends: "mask" (the packed [T] tokens against each
        other under one [T, T] additive mask: T^2 scores), "padded" (the packed-to-padded view,
        ``max_seqs`` rows of ``max_seqlen`` tokens, plain causal attention per row: S x M^2
        scores, no mask) or "auto" (:attr:`sdpa_padded`: the padded view when it computes at
        least :data:`PADDED_VIEW_MIN_SAVING` times fewer scores, 3 S M^2 < T^2 -- many short
        sequences -- or when T is above ``sdpa_mask_max_tokens``, where no mask is built; the
        mask when a few long ones fill T).
    """

    max_tokens: int
    max_seqs: int
    max_seqlen: Optional[int] = None
    num_slots: int = 1
    rope: Optional[RopeConfig] = None
    rope_local: Optional[RopeConfig] = None
    sdpa_mask_max_tokens: int = DEFAULT_SDPA_MASK_MAX_TOKENS
    sdpa_layout: str = "auto"
    context_parallel_size: int = 1
    context_parallel_rank: int = 0

    def __post_init__(self):
        from megatron_fastpath.rules import check_positive_ints

        check_positive_ints("PackedSeqConfig", self, ("max_tokens", "max_seqs", "num_slots"))
        if self.max_seqs > self.max_tokens:
            raise ValueError(
                f"max_seqs={self.max_seqs} > max_tokens={self.max_tokens}: every sequence has "
                "at least one token"
            )
        if self.max_seqlen is not None and not (0 < self.max_seqlen <= self.max_tokens):
            raise ValueError(
                f"max_seqlen must be in [1, max_tokens={self.max_tokens}]; got {self.max_seqlen}"
            )
        if self.sdpa_layout not in SDPA_LAYOUTS:
            raise ValueError(f"sdpa_layout must be one of {SDPA_LAYOUTS}; got {self.sdpa_layout!r}")
        cp = self.context_parallel_size
        if not isinstance(cp, int) or cp < 1 or not 0 <= self.context_parallel_rank < cp:
            raise ValueError(
                f"context_parallel_size={cp!r} / context_parallel_rank={self.context_parallel_rank!r}:"
                " the size must be an int >= 1 and the rank in [0, size)")
        if cp > 1:
            q = 2 * cp
            if self.max_tokens % q or self.max_seqlen_bound % q:
                raise ValueError(
                    f"context parallelism {cp} splits every packed piece into 2 x CP = {q} chunks:"
                    f" max_tokens={self.max_tokens} and max_seqlen={self.max_seqlen_bound} must be"
                    f" multiples of {q}; round them up to a multiple of {q}")
            if self.sdpa_layout == "padded":
                raise ValueError(
                    "sdpa_layout='padded' with context_parallel_size > 1: the padded view is not "
                    "built for the CP layout (its queries attend all-gathered keys through the "
                    "mask); use sdpa_layout='mask' or 'auto'")

    @property
    def max_seqlen_bound(self) -> int:
        return self.max_seqlen if self.max_seqlen is not None else self.max_tokens

    @property
    def local_tokens(self) -> int:
        """T_l: tokens of a packed microbatch on this CP rank (T without CP)."""
        return self.max_tokens // self.context_parallel_size

    @property
    def sdpa_padded(self) -> bool:
        """The ``sdpa`` backend uses the packed-to-padded view (see ``sdpa_layout``; never with
        context parallelism, whose queries attend the all-gathered keys through the mask)."""
        if self.context_parallel_size > 1:
            return False
        if self.sdpa_layout != "auto":
            return self.sdpa_layout == "padded"
        if self.max_tokens > self.sdpa_mask_max_tokens:  # the mask would be refused: sdpa_max_tokens
            return True
        return PADDED_VIEW_MIN_SAVING * self.max_seqs * self.max_seqlen_bound ** 2 < self.max_tokens ** 2

    @property
    def sdpa_max_tokens(self) -> Optional[int]:
        """:func:`sdpa_max_tokens` of this config (None: the sdpa backend has no token limit)."""
        return sdpa_max_tokens(self.sdpa_layout, self.sdpa_mask_max_tokens, self.context_parallel_size)


# The flex BlockMask fields, in BlockMask's constructor order; Q / K blocks of FLEX_BLOCK tokens.
FLEX_BLOCK = 128
_FLEX_FIELDS = (
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

    def tensors(self) -> dict:
        """Name -> tensor of every tensor field (what a graph copies at replay)."""
        return {f.name: v for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)}


@dataclasses.dataclass
class CacheStats:
    """Counters since construction; ``per_kind`` maps a derived kind -> builds (one per batch,
    whatever the number of layers reading it)."""

    batches: int = 0
    builds: int = 0
    host_to_device_copies: int = 0
    bytes_copied: int = 0
    per_kind: dict = dataclasses.field(default_factory=dict)

    def snapshot(self) -> "CacheStats":
        return dataclasses.replace(self, per_kind=dict(self.per_kind))

    def add(self, other: "CacheStats") -> None:
        """Add ``other``'s counters (a captured graph's builds, re-run by each replay)."""
        self.batches += other.batches
        self.builds += other.builds
        self.host_to_device_copies += other.host_to_device_copies
        self.bytes_copied += other.bytes_copied
        for k, v in other.per_kind.items():
            self.per_kind[k] = self.per_kind.get(k, 0) + v

    def since(self, before: "CacheStats") -> "CacheStats":
        """Counters accumulated after ``before`` (a snapshot)."""
        return CacheStats(
            batches=self.batches - before.batches,
            builds=self.builds - before.builds,
            host_to_device_copies=self.host_to_device_copies - before.host_to_device_copies,
            bytes_copied=self.bytes_copied - before.bytes_copied,
            per_kind={k: v - before.per_kind.get(k, 0) for k, v in self.per_kind.items()},
        )


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


class _Slot:
    """Static device buffers of one in-flight microbatch."""

    def __init__(self, index: int, cfg: PackedSeqConfig, device: torch.device):
        self.index = index
        self.busy = False
        self.version = -1
        bound, cp = cfg.max_seqlen_bound, cfg.context_parallel_size
        n = (record_size(cfg.max_tokens, cfg.max_seqs, bound) if cp == 1
             else cp_record_size(cfg.max_tokens, cfg.max_seqs, bound, cp))
        self.record_R = torch.zeros(n, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.staging_R = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.copy_done = torch.cuda.Event() if device.type == "cuda" else None
        cp_fields = {}
        if cp == 1:
            cu_C, pos_T, sid_T = separate_graph_inputs(
                split_record(self.record_R, cfg.max_tokens, cfg.max_seqs, bound))
        else:
            cu_C, pos_T, sid_T, tok_T, kv_pos_K, kv_sid_K, cu_local_C = separate_graph_inputs(
                split_cp_record(self.record_R, cfg.max_tokens, cfg.max_seqs, bound, cp))
            cp_fields = dict(
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
            **cp_fields,
        )
        self.padding_mask_1T = torch.zeros((1, cfg.local_tokens), dtype=torch.bool, device=device)
        self.pad_gather_ext: Optional[torch.Tensor] = None  # [S * M + 1]: the padded view's gather
        self.host: Optional[HostPackedMetadata] = None


class PackedSeqCache:
    """Per-device cache of packed-batch metadata in static (CUDA-graph capturable) buffers.

    Usage::

        cache = PackedSeqCache(PackedSeqConfig(max_tokens=2048, max_seqs=64,
                                               rope=RopeConfig(dim=128)), device)
        with cache.batch(lengths) as pb:                 # one H2D copy, no D2H sync
            loss = model(tokens_1T, pb.position_ids_1T, None,
                         packed_seq_params=pb.packed_seq_params, labels=labels_1T)
            loss.backward()

    Attention modules built by :func:`megatron_fastpath.get_fastpath_layer_spec` register the
    derived tensors they need at construction (:meth:`register`); ``set_batch`` builds them into
    the slot's fields, and the layers read them from the ``packed_seq_params`` they are given.
    """

    def __init__(self, config: PackedSeqConfig, device: Optional[torch.device] = None):
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slots = [_Slot(i, config, self.device) for i in range(config.num_slots)]
        self.stats = CacheStats()
        self._next_version = 0
        self._next_slot = 0
        self._last: Optional[_Slot] = None
        self._kinds: dict[str, torch.dtype] = {}  # registered derived kind -> compute dtype
        self.window: Optional[int] = None  # the sliding window of the windowed kinds
        self._arange_T: Optional[torch.Tensor] = None
        self._inv_freq = config.rope.inv_freq(self.device) if config.rope is not None else None
        self._inv_freq_local = (config.rope_local.inv_freq(self.device)
                                if config.rope_local is not None else None)

    # ------------------------------------------------------------------ batch lifecycle
    def set_batch(
        self,
        lengths: Optional[LengthsLike] = None,
        *,
        cu_seqlens: Optional[LengthsLike] = None,
    ) -> PackedBatch:
        """Load a packed microbatch given host ``lengths`` (or host ``cu_seqlens``).

        Validates on the host (errors raised before any device work), fills the slot's pinned
        staging record and issues ONE non-blocking host->device copy into its static buffers,
        then builds every registered derived tensor into the slot's params. Reserves the slot
        until :meth:`release`.
        """
        slot = self._load(None, lengths, cu_seqlens)
        self._build_all(slot)
        return self._handle(slot)

    def load_slot(self, index: int, lengths: Optional[LengthsLike] = None, *,
                  cu_seqlens: Optional[LengthsLike] = None, copy_record: bool = True) -> PackedBatch:
        """The host half of :meth:`set_batch` into slot ``index`` (which must be free): validate
        and, with ``copy_record``, stage and issue the one host->device copy of the boundary
        record; nothing derived. A full-iteration CUDA graph loads every microbatch of a step
        this way before its replay and builds the rest inside the graph (:meth:`build_slot`);
        without ``copy_record`` the graph builds the record too, from the lengths. Reserves the
        slot until :meth:`release`."""
        return self._handle(self._load(index, lengths, cu_seqlens, copy_record))

    def build_slot(self, index: int, lengths_S: Optional[torch.Tensor] = None) -> PackedBatch:
        """The device half: (given ``lengths_S``, int32 [S] device lengths padded with zeros --
        the ones :meth:`load_slot` validated -- first the slot's boundary record, as the host
        would build it) every registered derived tensor of slot ``index`` from its record.
        Static-shape device ops, no host read: capturable."""
        slot = self.slots[index]
        if not slot.busy:
            raise RuntimeError(f"build_slot({index}): the slot holds no batch; load_slot it first")
        if lengths_S is not None:
            if self.config.context_parallel_size > 1:
                raise ValueError(
                    "build_slot(lengths_S=...) builds the record without context parallelism; "
                    "the CP layout is built on the host: load_slot(copy_record=True)")
            from megatron_fastpath.packed_seq.device_record import build_record_from_lengths

            c = self.config
            build_record_from_lengths(lengths_S, slot.record_R, c.max_tokens, c.max_seqs,
                                      c.max_seqlen_bound)
        self._build_all(slot)
        return self._handle(slot)

    def _load(self, index: Optional[int], lengths, cu_seqlens, copy_record: bool = True) -> _Slot:
        host = build_host_metadata(
            resolve_lengths(lengths, cu_seqlens),
            self.config.max_tokens,
            self.config.max_seqs,
            self.config.max_seqlen_bound,
        )
        record_R = host.record_R
        cp = self.config.context_parallel_size
        if cp > 1:
            record_R = build_cp_host_metadata(
                host.lengths_N, self.config.max_tokens, self.config.max_seqs,
                self.config.max_seqlen_bound, cp, self.config.context_parallel_rank).record_R
        slot = self._acquire_slot() if index is None else self._take_slot(index)
        self._next_version += 1
        slot.version = self._next_version
        slot.host = host
        self._last = slot
        self.stats.batches += 1
        if not copy_record:
            return slot
        if slot.copy_done is not None and not slot.copy_done.query():
            # The previous batch's copy out of this staging buffer is still queued (rare: a
            # whole forward+backward ran since). Waiting on that event is not a D2H transfer.
            slot.copy_done.synchronize()
        slot.staging_R.copy_(torch.from_numpy(record_R))  # host -> pinned host
        slot.record_R.copy_(slot.staging_R, non_blocking=True)
        if slot.copy_done is not None:
            slot.copy_done.record()
        self.stats.host_to_device_copies += 1
        self.stats.bytes_copied += slot.record_R.numel() * slot.record_R.element_size()
        return slot

    def release(self, batch: PackedBatch) -> None:
        """Mark the batch's slot reusable (call after its backward has been issued)."""
        slot = self.slots[batch.slot]
        if slot.version != batch.version or not slot.busy:
            raise RuntimeError(
                f"PackedBatch(slot={batch.slot}, version={batch.version}) was already released"
            )
        slot.busy = False

    @contextlib.contextmanager
    def batch(self, lengths: Optional[LengthsLike] = None, *, cu_seqlens=None) -> Iterator[PackedBatch]:
        """``set_batch`` + ``release`` around a block holding the microbatch's forward+backward."""
        pb = self.set_batch(lengths, cu_seqlens=cu_seqlens)
        try:
            yield pb
        finally:
            self.release(pb)

    def _take_slot(self, index: int) -> _Slot:
        if not 0 <= index < len(self.slots):
            raise ValueError(f"slot {index} does not exist: the cache has {len(self.slots)} slots")
        slot = self.slots[index]
        if slot.busy:
            raise RuntimeError(f"slot {index} still holds a microbatch in flight; release it first")
        slot.busy = True
        return slot

    def _acquire_slot(self) -> _Slot:
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._next_slot + k) % n]
            if not slot.busy:
                slot.busy = True
                self._next_slot = (slot.index + 1) % n
                return slot
        raise RuntimeError(
            f"all {n} PackedSeqCache slots hold microbatches still in flight; release finished "
            "batches (cache.release / the cache.batch() context) or raise "
            "PackedSeqConfig.num_slots to the number of microbatches in flight "
            "(the pipeline depth for 1F1B)"
        )

    @property
    def current(self) -> PackedBatch:
        """Host-side handle of the most recently loaded batch (for logging and tests; layers
        never read it -- they read the params they are given)."""
        if self._last is None or not self._last.busy:
            raise RuntimeError("no packed batch is loaded: call cache.set_batch(lengths) first")
        return self._handle(self._last)

    @staticmethod
    def _handle(slot: _Slot) -> PackedBatch:
        h = slot.host
        return PackedBatch(
            slot=slot.index,
            version=slot.version,
            packed_seq_params=slot.params,
            position_ids_1T=slot.position_ids_1T,
            padding_mask_1T=slot.padding_mask_1T,
            num_seqs=h.num_seqs,
            num_tokens=h.num_tokens,
            max_seqlen=h.max_seqlen,
            lengths_N=h.lengths_N,
        )

    def cache_bytes(self) -> int:
        """Device bytes the cache holds: every slot's record and derived fields, plus the one
        shared [T] int32 arange the mask builder uses (no T x T constant)."""
        seen, total = set(), 0
        for slot in self.slots:
            for t in [slot.record_R, *slot.params.tensors().values()]:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
        if self._arange_T is not None:
            total += self._arange_T.untyped_storage().nbytes()
        return total

    # ------------------------------------------------------------------ derived tensors
    def register(self, kind: str, dtype: Optional[torch.dtype] = None,
                 window: Optional[int] = None) -> None:
        """Declare that a consumer needs the derived tensors ``kind`` (a key of
        :data:`DERIVED_KINDS`), computed in ``dtype`` (kinds with ``compute_dtype``:
        "rope_cos_sin", "sdpa_mask" and "sdpa_mask_window"; default float32; the
        ``"kind:dtype"`` form is accepted). The windowed kinds take the sliding ``window``
        (one per cache: every windowed layer of a checkpoint has the same).
        Allocates the field in every slot's params now (the address never changes afterwards)
        and builds it for batches already loaded."""
        kind, _, dtype_name = kind.partition(":")
        spec = derived_kind(kind)
        if spec.windowed:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"{kind} needs a sliding window >= 1 token; got {window!r}")
            if self.window is not None and self.window != window:
                raise ValueError(
                    f"the cache builds its windowed masks for sliding_window={self.window}; a "
                    f"layer asked for {window}: one cache serves one window (give models of "
                    "another window their own PackedSeqCache)")
            self.window = window
        elif window is not None:
            raise ValueError(f"{kind} takes no window (got window={window})")
        if dtype_name:
            dtype = getattr(torch, dtype_name)
        dtype = dtype if spec.compute_dtype and dtype is not None else torch.float32
        if spec.needs_rope and self.config.rope is None:
            raise ValueError("RoPE requested but PackedSeqConfig.rope is None")
        if spec.needs_rope_local and self.config.rope_local is None:
            raise ValueError(f"{kind}: the second RoPE requested but PackedSeqConfig.rope_local "
                             "is None")
        if spec.dense_mask:
            self._check_sdpa_size()
        if kind in self._kinds:
            if self._kinds[kind] != dtype:
                raise ValueError(
                    f"{kind} is already built in {self._kinds[kind]}; one cache serves one compute "
                    f"dtype (got {dtype}): give models of another dtype their own PackedSeqCache"
                )
            return
        self._kinds[kind] = dtype
        for slot in self.slots:
            spec.allocate(self, slot, dtype)
            if slot.busy:
                self._build(slot, kind)

    def _build_all(self, slot: _Slot) -> None:
        p = slot.params
        if p.cp_token_index_T is not None:  # CP: real = not the pad row (sequence padding too)
            p.cp_token_index_T.copy_(slot.token_index_i32_T)
            torch.ne(p.cp_token_index_T, self.config.max_tokens, out=p.real_token_mask_T)
        else:
            torch.ge(p.seq_ids_T, 0, out=p.real_token_mask_T)
        torch.logical_not(p.real_token_mask_T.view(1, -1), out=slot.padding_mask_1T)
        for kind in self._kinds:
            self._build(slot, kind)

    def _build(self, slot: _Slot, kind: str) -> None:
        DERIVED_KINDS[kind].build(self, slot)
        self.stats.builds += 1
        self.stats.per_kind[kind] = self.stats.per_kind.get(kind, 0) + 1

    # real_mask: real_token_mask_T is a field of every slot, built for every batch by
    # _build_all (MoE routers read it too); registering it only counts its builds.
    def _allocate_real_mask(self, slot: _Slot, dtype: torch.dtype) -> None:
        pass

    def _build_real_mask(self, slot: _Slot) -> None:
        pass

    def _zeros_T1D(self, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((self.config.local_tokens, 1, dim), dtype=dtype, device=self.device)

    @staticmethod
    def _fill_cos_sin(rope, inv_freq, position_ids_T, cos_T1D, sin_T1D) -> None:
        """cos / sin of ``rope``'s angles at the packed positions into the static buffers."""
        emb_TD = rope.angles_TD(position_ids_T, inv_freq)
        cos_T1D.copy_(torch.cos(emb_TD).unsqueeze(1))
        sin_T1D.copy_(torch.sin(emb_TD).unsqueeze(1))

    def _allocate_rope_cos_sin(self, slot: _Slot, dtype: torch.dtype) -> None:
        slot.params.rope_cos_T1D = self._zeros_T1D(self.config.rope.dim, dtype)
        slot.params.rope_sin_T1D = self._zeros_T1D(self.config.rope.dim, dtype)

    def _build_rope_cos_sin(self, slot: _Slot) -> None:
        p = slot.params
        self._fill_cos_sin(self.config.rope, self._inv_freq, p.position_ids_T, p.rope_cos_T1D, p.rope_sin_T1D)

    def _allocate_rope_cos_sin_local(self, slot: _Slot, dtype: torch.dtype) -> None:
        slot.params.rope_local_cos_T1D = self._zeros_T1D(self.config.rope_local.dim, dtype)
        slot.params.rope_local_sin_T1D = self._zeros_T1D(self.config.rope_local.dim, dtype)

    def _build_rope_cos_sin_local(self, slot: _Slot) -> None:
        p = slot.params
        self._fill_cos_sin(self.config.rope_local, self._inv_freq_local, p.position_ids_T,
                           p.rope_local_cos_T1D, p.rope_local_sin_T1D)

    def _allocate_rope_freqs(self, slot: _Slot, dtype: torch.dtype) -> None:
        t, d = self.config.local_tokens, self.config.rope.dim
        slot.params.rope_freqs_T11D = torch.zeros((t, 1, 1, d), device=self.device)

    def _build_rope_freqs(self, slot: _Slot) -> None:
        """[T, 1, 1, D] float32 angles: the ``freqs`` of TE's fused RoPE in ``sbhd`` layout
        (one "sequence position" per packed token, so no cu_seqlens are needed)."""
        emb_TD = self.config.rope.angles_TD(slot.params.position_ids_T, self._inv_freq)
        slot.params.rope_freqs_T11D.copy_(emb_TD[:, None, None, :])

    def _check_sdpa_size(self):
        t, c = self.config.max_tokens, self.config
        if t > c.sdpa_mask_max_tokens:
            padded = ("context parallelism attends through it" if c.context_parallel_size > 1
                      else "sdpa_layout='padded' or 'auto' (the packed-to-padded view, no mask)")
            raise ValueError(
                f"the SDPA backend's mask layout needs a {t}x{t} mask ({t * t / 2**20:.0f} Mi "
                f"elements) per slot, above the limit sdpa_mask_max_tokens={c.sdpa_mask_max_tokens};"
                f" use the 'flex', 'flash' or 'te' backend (no dense mask), {padded}, or raise the limit"
            )

    def _allocate_sdpa_mask(self, slot: _Slot, dtype: torch.dtype, field: str = "sdpa_mask_TT") -> None:
        t = self.config.max_tokens
        setattr(slot.params, field, torch.zeros((self.config.local_tokens, t), dtype=dtype,
                                                device=self.device))

    def _allocate_sdpa_mask_window(self, slot: _Slot, dtype: torch.dtype) -> None:
        self._allocate_sdpa_mask(slot, dtype, "sdpa_mask_window_TT")

    def _build_sdpa_mask(self, slot: _Slot, window: Optional[int] = None) -> None:
        """mask[i, j] = 0 if start(i) <= j <= i else -inf, with start(i) = i - position(i) the
        first token of i's sequence. Sequences are contiguous, so this is "same sequence and
        causal"; a padding token has position 0, so its row is the diagonal alone (no fully
        masked row). Written in place into the slot's [T, T] buffer in the compute dtype: no
        causal constant is held, and SDPA gets a mask it uses as is (no per-layer conversion).
        With ``window`` W (into ``sdpa_mask_window_TT``) also j > i - W: inside a sequence the
        position difference is the index difference, so this is transformers' window."""
        p = slot.params
        if self._arange_T is None:
            self._arange_T = torch.arange(self.config.max_tokens, dtype=torch.int32, device=self.device)
        out_TT = p.sdpa_mask_TT if window is None else p.sdpa_mask_window_TT
        if p.cp_kv_seq_ids_K is not None:
            return self._build_sdpa_mask_cp(slot, out_TT, window)
        j_1T, i_T1 = self._arange_T.unsqueeze(0), self._arange_T.unsqueeze(1)
        outside_TT = torch.lt(j_1T, i_T1 - p.position_ids_T.unsqueeze(1))  # before its sequence
        outside_TT.logical_or_(torch.gt(j_1T, i_T1))  # after the query: causal
        if window is not None:  # W or more tokens back: outside the window
            outside_TT.logical_or_(torch.le(j_1T, i_T1 - window))
        out_TT.zero_().masked_fill_(outside_TT, float("-inf"))

    def _build_sdpa_mask_window(self, slot: _Slot) -> None:
        self._build_sdpa_mask(slot, self.window)

    def _build_sdpa_mask_cp(self, slot: _Slot, out_TK: torch.Tensor, window: Optional[int]) -> None:
        """CP: local query i (gathered index rank * T_l + i) may attend gathered key j when both
        are in the same sequence and j's global position is <= i's (and, with ``window`` W,
        > i's - W); a tail token attends itself."""
        p, tl = slot.params, self.config.local_tokens
        sid_T1, pos_T1 = p.seq_ids_T.unsqueeze(1), p.position_ids_T.unsqueeze(1)
        kv_pos_1K = p.cp_kv_position_ids_K.unsqueeze(0)
        allowed_TK = torch.eq(sid_T1, p.cp_kv_seq_ids_K.unsqueeze(0))
        allowed_TK.logical_and_(torch.ge(sid_T1, 0))
        allowed_TK.logical_and_(torch.le(kv_pos_1K, pos_T1))
        if window is not None:
            allowed_TK.logical_and_(torch.gt(kv_pos_1K, pos_T1 - window))
        own_T1 = self._arange_T[:tl].unsqueeze(1) + self.config.context_parallel_rank * tl
        allowed_TK.logical_or_(torch.eq(self._arange_T.unsqueeze(0), own_T1))
        out_TK.zero_().masked_fill_(allowed_TK.logical_not_(), float("-inf"))

    def _allocate_sdpa_padded(self, slot: _Slot, dtype: torch.dtype) -> None:
        t, rows, m = self.config.max_tokens, self.config.max_seqs, self.config.max_seqlen_bound
        slot.pad_gather_ext = torch.zeros((rows * m + 1,), dtype=torch.int64, device=self.device)
        slot.params.pad_gather_SM = slot.pad_gather_ext[: rows * m].view(rows, m)
        slot.params.pad_scatter_T = torch.zeros((t,), dtype=torch.int64, device=self.device)

    def _build_sdpa_padded(self, slot: _Slot) -> None:
        """The packed-to-padded index pair, from the slot's sequence ids and positions on the
        device (no host read): token t of sequence s at position i sits in cell s * M + i;
        every other cell gathers token 0, every padding token scatters from cell 0 -- indices
        that never point past the tensors they index, so the reader appends no zero row (the
        gather buffer's extra last cell only absorbs the padding tokens' writes here)."""
        p, t = slot.params, self.config.max_tokens
        s_rows, m = p.pad_gather_SM.shape
        if self._arange_T is None:
            self._arange_T = torch.arange(t, dtype=torch.int32, device=self.device)
        seq_T = p.seq_ids_T.to(torch.int64)
        real_T = seq_T >= 0
        cell_T = torch.where(real_T, seq_T * m + p.position_ids_T.to(torch.int64), s_rows * m)
        slot.pad_gather_ext.zero_().scatter_(0, cell_T, self._arange_T.to(torch.int64))
        p.pad_scatter_T.copy_(cell_T).masked_fill_(real_T.logical_not_(), 0)

    def _allocate_flex_block_mask(self, slot: _Slot, dtype: torch.dtype, prefix: str = "flex_") -> None:
        nb = -(-self.config.max_tokens // FLEX_BLOCK)
        for name in _FLEX_FIELDS:
            shape = (1, 1, nb) if name.endswith("num_blocks") else (1, 1, nb, nb)
            setattr(slot.params, f"{prefix}{name}", torch.zeros(shape, dtype=torch.int32, device=self.device))

    def _build_flex_block_mask(self, slot: _Slot, window: Optional[int] = None) -> None:
        """The BlockMask of the same mask, copied into the slot's static index tensors
        (``create_block_mask`` allocates fresh ones; a graph replay needs fixed addresses)."""
        from torch.nn.attention.flex_attention import create_block_mask

        t = self.config.max_tokens
        fresh = create_block_mask(packed_causal_mask_mod(slot.params.seq_ids_T, window), None, None,
                                  t, t, device=self.device, BLOCK_SIZE=FLEX_BLOCK)
        prefix = "flex_" if window is None else "flex_window_"
        for name in _FLEX_FIELDS:
            getattr(slot.params, f"{prefix}{name}").copy_(getattr(fresh, name))

    def _allocate_flex_block_mask_window(self, slot: _Slot, dtype: torch.dtype) -> None:
        self._allocate_flex_block_mask(slot, dtype, "flex_window_")

    def _build_flex_block_mask_window(self, slot: _Slot) -> None:
        self._build_flex_block_mask(slot, self.window)


@dataclasses.dataclass(frozen=True)
class DerivedKind:
    """One kind of derived tensors a consumer can :meth:`PackedSeqCache.register`.

    allocate(cache, slot, dtype): create the kind's static fields in a slot's params (once).
    build(cache, slot): write them for the slot's current batch (once per batch).
    compute_dtype: built in the consumer's dtype (else float32).
    needs_rope: needs ``PackedSeqConfig.rope``.
    needs_rope_local: needs ``PackedSeqConfig.rope_local`` (the second RoPE).
    dense_mask: a [T, T] mask per slot (refused above ``sdpa_mask_max_tokens``).
    windowed: built for the cache's sliding :attr:`PackedSeqCache.window` (given at register).
    """

    allocate: Callable[[PackedSeqCache, _Slot, torch.dtype], None]
    build: Callable[[PackedSeqCache, _Slot], None]
    compute_dtype: bool = False
    needs_rope: bool = False
    needs_rope_local: bool = False
    dense_mask: bool = False
    windowed: bool = False


# Every derived kind of the cache: the one list a consumer registers from.
DERIVED_KINDS: dict[str, DerivedKind] = {
    "real_mask": DerivedKind(PackedSeqCache._allocate_real_mask, PackedSeqCache._build_real_mask),
    "rope_cos_sin": DerivedKind(PackedSeqCache._allocate_rope_cos_sin,
                                PackedSeqCache._build_rope_cos_sin, compute_dtype=True,
                                needs_rope=True),
    "rope_freqs": DerivedKind(PackedSeqCache._allocate_rope_freqs, PackedSeqCache._build_rope_freqs,
                              needs_rope=True),
    "rope_cos_sin_local": DerivedKind(PackedSeqCache._allocate_rope_cos_sin_local,
                                      PackedSeqCache._build_rope_cos_sin_local, compute_dtype=True,
                                      needs_rope=True, needs_rope_local=True),
    "sdpa_mask": DerivedKind(PackedSeqCache._allocate_sdpa_mask, PackedSeqCache._build_sdpa_mask,
                             compute_dtype=True, dense_mask=True),
    "sdpa_padded": DerivedKind(PackedSeqCache._allocate_sdpa_padded,
                               PackedSeqCache._build_sdpa_padded),
    "flex_block_mask": DerivedKind(PackedSeqCache._allocate_flex_block_mask,
                                   PackedSeqCache._build_flex_block_mask),
    "sdpa_mask_window": DerivedKind(PackedSeqCache._allocate_sdpa_mask_window,
                                    PackedSeqCache._build_sdpa_mask_window, compute_dtype=True,
                                    dense_mask=True, windowed=True),
    "flex_block_mask_window": DerivedKind(PackedSeqCache._allocate_flex_block_mask_window,
                                          PackedSeqCache._build_flex_block_mask_window,
                                          windowed=True),
}
KINDS = tuple(DERIVED_KINDS)


def derived_kind(kind: str) -> DerivedKind:
    """The registry entry of ``kind``; an unknown kind is refused with the known ones."""
    spec = DERIVED_KINDS.get(kind)
    if spec is None:
        raise ValueError(
            f"unknown derived kind {kind!r}: the cache builds only its registered kinds; "
            f"register one of the known kinds {list(DERIVED_KINDS)}")
    return spec


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
        *(getattr(params, f"{prefix}{name}") for name in _FLEX_FIELDS),
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=mask_mod,
    )
